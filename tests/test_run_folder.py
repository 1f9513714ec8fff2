"""The run folder contract (zoo/contract/run_folder.py): every file at its documented place, what is written is what is
read back, a run replaces an earlier one whole, and no other module spells the folder's file names."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest
import torch

from zoo.core.errors import LoweringError, ZooError
from zoo.core.report import RunReport
from zoo.contract.host_settings import NoHostSettings
from zoo.contract.io_spec import IoSpec, MethodIo
from zoo.contract.attempt import Attempt
from zoo.contract.run_folder import RunFolder

ROOT = Path(__file__).resolve().parent.parent


def test_every_file_is_where_the_documented_layout_puts_it(tmp_path):
    run = RunFolder(tmp_path)
    layout = {  # README.md and docs/ARCHITECTURE.md, "The run folder"
        run.recipe_file: "recipe.yaml", run.source_file: "source.json", run.io_spec_file: "io_spec.json",
        run.host_settings_file: "host_settings.json", run.processors_dir: "processors",
        run.report_json: "report.json", run.report_md: "report.md", run.manifest_file: "manifest.json",
        run.publish_dir: "publish", run.pte: "model.pte", run.ptd: "aoti_cuda_blob.ptd",
        run.program("exported", "video_step"): "exported.video_step.pt2",
        run.program("reference_fp32", "forward"): "reference_fp32.forward.pt2",
        run.program("rewritten", "forward"): "rewritten.forward.pt2",
        run.so_file("action_step"): "so/action_step.so",
        run.weights_file("action_step"): "so/action_step.weights.blob",
        run.io_order_file("action_step"): "so/action_step.io.json",
    }
    assert {path.relative_to(tmp_path).as_posix(): name for path, name in layout.items()} == \
        {name: name for name in layout.values()}
    with pytest.raises(ValueError, match="program kind"):
        run.program("lowered", "forward")
    assert RunFolder(run) == run and RunFolder(str(tmp_path)).path == tmp_path


def test_what_is_written_is_read_back(tmp_path, test_recipe):
    run = RunFolder(tmp_path / "run")
    recipe = test_recipe("toy-rope", "verify.seeds=[3,4]")
    run.write_recipe(recipe)
    assert run.load_recipe().to_dict() == recipe.to_dict()
    assert run.load_recipe(["verify.seeds=[9]"]).verify.seeds == [9]
    assert run.recipe_dict()["verify"]["seeds"] == [3, 4]
    io_spec = IoSpec(dtype="float32", methods={"forward": MethodIo(inputs=[], outputs=["y"])})
    run.write_io_spec(io_spec)
    run.write_host_settings(NoHostSettings())
    assert json.loads(run.io_spec_file.read_text()) == {"format": 1, "dtype": "float32", "dynamic": {},
                                                         "example_sizes": {},
                                                         "methods": {"forward": {"inputs": [], "outputs": ["y"]}}}
    assert run.read_io_spec() == io_spec
    assert json.loads(run.host_settings_file.read_text()) == {"format": 1, "family": "none"}
    assert run.read_host_settings() == NoHostSettings()
    run.write_io_order("forward", {"input_order": [1, 0], "output_order": [0]})
    assert run.io_order("forward")["input_order"] == [1, 0]

    class Twice(torch.nn.Module):
        def forward(self, x):
            return x * 2

    program = torch.export.export(Twice(), (torch.ones(3),))
    assert run.save_program(program, "rewritten", "forward") == run.program("rewritten", "forward")
    x = torch.arange(3.0)
    assert torch.equal(run.load_program("rewritten", "forward").module()(x), x * 2)

    report = RunReport(run.path, recipe.to_dict())
    report.stage("export", "done", 1.5, "1 method")
    run.write_report(report)
    again = run.read_report()
    assert again.data == json.loads(run.report_json.read_text()) and again.stages[0]["stage"] == "export"
    assert "# zoo run: toy-rope" in run.report_md.read_text()


def test_missing_files_are_clear_errors(tmp_path):
    run = RunFolder(tmp_path)
    with pytest.raises(LoweringError, match="recipe.yaml is missing"):
        run.load_recipe()
    with pytest.raises(LoweringError, match="delegate I/O order of method 'forward' is unknown"):
        run.io_order("forward")
    assert run.read_report().stages == [] and run.recipe_dict() is None and not run.is_run()


def test_host_files_are_copied_flat_and_a_missing_one_is_refused(tmp_path):
    (tmp_path / "ckpt" / "tok").mkdir(parents=True)
    (tmp_path / "ckpt" / "policy_preprocessor.json").write_text("{}")
    (tmp_path / "ckpt" / "tok" / "vocab.txt").write_text("a b")
    run = RunFolder(tmp_path / "run")
    assert run.copy_host_files([tmp_path / "ckpt" / "policy_preprocessor.json", tmp_path / "ckpt" / "tok"]) == [
        "policy_preprocessor.json", "tok"]
    assert (run.processors_dir / "tok" / "vocab.txt").read_text() == "a b"
    with pytest.raises(ZooError, match="does not exist"):
        run.copy_host_files([tmp_path / "ckpt" / "gone.json"])


def test_a_staged_run_replaces_the_folder_whole(tmp_path):
    run = RunFolder(tmp_path / "run").prepare()
    run.path.mkdir()
    run.write_report(RunReport(run.path))
    (run.path / "rewritten.old.pt2").write_bytes(b"old")
    staging = run.new_staging()
    assert staging.path.parent == run.path.parent and staging.name.startswith(".run.partial-")
    staging.write_report(RunReport(staging.path))
    (staging.path / "left-over").write_text("x")
    staging.keep_only(["report.json", "report.md"])
    run.replace_with(staging)
    assert sorted(p.name for p in run.path.iterdir()) == ["report.json", "report.md"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no staging or old copy left behind


def test_prepare_refuses_what_is_not_a_run_and_removes_dead_staging(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ZooError, match="exists and is a file"):
        RunFolder(tmp_path / "file").prepare()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("precious")
    with pytest.raises(ZooError, match="holds no zoo run"):
        RunFolder(tmp_path / "mine").prepare()
    dead, alive = tmp_path / ".run.partial-999999999", tmp_path / f".run.partial-{os.getpid()}"
    dead.mkdir()
    alive.mkdir()
    RunFolder(tmp_path / "run").prepare()
    assert not dead.exists() and alive.exists()


# --------------------------------------------------------------------------------------------------------
# The file names live in zoo/contract/run_folder.py (and the artifact's in zoo/contract/artifact.py) only


NAMES = {"recipe.yaml", "source.json", "io_spec.json", "host_settings.json", "report.json", "report.md",
         "manifest.json", "model.pte", "aoti_cuda_blob.ptd"}
FOLDERS = {"processors", "publish", "so"}  # plain words: spelled as a file name only when joined into a path
FRAGMENTS = (".pt2", ".io.json", ".weights.blob", ".partial-", "*.so")
OWNERS = {"zoo/contract/run_folder.py", "zoo/contract/artifact.py"}
# Where a name is still spelled, and why.
STILL_SPELLED = {
    "zoo/cli/bundle.py": "the offline bundle's own manifest.json: a bundle is not a run folder",
}


def spelled_names(path: Path):
    """String literals in ``path`` that spell a run folder file name: the name itself, a path joined from a
    folder name, or a piece of an f-string or pattern building a file name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in NAMES or (node.value != "." and any(f in node.value for f in FRAGMENTS)
                                       and len(node.value) < 40):
                found.append((node.lineno, node.value))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            if isinstance(node.right, ast.Constant) and node.right.value in FOLDERS:
                found.append((node.lineno, node.right.value))
    return found


