"""A lowering that stops part way resumes: each method whose worker finished is kept beside the run
(``.<run>.lowered/<method>/``) with a stamp of its inputs, and the next lowering of the run lowers only the
methods it lacks (zoo.export.lower.kept_parts), on the CPU with the probe backend (tests/fixtures).

One method's worker SIGKILLs itself once the other two parts are kept (tests/fixtures/resumable_probe.py): a
deterministic stand-in for a lowering cut short. Which methods were lowered is counted outside zoo, by the
lowering function appending its method to a file.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from zoo.contract.attempt import Attempt
from zoo.contract.run_folder import ARTIFACT_OUTPUTS, RunFolder
from zoo.core.errors import LoweringError
from zoo.core.report import RunReport
from zoo.export.lower import lowering
from zoo.export.lower.kept_parts import stamp_differences

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
from resumable_probe import CALLS_FILE, COUNTED_LOWERING, KILL_AFTER_KEPT, KILL_METHOD  # noqa: E402

DIM = 32
METHODS = ("observe", "act", "encode")
KILLED = "encode"


class Unit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(DIM, DIM)
        self.observe_head = nn.Linear(DIM, 2)
        self.act_head = nn.Linear(DIM, 2)
        self.encoder = nn.Linear(DIM, 4)


class Observe(nn.Module):
    def __init__(self, unit: Unit) -> None:
        super().__init__()
        self.unit = unit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.unit.observe_head(torch.relu(self.unit.trunk(x)))


class Act(nn.Module):
    def __init__(self, unit: Unit, sign: float = 1.0) -> None:
        super().__init__()
        self.unit, self.sign = unit, sign

    def forward(self, noise: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.unit.act_head(torch.tanh(self.unit.trunk(x))) + self.sign * noise


class Encode(nn.Module):
    def __init__(self, unit: Unit) -> None:
        super().__init__()
        self.unit = unit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.unit.encoder(x))


def export(method: str, act_sign: float = 1.0):
    unit = Unit()
    x, noise = torch.randn(3, DIM), torch.randn(3, 2)
    modules = {"observe": (Observe(unit), (x,)), "act": (Act(unit, act_sign), (noise, x)),
               "encode": (Encode(unit), (x,))}
    module, args = modules[method]
    with torch.no_grad():
        return torch.export.export(module, args)


def good_run(path: Path) -> RunFolder:
    """A run folder as a finished export leaves it: recipe, rewritten programs, a report that passed export."""
    run = RunFolder(path)
    path.mkdir(parents=True)
    (path / "recipe.yaml").write_text(OmegaConf.to_yaml({
        "name": "resume-toy", "family": "llama", "source": {"repo_id": "none/none"},
        "unit": {"methods": list(METHODS), "dtype": "float32"}, "lowering": {"triton_kernel_mode": "OFF"}}))
    for method in METHODS:
        run.save_program(export(method), "rewritten", method)
    report = RunReport(path, {"name": "resume-toy"})
    report.stage("export", "done", 1.0, "")
    report.record("status", "done")
    run.write_report(report)
    return run


def files(run: RunFolder):
    return {m: run.program("rewritten", m) for m in METHODS}


def tree(folder: Path):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def take_calls(path: Path):
    calls = path.read_text().split() if path.exists() else []
    path.unlink(missing_ok=True)
    return calls


def lower(run: RunFolder, recipe=None, **options):
    lines = []
    result = lowering.lower_to_pte(files(run), run, recipe or run.load_recipe(), workers=2,
                                   method_lowering=COUNTED_LOWERING, say=lines.append, **options)
    return result, lines


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted lowering; an attempt on a good run whose third method's worker is killed once two
    parts are kept; the next attempt on that run, which resumes."""
    root = tmp_path_factory.mktemp("resume")
    calls = root / "calls.txt"
    env = pytest.MonkeyPatch()
    env.setenv(CALLS_FILE, str(calls))
    try:
        reference = good_run(root / "reference")
        result, _ = lower(reference)
        out = {"root": root, "calls": calls, "reference": {"run": reference, "result": result,
                                                          "calls": take_calls(calls)}}
        run = good_run(root / "run")
        out["before"] = tree(run.path)
        attempt = Attempt.begin(run.path, seed=True, rebuilt=ARTIFACT_OUTPUTS, keep_on_failure=None)
        env.setenv(KILL_METHOD, KILLED)
        env.setenv(KILL_AFTER_KEPT, f"{run.kept_parts_dir}:2")
        lines = []
        with pytest.raises(LoweringError) as killed:
            lowering.lower_to_pte(files(attempt.staging), attempt.staging, run.load_recipe(), workers=2,
                                  method_lowering=COUNTED_LOWERING, say=lines.append)
        env.delenv(KILL_METHOD)
        env.delenv(KILL_AFTER_KEPT)
        failed = RunReport(attempt.staging.path, {"name": "resume-toy"})
        failed.stage("lower", "failed", None, killed.value.message)
        failed.record("status", "failed")
        attempt.finish(failed, failed=True)
        assert run.kept_parts_dir == root / ".run.lowered"  # beside the run, not in it
        out["killed"] = {"error": killed.value, "lines": lines, "calls": take_calls(calls),
                         "kept": sorted(p.name for p in run.kept_parts_dir.iterdir()), "after": tree(run.path)}
        shutil.copytree(run.kept_parts_dir, root / "kept-snapshot", copy_function=shutil.copy2)
        resumed = Attempt.begin(run.path, seed=True, rebuilt=ARTIFACT_OUTPUTS, keep_on_failure=None)
        result, lines = lower(resumed.staging)
        out["resumed"] = {"run": resumed.staging, "result": result, "lines": lines, "calls": take_calls(calls),
                          "kept_left": run.kept_parts_dir.exists()}
        yield out
        resumed.abandon()
    finally:
        env.undo()


