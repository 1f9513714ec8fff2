"""The CPU part of the pipeline on the toy family (tests/families/toy): example sizes, export with dynamic dims,
the CPU check against eager (stateless, stateful, bf16), and whole runs into a run folder, including what a
failed or interrupted run leaves behind."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

import torch

from zoo.export import trace as exporting
from zoo.export import pipeline
from zoo.export.cpu_check import BufferState, _judge, check_cases, cpu_check
from zoo.core.errors import Interrupted, LoweringError, RewriteDeclined, VerificationFailed, ZooError
from zoo.contract.recipes import Tolerance
from zoo.policies.toy import unit as toy  # tests/families/toy
from zoo.policies.toy.unit import ToyPool, ToyRead, ToyRope, ToyWrite

from support.environment import TEST_RECIPES


def build(test_recipe, toy_family, name, *overrides, tmp_path):
    """A recipe and its toy unit, from a fabricated checkpoint folder."""
    recipe = test_recipe(name, *overrides)
    folders = toy.fabricate_checkpoint(recipe, tmp_path / "fab")
    return recipe, toy.build_unit(folders[recipe.source.repo_id], recipe)


# --------------------------------------------------------------------------------------------------------
# Sizes


def test_example_sizes_inside_the_range(test_recipe):
    assert exporting.example_sizes(test_recipe("toy-rope")) == {"seq": 3}
    assert exporting.example_sizes(test_recipe("toy-rope", "inputs.seq=10")) == {"seq": 10}


def test_example_sizes_of_two_dims_differ(test_recipe):
    # Equal example sizes would be tied into one symbol by torch.export's duck sizing.
    recipe = test_recipe("toy-rope", "dynamic.len.min=2", "dynamic.len.max=24")
    assert exporting.example_sizes(recipe) == {"seq": 3, "len": 4}


def test_check_cases(test_recipe):
    # seq: export size 3, verify size 5, bounds 2 and 24.
    assert check_cases(test_recipe("toy-rope")) == [{"seq": 3}, {"seq": 5}, {"seq": 2}, {"seq": 24}]
    two = test_recipe("toy-rope", "dynamic.len.min=4", "dynamic.len.max=9")
    assert check_cases(two) == [{"seq": 3, "len": 5}, {"seq": 5, "len": 5}, {"seq": 2, "len": 5},
                                {"seq": 24, "len": 5}, {"seq": 3, "len": 4}, {"seq": 3, "len": 9},
                                {"seq": 2, "len": 4}, {"seq": 24, "len": 9}]
    assert check_cases(test_recipe("toy-pool")) == [{}]


# --------------------------------------------------------------------------------------------------------
# Export


@pytest.fixture(scope="module")
def rope_unit(tmp_path_factory):
    from zoo.contract.recipes import load_recipe

    recipe = load_recipe("toy-rope", recipes_dir=TEST_RECIPES)
    folders = toy.fabricate_checkpoint(recipe, tmp_path_factory.mktemp("fab"))
    unit = toy.build_unit(folders[recipe.source.repo_id], recipe)
    return recipe, unit, exporting.export_unit(unit, recipe)


def test_export_keeps_the_dynamic_range(rope_unit):
    recipe, unit, programs = rope_unit
    ep = programs["forward"]
    ranges = [(int(r.lower), int(r.upper)) for r in ep.range_constraints.values()]
    assert (2, 24) in ranges
    module = unit.methods["forward"].module
    for length in (2, 11, 24):  # both bounds and a size it was not traced at
        x = torch.randn(1, length, 16, generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            got, ref = ep.module()(x), module(x)
        assert got.shape == (1, length, 16)
        assert torch.allclose(got, ref, rtol=0, atol=1e-6)


def test_export_refuses_methods_the_family_did_not_build(rope_unit, test_recipe):
    from zoo.core.errors import ExportError

    _, unit, _ = rope_unit
    with pytest.raises(ExportError, match=r"built methods \['forward'\] but the recipe names \['forward', 'extra'\]"):
        exporting.export_unit(unit, test_recipe("toy-rope", "unit.methods=[forward,extra]"))


def test_complex_values_are_found_and_refused(rope_unit, test_recipe):
    _, _, programs = rope_unit
    leftovers = pipeline.complex_leftovers(programs["forward"])
    assert any("view_as_complex" in s for s in leftovers)
    assert any("freqs_cis" in s for s in leftovers)  # the complex64 table itself
    with pytest.raises(RewriteDeclined) as err:
        pipeline.apply_rewrites(programs["forward"], test_recipe("toy-rope", "rewrites=[]"), "forward")
    assert "still has complex values" in str(err.value) and "replace_complex_with_real" in err.value.hint


def test_float32_copy_widens_only_half_precision():
    core = ToyPool(4, 3)
    core.register_buffer("table", torch.arange(3, dtype=torch.float64))
    core._apply(lambda t: t.to(torch.bfloat16) if t.is_floating_point() and t.dtype != torch.float64 else t)
    from zoo.policies.base import ExportUnit, InputSpec, MethodSpec

    unit = ExportUnit("toy", {
        "write": MethodSpec("write", ToyWrite(core), [InputSpec("x", "bfloat16", [2, 4]),
                                                       InputSpec("slots", "int64", [2], "randperm:3")], ["s"]),
        "read": MethodSpec("read", ToyRead(core), [InputSpec("q", "bfloat16", [1, 4])], ["o"])})
    wide = exporting.float32_copy(unit)
    w, r = wide.methods["write"].module, wide.methods["read"].module
    assert w.core is r.core  # the shared core stays shared
    assert w.core.wq.weight.dtype == torch.float32 and w.core.pool.dtype == torch.float32
    assert w.core.table.dtype == torch.float64  # float64 kept on purpose stays float64
    assert core.wq.weight.dtype == torch.bfloat16  # the original is untouched
    assert torch.equal(w.core.wq.weight, core.wq.weight.float())
    assert [s.dtype for s in wide.methods["write"].inputs] == ["float32", "int64"]


# --------------------------------------------------------------------------------------------------------
# CPU check


def test_cpu_check_passes_an_exact_program(rope_unit):
    recipe, unit, programs = rope_unit  # the exported program computes exactly what eager does
    result = cpu_check(unit, programs, recipe)
    assert result["passed"] and result["failed"] == 0
    assert result["compared"] == 2 * 4  # 2 seeds x 4 size cases x 1 output
    assert [c["sizes"] for c in result["cases"][:4]] == [{"seq": 3}, {"seq": 5}, {"seq": 2}, {"seq": 24}]
    assert result["worst_rel_l2"]["rel_l2"] < 1e-6


def test_cpu_check_catches_a_wrong_program(rope_unit):
    recipe, unit, _ = rope_unit
    wrong = ToyRope(16, 2, 24)
    wrong.load_state_dict(unit.methods["forward"].module.state_dict())
    with torch.no_grad():
        wrong.wo.weight.mul_(1.001)  # every output scaled by 1.001: relative L2 1e-3 > 1e-5
    programs = {"forward": exporting.export_method(
        dataclasses.replace(unit.methods["forward"], module=wrong), recipe)}
    with pytest.raises(VerificationFailed) as err:
        cpu_check(unit, programs, recipe)
    assert "8 of 8 comparisons failed" in str(err.value)
    rels = [c["rel_l2"] for case in err.value.result["cases"] for c in case["comparisons"]]
    assert all(abs(r - 1e-3) < 1e-5 for r in rels)


@pytest.fixture
def pool_unit(test_recipe, toy_family, tmp_path):
    recipe, unit = build(test_recipe, toy_family, "toy-pool", tmp_path=tmp_path)
    return recipe, unit, exporting.export_unit(unit, recipe)


def test_cpu_check_stateful_unit_compares_and_restores_state(pool_unit):
    recipe, unit, programs = pool_unit
    core = unit.methods["write"].module.core
    result = cpu_check(unit, programs, recipe)
    names = [c["name"] for c in result["cases"][0]["comparisons"]]
    assert names == ["write.pool_sum", "read.out", "state:core.pool"]
    assert result["passed"]
    assert torch.count_nonzero(core.pool) == 0  # the unit is left as it was found


def test_cpu_check_stateful_sequence_matches_a_hand_run(pool_unit):
    # Independent reference: run the two methods by hand on a fresh pool with the same inputs.
    from zoo.export.cpu_check import draw_inputs

    recipe, unit, _ = pool_unit
    core = unit.methods["write"].module.core
    inputs = draw_inputs(unit, ["write", "read"], {}, seed=0)
    x, slots = inputs["write"]
    pool = torch.zeros(6, 8)
    pool[slots] = x @ core.wk.weight.t()
    q = inputs["read"][0]
    expected = torch.softmax((q @ core.wq.weight.t()) @ pool.t(), dim=-1) @ pool
    state = BufferState([core])
    with torch.no_grad():
        unit.methods["write"].module(x, slots)
        got = unit.methods["read"].module(q)
    assert torch.allclose(got, expected, atol=1e-6)
    assert set(state.changed(core)) == {"pool"}
    state.restore()
    assert torch.count_nonzero(core.pool) == 0


class WriteNextSlot(torch.nn.Module):
    """A wrong write step: stores each row one slot further on."""

    def __init__(self, core):
        super().__init__()
        self.core = core

    def forward(self, x, slots):
        self.core.pool.index_copy_(0, (slots + 1) % self.core.pool.shape[0], self.core.wk(x))
        return self.core.pool.sum(dim=0)


def test_cpu_check_catches_wrong_state(pool_unit):
    recipe, unit, programs = pool_unit
    core = unit.methods["write"].module.core
    bad = exporting.export_method(dataclasses.replace(unit.methods["write"], module=WriteNextSlot(core)),
                                  recipe)
    with pytest.raises(VerificationFailed) as err:
        cpu_check(unit, {"write": bad, "read": programs["read"]}, recipe)
    failed = {c["name"] for case in err.value.result["cases"] for c in case["comparisons"] if not c["ok"]}
    # Neither output depends on where rows are written (a sum, and attention over all rows, are blind to row
    # order): only comparing the pool itself catches the wrong slots.
    assert failed == {"state:core.pool"}
    assert torch.count_nonzero(core.pool) == 0


def test_bf16_judgement_hand_worked():
    tol = Tolerance(bf16_factor=1.25, bf16_min_cosine=0.99)
    ref = torch.tensor([3.0, 4.0], dtype=torch.float64)  # |ref| = 5
    eager = torch.tensor([3.0, 4.5], dtype=torch.float64)  # rel L2 0.5 / 5 = 0.1
    inside = _judge("y", torch.tensor([3.0, 4.6], dtype=torch.float64), eager, ref, "bfloat16", tol)
    outside = _judge("y", torch.tensor([3.0, 4.7], dtype=torch.float64), eager, ref, "bfloat16", tol)
    assert inside["ok"] and inside["rel_l2"] == pytest.approx(0.12)  # 0.12 <= 1.25 x 0.1
    assert inside["eager_bf16_rel_l2_vs_fp32"] == pytest.approx(0.1)
    assert not outside["ok"] and "1.4" in outside["why"]  # 0.14 > 0.125
    # Cosine of [3, 4.6] and [3, 4] is 0.99944 (hand-computed): a 0.9995 floor fails it.
    strict = _judge("y", torch.tensor([3.0, 4.6], dtype=torch.float64), eager, ref, "bfloat16",
                    Tolerance(bf16_factor=1.25, bf16_min_cosine=0.9995))
    assert not strict["ok"] and "cosine" in strict["why"]


def test_float32_judgement_uses_float32_tolerance():
    tol = Tolerance(float32=1e-5)
    ref = torch.ones(100)
    assert _judge("y", ref * (1 + 0.9e-5), ref, None, "float32", tol)["ok"]
    assert not _judge("y", ref * (1 + 1.1e-5), ref, None, "float32", tol)["ok"]


# --------------------------------------------------------------------------------------------------------
# Whole runs


def test_kernel_preflight_runs_without_a_gpu_and_fails_the_run_early(test_recipe, toy_family, tmp_path):
    # float32 attention with executorch 1.2.0's Triton SDPA would fail on the GPU after compiling: the CPU run
    # says so now, naming the kernel and the setting to change.
    recipe = test_recipe("toy-rope", "lowering.triton_kernel_mode=ON")
    with pytest.raises(LoweringError, match="triton::sdpa.*triton_kernel_mode=OFF"):
        pipeline.run_pipeline(recipe, tmp_path / "runs" / "toy-rope")
    data = json.loads((tmp_path / "runs" / "toy-rope" / "report.json").read_text())
    assert data["status"] == "failed" and {s["stage"]: s["status"] for s in data["stages"]}["preflight"] == "failed"
    assert not (tmp_path / "runs" / "toy-rope" / "model.pte").exists()


def test_run_folder_of_a_tiny_recipe(test_recipe, toy_family, tmp_path, monkeypatch):
    pytest.importorskip("zoo.rewrites.complex_to_real")
    # This Python is the `python` on PATH (an activated venv): the next command says `python -m zoo lower`.
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    # load_aux: the toy policy loads a second repo by Hub id while it is built, served from the tiny cache.
    recipe = test_recipe("toy-rope", "unit.options.load_aux=true")
    report = pipeline.run_pipeline(recipe, tmp_path / "runs" / "toy-rope")
    run = tmp_path / "runs" / "toy-rope"
    assert report.run_dir == run.resolve()
    assert sorted(p.name for p in run.iterdir()) == [
        "export.log", "exported.forward.pt2", "host_settings.json", "io_spec.json", "processors", "recipe.yaml",
        "report.json", "report.md", "rewritten.forward.pt2", "source.json"]
    assert not list(run.parent.glob(".toy-rope.*"))  # no staging folder left over

    data = json.loads((run / "report.json").read_text())
    assert data["status"] == "done"
    stages = {s["stage"]: s["status"] for s in data["stages"]}
    assert stages == {"fabricate": "done", "pull": "done", "build": "done", "export": "done", "rewrite": "done",
                      "cpu_check": "done", "save": "done", "policy_check": "skipped", "preflight": "done",
                      "lower": "skipped", "audit": "skipped", "verify": "skipped", "policy_check_gpu": "skipped"}
    # The toy family has no action loop: the policy check says so, on the CPU and for the GPU.
    assert data["policy_check"] == {place: {"status": "not applicable", "reason": data["policy_check"][place]["reason"]}
                                    for place in ("cpu", "gpu")}
    assert data["policy_check"]["cpu"]["reason"].startswith("not applicable: toy has no action loop")
    assert data["skipped"]["later"] == f"python -m zoo lower {run.resolve()}"
    assert data["next"]["command"] == f"python -m zoo lower {run.resolve()}"
    assert data["cpu_check"]["passed"] and data["cpu_check"]["compared"] == 8

    source = json.loads((run / "source.json").read_text())
    refs = Path(source["cache_dir"]) / "models--zoo-test--toy-rope" / "refs" / "main"
    assert source["commit"] == refs.read_text() and source["fabricated"] is True
    assert json.loads((run / "io_spec.json").read_text()) == {
        "format": 1, "dtype": "float32",
        "methods": {"forward": {"inputs": [{"name": "x", "dtype": "float32", "shape": [1, "seq", 16],
                                            "sampler": "normal"}], "outputs": ["y"]}},
        "dynamic": {"seq": {"min": 2, "max": 24}},
        "example_sizes": {"seq": 3}}
    assert json.loads((run / "host_settings.json").read_text()) == {"format": 1, "family": "none"}  # no host loop
    assert json.loads((run / "processors" / "policy_preprocessor.json").read_text()) == {"name": "toy", "steps": []}

    # The saved rewritten program has no complex values and computes what the eager toy computes.
    rewritten = torch.export.load(str(run / "rewritten.forward.pt2"))
    assert pipeline.complex_leftovers(rewritten) == []
    _, unit = build(test_recipe, toy_family, "toy-rope", tmp_path=tmp_path)
    x = torch.randn(1, 9, 16, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        got, ref = rewritten.module()(x), unit.methods["forward"].module(x)
    assert torch.allclose(got, ref, atol=1e-5)


def test_bf16_run_exports_a_float32_reference(test_recipe, toy_family, tmp_path):
    pytest.importorskip("zoo.rewrites.complex_to_real")
    report = pipeline.run_pipeline(test_recipe("toy-rope", "unit.dtype=bfloat16", "verify.seeds=[0]"),
                                   tmp_path / "run")
    assert (tmp_path / "run" / "reference_fp32.forward.pt2").is_file()
    ref = torch.export.load(str(tmp_path / "run" / "reference_fp32.forward.pt2"))
    dtypes = {p.dtype for p in ref.state_dict.values()}
    assert dtypes == {torch.float32}
    check = report.get("cpu_check")
    assert check["dtype"] == "bfloat16" and check["passed"]
    first = check["cases"][0]["comparisons"][0]
    assert first["rel_l2"] <= 1.25 * first["eager_bf16_rel_l2_vs_fp32"]


def test_stateful_run(test_recipe, toy_family, tmp_path):
    report = pipeline.run_pipeline(test_recipe("toy-pool"), tmp_path / "run")
    assert {p.name for p in (tmp_path / "run").glob("*.pt2")} == {
        "exported.write.pt2", "exported.read.pt2", "rewritten.write.pt2", "rewritten.read.pt2"}
    assert report.get("cpu_check")["compared"] == 2 * 3


def only_failure_files(run: Path):
    return sorted(p.name for p in run.iterdir())


FAILED_RUN = ["export.log", "recipe.yaml", "report.json", "report.md"]  # the report, the recipe, the log


def test_failed_check_leaves_only_the_report(test_recipe, toy_family, tmp_path, monkeypatch):
    def failing_check(*args, **kwargs):
        raise VerificationFailed("CPU check: out.y differs", "see report.md")

    monkeypatch.setattr(pipeline, "cpu_check", failing_check)
    run = tmp_path / "run"
    with pytest.raises(VerificationFailed) as err:
        pipeline.run_pipeline(test_recipe("toy-pool"), run)
    assert only_failure_files(run) == FAILED_RUN
    data = json.loads((run / "report.json").read_text())
    assert data["status"] == "failed" and data["failed_stage"] == "cpu_check"
    assert data["error"] == {"type": "VerificationFailed", "message": "CPU check: out.y differs",
                             "hint": "see report.md", "stage": "cpu_check"}
    assert err.value.report.stages[-1]["status"] == "failed"
    assert not list(tmp_path.glob(".run.*"))


def test_interrupt_leaves_only_the_report(test_recipe, toy_family, tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline.exporting, "export_method", interrupted)
    run = tmp_path / "run"
    with pytest.raises(Interrupted) as err:
        pipeline.run_pipeline(test_recipe("toy-pool"), run)
    data = json.loads((run / "report.json").read_text())
    assert data["status"] == "interrupted" and data["failed_stage"] == "export"
    # The attempt's report and placement travel in declared fields, for the CLI's stage table and "where".
    assert err.value.report.get("status") == "interrupted" and err.value.placement.folder == run
    assert only_failure_files(run) == FAILED_RUN


def file_hashes(run: Path):
    return {p.relative_to(run).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*")) if p.is_file() and p.relative_to(run).parts[0] != "attempts"}


def test_a_failed_rerun_keeps_the_earlier_run_and_its_report_beside_it(test_recipe, toy_family, tmp_path,
                                                                        monkeypatch):
    # A failed re-run never destroys an earlier good run (it used to replace it).
    run = tmp_path / "run"
    pipeline.run_pipeline(test_recipe("toy-pool"), run)
    before = file_hashes(run)

    def no_pull(recipe):
        raise ZooError("no pull")

    monkeypatch.setattr(pipeline.hub, "pull", no_pull)
    with pytest.raises(ZooError) as err:
        pipeline.run_pipeline(test_recipe("toy-pool"), run)
    assert file_hashes(run) == before
    [attempt] = list((run / "attempts").iterdir())
    assert attempt.name.endswith("-failed") and only_failure_files(attempt) == FAILED_RUN
    data = json.loads((attempt / "report.json").read_text())
    assert data["status"] == "failed" and data["failed_stage"] == "pull"
    placement = err.value.placement
    assert not placement.placed and placement.folder == attempt and placement.earlier == "done"
    assert str(attempt) in placement.describe("failed") and "unchanged" in placement.describe("failed")
    assert not list(tmp_path.glob(".run.*"))


def test_a_run_that_got_less_far_is_kept_beside_the_earlier_run_unless_forced(test_recipe, toy_family, tmp_path):
    # The earlier run passed lower, audit and verify; a CPU-only re-run skips them: kept aside, or --force.
    run = tmp_path / "run"
    pipeline.run_pipeline(test_recipe("toy-pool"), run)
    data = json.loads((run / "report.json").read_text())
    data["status"] = "verified"
    data["stages"] = [dict(s, status="done") if s["stage"] in ("lower", "audit", "verify") else s
                      for s in data["stages"]]
    (run / "report.json").write_text(json.dumps(data))
    before = file_hashes(run)
    report = pipeline.run_pipeline(test_recipe("toy-pool", "verify.seeds=[7]"), run)
    assert file_hashes(run) == before
    placement = report.get("placement")
    assert placement["placed"] is False and "lower, audit, verify" in placement["reason"]
    kept = Path(placement["folder"])
    assert kept.parent == run / "attempts" and (kept / "rewritten.read.pt2").is_file()  # the whole attempt
    assert report.get("next")["command"].endswith("--force")
    forced = pipeline.run_pipeline(test_recipe("toy-pool", "verify.seeds=[7]"), run, force=True)
    assert forced.get("placement")["placed"] is True and "--force" in forced.get("placement")["reason"]
    assert json.loads((run / "report.json").read_text())["recipe"]["verify"]["seeds"] == [7]
    assert (run / "attempts" / kept.name).is_dir()  # the attempts kept beside the run stay with it


def test_a_folder_that_is_not_a_run_is_refused(test_recipe, tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "thesis.tex").write_text("precious")
    with pytest.raises(ZooError, match="holds no zoo run"):
        pipeline.run_pipeline(test_recipe("toy-pool"), folder)
    assert (folder / "thesis.tex").read_text() == "precious"
    assert only_failure_files(folder) == ["thesis.tex"]


def test_stale_staging_of_a_dead_run_is_removed(test_recipe, toy_family, tmp_path):
    stale = tmp_path / ".run.partial-999999999"  # no such process
    stale.mkdir()
    (stale / "exported.write.pt2").write_bytes(b"half")
    pipeline.run_pipeline(test_recipe("toy-pool"), tmp_path / "run")
    assert not stale.exists()


def fake_gpu(monkeypatch, run_gpu_steps):
    """A CUDA machine as far as the pipeline can tell, with zoo.export.stages.run_gpu_steps replaced by
    ``run_gpu_steps``."""
    import zoo.export.stages

    monkeypatch.setattr(pipeline.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pipeline.torch.cuda, "get_device_name", lambda *a: "test GPU")
    monkeypatch.setattr(zoo.export.stages, "run_gpu_steps", run_gpu_steps)


def test_gpu_steps_continue_the_same_report(test_recipe, toy_family, tmp_path, monkeypatch):
    seen = {}

    def run_gpu_steps(run, recipe, report, **options):
        # What the GPU steps find: the saved programs and the resolved recipe in the folder, the report so far.
        seen["files"] = sorted(p.name for p in run.path.iterdir())
        seen["stages"] = [s["stage"] for s in report.stages]
        report.stage("lower", "done", 1.0, "model.pte")
        report.record("status", "verified")

    fake_gpu(monkeypatch, run_gpu_steps)
    report = pipeline.run_pipeline(test_recipe("toy-pool"), tmp_path / "run")
    assert {"recipe.yaml", "io_spec.json", "rewritten.write.pt2", "rewritten.read.pt2", "report.json"} <= set(seen["files"])
    assert seen["stages"] == ["fabricate", "pull", "build", "export", "rewrite", "cpu_check", "save", "policy_check"]
    assert report.get("status") == "verified" and report.stages[-1]["stage"] == "lower"
    assert json.loads((tmp_path / "run" / "report.json").read_text())["status"] == "verified"


def test_failed_gpu_step_is_the_failed_stage(test_recipe, toy_family, tmp_path, monkeypatch):
    def run_gpu_steps(run, recipe, report, **options):
        report.stage("verify", "failed", 2.0, "1 output out of tolerance")
        raise VerificationFailed("forward.y differs", "see report.md")

    fake_gpu(monkeypatch, run_gpu_steps)
    with pytest.raises(VerificationFailed):
        pipeline.run_pipeline(test_recipe("toy-pool"), tmp_path / "run")
    data = json.loads((tmp_path / "run" / "report.json").read_text())
    assert data["failed_stage"] == "verify" and data["status"] == "failed"
    assert only_failure_files(tmp_path / "run") == FAILED_RUN