def test_no_module_outside_the_run_folder_spells_its_file_names():
    sources = sorted(ROOT.glob("zoo/**/*.py")) + sorted(p for folder in ("scripts", "benchmarks", "tools")
                                                       for p in ROOT.glob(f"{folder}/*.py"))
    spelled = {p.relative_to(ROOT).as_posix(): spelled_names(p) for p in sources}
    spelled = {k: v for k, v in spelled.items() if v and k not in OWNERS}
    assert set(spelled) == set(STILL_SPELLED), {k: v for k, v in spelled.items() if k not in STILL_SPELLED}
    assert spelled_names(ROOT / "zoo" / "contract" / "run_folder.py")  # the check sees them where they are


# --------------------------------------------------------------------------------------------------------
# Attempts: a later attempt never changes a good run until it has passed at least the same stages


def _report(folder: Path, status: str, stages) -> RunReport:
    report = RunReport(folder, {"name": "toy"})
    for name, stage_status in stages:
        report.stage(name, stage_status, 1.0 if stage_status == "done" else None, "")
    report.record("status", status)
    return report


CPU_DONE = [("pull", "done"), ("export", "done"), ("lower", "skipped"), ("verify", "skipped")]
VERIFIED = [("pull", "done"), ("export", "done"), ("lower", "done"), ("verify", "done")]