@pytest.mark.e2e  # three real lowerings of three methods: ~3 min of a CI worker (pytest -m e2e)
def test_the_killed_lowering_keeps_the_two_finished_methods_outside_the_run(runs):
    killed = runs["killed"]
    assert sorted(killed["calls"]) == sorted(METHODS)  # all three started; the third died in its worker
    assert "died (signal 9)" in killed["error"].message and repr(KILLED) in killed["error"].message
    assert killed["kept"] == sorted(set(METHODS) - {KILLED})
    root = runs["root"]
    for method in killed["kept"]:
        part = root / "kept-snapshot" / method  # as .run.lowered/ held it before the resume removed it
        assert sorted(p.name for p in part.iterdir()) == sorted(
            [f"{method}.pte", "result.json", "stamp.json"] + [p.name for p in part.glob("*.ptd")])
        assert list(part.glob("*.ptd"))  # the probe's weights go to a .ptd, as the CUDA backend's do
    # The good run is byte for byte as it was: the failed attempt went to attempts/, the parts beside the run.
    after = {k: v for k, v in killed["after"].items() if not k.startswith("attempts/")}
    assert after == runs["before"]
    assert not any(".lowered" in k for k in killed["after"])


@pytest.mark.e2e  # three real lowerings of three methods: ~3 min of a CI worker (pytest -m e2e)
def test_the_next_lowering_lowers_only_the_method_that_was_killed(runs):
    resumed = runs["resumed"]
    assert resumed["calls"] == [KILLED]
    assert runs["reference"]["calls"] and sorted(runs["reference"]["calls"]) == sorted(METHODS)
    reused = [m for m in METHODS if m != KILLED]
    for method in reused:
        assert f"reusing the lowered {method} from an earlier lowering that stopped (stamp matches)" in resumed["lines"]
    assert resumed["result"].workers["reused"] == reused
    assert runs["reference"]["result"].workers["reused"] == []
    assert "reused from an earlier lowering that stopped (stamp matches): observe, act" in resumed["result"].table()
    assert resumed["result"].summary()["workers"]["reused"] == reused  # the run report's lowering section
    assert resumed["kept_left"] is False  # assembled: the kept parts are removed