def _earlier(tmp_path: Path, status: str, stages) -> RunFolder:
    run = RunFolder(tmp_path / "run")
    run.path.mkdir()
    run.write_report(_report(run.path, status, stages))
    (run.path / "model.pte").write_bytes(b"the earlier artifact")
    return run


def _files(folder: Path):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("earlier, attempt, failed, force, placed", [
    (None, ("done", CPU_DONE), False, False, True),  # nothing there: the attempt is the run
    (("failed", [("pull", "failed")]), ("failed", [("pull", "failed")]), True, False, True),  # nothing good there
    (("done", CPU_DONE), ("done", CPU_DONE), False, False, True),  # as far as the run there: replaces it
    (("done", CPU_DONE), ("verified", VERIFIED), False, False, True),  # further
    (("verified", VERIFIED), ("done", CPU_DONE), False, False, False),  # less far: kept aside
    (("verified", VERIFIED), ("done", CPU_DONE), False, True, True),  # ... unless forced
    (("done", CPU_DONE), ("failed", [("pull", "done"), ("export", "failed")]), True, False, False),  # failed
    (("done", CPU_DONE), ("failed", [("pull", "done"), ("export", "failed")]), True, True, False),  # even forced
    (("done", CPU_DONE), ("done", [("export", "done"), ("lower", "skipped")]), False, False, True),  # no pull: n/a
])
def test_where_an_attempt_goes(tmp_path, earlier, attempt, failed, force, placed):
    if earlier is not None:
        _earlier(tmp_path, *earlier)
    job = Attempt.begin(tmp_path / "run", force=force)
    placement = job.decide(_report(job.staging.path, *attempt), failed)
    assert placement.placed is placed
    if not placed:
        assert placement.folder.parent == job.run.attempts_dir and placement.folder.name.endswith(attempt[0])
        assert placement.reason
    job.abandon()


def test_a_kept_aside_attempt_leaves_the_run_byte_for_byte(tmp_path):
    run = _earlier(tmp_path, "verified", VERIFIED)
    before = _files(run.path)
    job = Attempt.begin(run.path)
    (job.staging.path / "rewritten.forward.pt2").write_bytes(b"new program")
    report = _report(job.staging.path, "done", CPU_DONE)
    placement = job.finish(report, failed=False)
    assert not placement.placed and "lower, verify" in placement.reason and "--force" in placement.reason
    after = _files(run.path)
    kept = {k: v for k, v in after.items() if k.startswith("attempts/")}
    assert {k: v for k, v in after.items() if not k.startswith("attempts/")} == before
    name = placement.folder.name
    assert set(kept) == {f"attempts/{name}/rewritten.forward.pt2", f"attempts/{name}/report.json",
                         f"attempts/{name}/report.md"}
    assert json.loads((placement.folder / "report.json").read_text())["run_dir"] == str(placement.folder)
    assert not list(tmp_path.glob(".run.*"))


def test_a_failed_attempt_keeps_only_its_report_recipe_and_log(tmp_path):
    run = _earlier(tmp_path, "done", CPU_DONE)
    job = Attempt.begin(run.path)
    for name in ("recipe.yaml", "export.log", "exported.forward.pt2"):
        (job.staging.path / name).write_text(name)
    placement = job.finish(_report(job.staging.path, "failed", [("pull", "failed")]), failed=True)
    assert sorted(p.name for p in placement.folder.iterdir()) == ["export.log", "recipe.yaml", "report.json",
                                                                  "report.md"]
    assert (run.path / "model.pte").read_bytes() == b"the earlier artifact"


def test_a_placed_attempt_keeps_the_attempts_of_the_run_it_replaces(tmp_path):
    run = _earlier(tmp_path, "done", CPU_DONE)
    (run.attempts_dir / "20250101-000000-failed").mkdir(parents=True)
    job = Attempt.begin(run.path)
    placement = job.finish(_report(job.staging.path, "verified", VERIFIED), failed=False)
    assert placement.placed and not (run.path / "model.pte").exists()  # the earlier run is gone ...
    assert [a.name for a in run.attempts()] == ["20250101-000000-failed"]  # ... its attempts are not
    assert json.loads(run.report_json.read_text())["status"] == "verified"


def test_a_report_that_cannot_be_written_keeps_nothing_and_touches_nothing(tmp_path, monkeypatch):
    import errno

    from zoo.core import atomic

    run = _earlier(tmp_path, "done", CPU_DONE)
    before = _files(run.path)
    job = Attempt.begin(run.path)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "report.json")

    monkeypatch.setattr(atomic, "write_json", disk_full)
    placement = job.finish(_report(job.staging.path, "verified", VERIFIED), failed=False)
    assert "No space left on device" in placement.write_error and not job.staging.path.exists()
    assert _files(run.path) == before


def test_a_lower_attempt_links_the_run_and_leaves_it_untouched(tmp_path):
    run = _earlier(tmp_path, "done", CPU_DONE)
    (run.path / "rewritten.forward.pt2").write_bytes(b"program")
    (run.path / "so").mkdir()
    (run.path / "so" / "forward.so").write_bytes(b"old so")
    before = _files(run.path)
    job = Attempt.begin(run.path, seed=True, rebuilt=("model.pte", "so"))
    staged = job.staging.path
    assert (staged / "rewritten.forward.pt2").stat().st_ino == (run.path / "rewritten.forward.pt2").stat().st_ino
    assert not (staged / "model.pte").exists() and not (staged / "so").exists()
    assert not (staged / "report.json").exists()  # written anew by the attempt
    from zoo.core import atomic

    atomic.write_bytes(staged / "rewritten.forward.pt2", b"rewritten through the link?")  # replaces the link
    assert _files(run.path) == before


def test_dead_staging_gives_its_attempts_back_and_a_moved_aside_run_is_put_back(tmp_path):
    run = _earlier(tmp_path, "done", CPU_DONE)
    dead = tmp_path / ".run.partial-999999999"
    (dead / "attempts" / "20250101-000000-interrupted").mkdir(parents=True)
    RunFolder(run.path).prepare()
    assert not dead.exists() and [a.name for a in run.attempts()] == ["20250101-000000-interrupted"]
    # Where the two folders could not be swapped in one step, a killed process may leave the run moved aside.
    moved = tmp_path / ".run.old-999999999"
    os.replace(run.path, moved)
    RunFolder(run.path).prepare()
    assert (run.path / "model.pte").read_bytes() == b"the earlier artifact" and not moved.exists()


def test_atomic_folder_replaces_whole_or_not_at_all(tmp_path):
    from zoo.core import atomic

    final = tmp_path / "publish"
    final.mkdir()
    (final / "README.md").write_text("old card")
    with pytest.raises(RuntimeError):
        with atomic.atomic_folder(final) as tmp:
            (tmp / "README.md").write_text("half")
            raise RuntimeError("staging failed")
    assert (final / "README.md").read_text() == "old card" and sorted(p.name for p in tmp_path.iterdir()) == ["publish"]
    with atomic.atomic_folder(final) as tmp:
        (tmp / "README.md").write_text("new card")
    assert (final / "README.md").read_text() == "new card" and sorted(p.name for p in tmp_path.iterdir()) == ["publish"]


def test_a_run_whose_report_is_damaged_is_still_protected(tmp_path):
    run = _earlier(tmp_path, "done", CPU_DONE)
    run.report_json.write_text('{"status": "done", "stag')  # cut off mid-write by something else
    with pytest.raises(ZooError, match="report.json is damaged"):
        run.read_report()
    job = Attempt.begin(run.path)
    placement = job.decide(_report(job.staging.path, "failed", [("pull", "failed")]), failed=True)
    assert not placement.placed and placement.earlier == "unreadable report"
    job.abandon()