@pytest.mark.e2e  # three real lowerings of three methods: ~3 min of a CI worker (pytest -m e2e)
def test_the_resumed_artifact_is_byte_identical_to_an_uninterrupted_lowering(runs):
    reference, resumed = runs["reference"]["run"], runs["resumed"]["run"]
    assert resumed.pte.read_bytes() == reference.pte.read_bytes()
    assert resumed.ptd.read_bytes() == reference.ptd.read_bytes()
    # so/'s extraction record names the files' inodes and times, which differ by nature: the files themselves not.
    extracted = {k: v for k, v in tree(resumed.so_dir).items() if not k.startswith(".") and k.split(".")[-1] != "json"
                 or k.endswith(".io.json")}
    assert extracted == {k: v for k, v in tree(reference.so_dir).items() if k in extracted}
    assert sorted(k for k in extracted if k.endswith(".so")) == sorted(f"{m}.so" for m in METHODS)


def copied_run(runs, name: str) -> RunFolder:
    """A copy of the run with the parts the killed lowering kept, as it kept them."""
    run = RunFolder(runs["root"] / name)
    shutil.copytree(runs["root"] / "run", run.path, ignore=shutil.ignore_patterns("attempts"))
    shutil.copytree(runs["root"] / "kept-snapshot", run.kept_parts_dir)
    return run


def lower_killing_every_worker(run: RunFolder, recipe=None):
    """Lower with every worker killing itself at once: what is reused or redone shows before anything compiles."""
    env = pytest.MonkeyPatch()
    env.setenv(KILL_METHOD, "*")
    env.delenv(KILL_AFTER_KEPT, raising=False)  # at once: no waiting for parts
    try:
        lines = []
        with pytest.raises(LoweringError, match="died"):
            lowering.lower_to_pte(files(run), run, recipe or run.load_recipe(), workers=2,
                                  method_lowering=COUNTED_LOWERING, say=lines.append)
        return lines
    finally:
        env.undo()


@pytest.mark.e2e  # three real lowerings of three methods: ~3 min of a CI worker (pytest -m e2e)
def test_a_changed_option_invalidates_every_kept_part_and_says_what_changed(runs):
    run = copied_run(runs, "changed-options")
    lines = lower_killing_every_worker(run, run.load_recipe(["lowering.max_mm_configs=3"]))
    for method in ("observe", "act"):
        assert (f"lowering {method} again: the part an earlier lowering kept does not match "
                "(lowering options changed: max_mm_configs)") in lines
    assert not any(line.startswith("reusing") for line in lines)
    assert not (run.kept_parts_dir / "observe").exists() and not (run.kept_parts_dir / "act").exists()


@pytest.mark.e2e  # three real lowerings of three methods: ~3 min of a CI worker (pytest -m e2e)
def test_a_changed_program_invalidates_its_part_only(runs):
    run = copied_run(runs, "changed-program")
    run.save_program(export("act", act_sign=-1.0), "rewritten", "act")  # the same weights, another graph
    lines = lower_killing_every_worker(run)
    assert "lowering act again: the part an earlier lowering kept does not match (program changed)" in lines
    assert "reusing the lowered observe from an earlier lowering that stopped (stamp matches)" in lines


@pytest.mark.e2e  # three real lowerings of three methods: ~3 min of a CI worker (pytest -m e2e)
def test_another_torch_invalidates_the_part_and_names_both_versions(runs):
    run = copied_run(runs, "other-torch")
    stamp_file = run.kept_parts_dir / "observe" / "stamp.json"
    stamp = json.loads(stamp_file.read_text())
    stamp["torch"] = "2.0.0"
    stamp_file.write_text(json.dumps(stamp))
    lines = lower_killing_every_worker(run)
    assert (f"lowering observe again: the part an earlier lowering kept does not match "
            f"(torch 2.0.0 -> {torch.__version__})") in lines
    assert "reusing the lowered act from an earlier lowering that stopped (stamp matches)" in lines


@pytest.mark.e2e  # three real lowerings of three methods: ~3 min of a CI worker (pytest -m e2e)
def test_the_stamp_records_what_the_part_was_lowered_from(runs):
    import hashlib

    stamp = json.loads((runs["root"] / "kept-snapshot" / "observe" / "stamp.json").read_text())
    program = runs["root"] / "run" / "rewritten.observe.pt2"
    assert stamp["program_sha256"] == hashlib.sha256(program.read_bytes()).hexdigest()
    assert stamp["function"] == "resumable_probe:lower_counted"
    assert stamp["torch"] == torch.__version__ and stamp["gpu"] == "no GPU (resumable_probe:lower_counted)"
    assert stamp["options"]["triton_kernel_mode"] == "OFF" and stamp["options"]["max_mm_configs"] is None
    assert "constant_plan" in stamp["options"] and stamp["options"]["preflight"] is True


@pytest.mark.e2e  # three real lowerings of three methods: ~3 min of a CI worker (pytest -m e2e)
def test_in_process_lowering_resumes_too(runs):
    run = copied_run(runs, "in-process")
    take_calls(runs["calls"])  # the calls of the workers killed in the tests before this one
    lines = []
    result = lowering.lower_to_pte(files(run), run, run.load_recipe(), workers=1,
                                   method_lowering=COUNTED_LOWERING, say=lines.append)
    assert result.workers["in_process"] is True and result.workers["reused"] == ["observe", "act"]
    assert take_calls(runs["calls"]) == [KILLED]
    assert run.pte.read_bytes() == runs["reference"]["run"].pte.read_bytes()


def test_stamp_differences_name_each_field():
    kept = {"program_sha256": "a", "options": {"triton_kernel_mode": "ON", "max_mm_configs": 4}, "function": "f",
            "torch": "2.11.0", "executorch": "1.2.0", "gpu": "NVIDIA H200 (sm_90)"}
    assert stamp_differences(kept, dict(kept)) == []
    now = {**kept, "program_sha256": "b", "options": {"triton_kernel_mode": "OFF", "max_mm_configs": 4},
           "torch": "2.12.0", "gpu": "NVIDIA H100 (sm_90)"}
    assert stamp_differences(kept, now) == ["program changed", "lowering options changed: triton_kernel_mode",
                                            "torch 2.11.0 -> 2.12.0",
                                            "GPU NVIDIA H200 (sm_90) -> NVIDIA H100 (sm_90)"]


def test_the_kept_parts_go_before_the_weights_are_extracted_again(tmp_path, monkeypatch):
    """Kept parts are hard links of the parts: removed only after the extraction, they would hold a second copy of
    every method's weights on disk while ``so/`` is written (a real-size lowering ran out of a 64 GiB disk so)."""
    from zoo.export.lower import outputs
    from zoo.export.lower.workers import MethodPart

    order = []

    class Assembled:
        data_files = {}

    monkeypatch.setattr(outputs, "assemble_program", lambda *a, **k: order.append("assemble") or Assembled())
    monkeypatch.setattr(outputs, "extract_method_files", lambda *a, **k: order.append("extract") or {})
    io = {"input_names": ["x"], "output_names": ["y"], "input_order": [0], "output_order": [0]}
    part = MethodPart("act", tmp_path / "act.pte", {}, {"io": io}, 1.0, None)
    with pytest.raises(LoweringError, match="has no act"):
        outputs.write_artifacts({"act": part}, RunFolder(tmp_path / "run"), {},
                                assembled_hook=lambda: order.append("kept parts removed"))
    assert order == ["assemble", "kept parts removed", "extract"]


def test_a_disk_too_small_for_the_lowering_is_refused_before_any_compile(tmp_path, monkeypatch):
    """Two methods sharing one 10 GB table and a third carrying 3 GB: parts 23 GB, the .ptd 13 GB (the table once),
    so a disk with 30 GB free is refused with both numbers, and one with 40 GB is not."""
    from types import SimpleNamespace

    shared = SimpleNamespace(nbytes=10 * 10**9)
    tables = lowering.ConstantTables(decision={}, method_plan={"a": shared, "b": shared},
                                     carried={"a": 10 * 10**9, "b": 10 * 10**9, "c": 3 * 10**9})
    assert lowering.disk_needed(tables) == 36 * 10**9
    monkeypatch.setattr(lowering.shutil, "disk_usage", lambda path: SimpleNamespace(free=30 * 10**9))
    with pytest.raises(LoweringError, match=r"needs about 39.6 GB free .* and 30.0 GB are") as err:
        lowering.check_disk(tmp_path, tables)
    assert "free disk space" in err.value.hint
    monkeypatch.setattr(lowering.shutil, "disk_usage", lambda path: SimpleNamespace(free=40 * 10**9))
    lowering.check_disk(tmp_path, tables)
