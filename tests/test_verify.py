"""Verification logic on the CPU.

1. Judging, on tensors with planted differences: an error above tolerance fails, NaN fails, a wrong shape,
   dtype or output count fails, integers must match exactly, bf16 is judged against float32 relative to eager
   bf16's own error. Expected metrics are computed here in float64 by hand.
2. A whole run folder, lowered with only the GPU compile faked (tests/fixtures/fake_cuda.py), verified with
   the delegate's partition program standing in for the .so: a unit whose .so takes its inputs permuted
   verifies, and fails with the order ignored; float32 rotary pairs are measured against complex128 eager;
   a stateful pool keeps its state across calls; a planted mismatch fails `python -m zoo lower` with exit 3
   and a report that shows where.
3. The ExecuTorch runtime as a second backend, chosen by the recipe key or the command line, with a fake
   zoo_runner: both runtimes get the same cases; no runner by default is a note; asked for explicitly without
   a runner is refused before lowering; wrong numbers exit 3; a load failure the audit predicted is expected,
   one it did not predict fails and is a finding of the audit.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

import zoo.runtimes.executorch as et_runtime
import zoo.export.lower.lowering as lowering
import zoo.cli.export as export_cli
import zoo.cli.lower as lower_cli
import zoo.export.verify as verify
from zoo.contract.host_settings import NoHostSettings
from zoo.contract.io_spec import DynamicDim, IoSpec
from zoo.core.errors import NoGpuError, RuntimeNotBuilt, VerificationFailed
from zoo.export.stages import saved_programs
from zoo.policies.base import InputSpec
from zoo.contract.recipes import Tolerance, load_recipe
from zoo.contract.run_folder import RunFolder

from support.modules import ToyPermuted

_spec = importlib.util.spec_from_file_location("zoo_test_fake_cuda",
                                               Path(__file__).resolve().parent / "fixtures" / "fake_cuda.py")
fake_cuda = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake_cuda)

TOL = Tolerance()


@pytest.fixture(autouse=True)
def _no_runner_from_the_environment(monkeypatch):
    """Which runtimes run depends on $ZOO_ET_RUNNER: each test here sets it, or runs without one."""
    monkeypatch.delenv(et_runtime.RUNNER_ENV, raising=False)
    monkeypatch.delenv("FAKE_ZOO_RUNNER_MODE", raising=False)


def rel_l2(got: torch.Tensor, ref: torch.Tensor) -> float:
    g, r = got.double(), ref.double()
    return float(torch.linalg.vector_norm(g - r) / torch.linalg.vector_norm(r))


# --- 1. judging planted differences ---------------------------------------------------------------------------


def noisy(ref: torch.Tensor, relative: float, seed: int = 1) -> torch.Tensor:
    """``ref`` plus noise of exactly ``relative`` relative L2 (computed in float64)."""
    noise = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    noise *= relative * torch.linalg.vector_norm(ref.double()) / torch.linalg.vector_norm(noise)
    return (ref.double() + noise).to(ref.dtype)


@pytest.fixture
def ref32():
    return torch.randn(64, 32, generator=torch.Generator().manual_seed(0))


def judged(got, ref, **kw):
    return verify.compare_outputs(["y"], [got], [ref], TOL, **kw)[0]


def test_float32_within_tolerance_passes_and_above_fails(ref32):
    ok, bound, _ = judged(noisy(ref32, 2e-6), ref32)
    assert ok.ok and bound == 1e-5
    assert ok.rel_l2 == pytest.approx(rel_l2(noisy(ref32, 2e-6), ref32), rel=1e-9)
    bad, _, _ = judged(noisy(ref32, 3e-5), ref32)
    assert not bad.ok and "relative L2" in bad.why and "1.0e-05" in bad.why
    assert bad.rel_l2 == pytest.approx(3e-5, rel=1e-3)


def test_float64_is_held_to_its_own_tolerance():
    ref = torch.randn(100, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    assert judged(noisy(ref, 1e-12), ref)[0].ok
    assert not judged(noisy(ref, 1e-8), ref)[0].ok  # fine for float32, not for float64


def test_nan_fails_where_the_reference_is_finite(ref32):
    got = ref32.clone()
    got[3, 4] = float("nan")
    c, _, _ = judged(got, ref32)
    assert not c.ok and "non-finite" in c.why


def test_wrong_shape_dtype_and_count_fail(ref32):
    assert "shape" in judged(ref32[:, :16], ref32)[0].why
    c = judged(ref32.double(), ref32)[0]
    assert not c.ok and "dtype float64 != reference float32" in c.why
    results = verify.compare_outputs(["y", "z"], [ref32], [ref32, ref32], TOL)
    assert len(results) == 1 and not results[0][0].ok and "1 outputs, eager returned 2" in results[0][0].why


def test_integer_outputs_must_match_exactly():
    ref = torch.arange(10)
    assert judged(ref.clone(), ref)[0].ok
    off = ref.clone()
    off[7] += 1
    assert not judged(off, ref)[0].ok


def test_bf16_is_judged_against_float32_relative_to_eager_bf16(ref32):
    eager = noisy(ref32, 1e-2, seed=3)  # eager bf16's own error against float32: 1e-2
    near = noisy(ref32, 1.2e-2, seed=4)  # 1.2x eager's error: within the default factor 1.25
    far = noisy(ref32, 1.3e-2, seed=5)  # 1.3x: not
    c, bound, facts = verify.compare_outputs(["y"], [near.bfloat16()], [eager.bfloat16()], TOL,
                                             ref_fp32=[ref32])[0]
    eager_err = rel_l2(eager.bfloat16(), ref32)  # what eager bf16 really is after rounding to bf16
    assert facts["eager_rel_l2"] == pytest.approx(eager_err, rel=1e-9)
    assert bound == pytest.approx(1.25 * eager_err, rel=1e-9)
    assert c.rel_l2 == pytest.approx(rel_l2(near.bfloat16(), ref32), rel=1e-9)
    assert c.ok == (rel_l2(near.bfloat16(), ref32) <= 1.25 * eager_err) and c.ok
    c_far = verify.compare_outputs(["y"], [far.bfloat16()], [eager.bfloat16()], TOL, ref_fp32=[ref32])[0][0]
    assert rel_l2(far.bfloat16(), ref32) > 1.25 * eager_err
    assert not c_far.ok and "eager bf16" in c_far.why


def test_float32_outputs_of_a_bf16_unit_are_judged_against_float32_too(ref32):
    # A Llama unit in bf16 returns float32 logits: they carry bf16 error and are judged by the bf16 rule
    # (seen on an H200: judged at the float32 tolerance, a correct SmolLM2-size artifact failed at 3e-3).
    eager = noisy(ref32, 1e-2, seed=3)
    near = noisy(ref32, 1.1e-2, seed=4)
    c, bound, facts = verify.compare_outputs(["logits"], [near], [eager], TOL, ref_fp32=[ref32])[0]
    assert facts["reference"] == "eager float32"
    assert bound == pytest.approx(1.25 * rel_l2(eager, ref32), rel=1e-9) and c.ok
    c32 = verify.compare_outputs(["logits"], [near], [eager], TOL)[0][0]  # a float32 unit: 1e-5 applies
    assert not c32.ok


def test_bf16_cosine_floor(ref32):
    eager = noisy(ref32, 0.5, seed=6)  # a terrible eager: the factor alone would let 0.6 through
    got = noisy(ref32, 0.6, seed=7)
    c = verify.compare_outputs(["y"], [got.bfloat16()], [eager.bfloat16()], TOL, ref_fp32=[ref32])[0][0]
    assert rel_l2(got.bfloat16(), ref32) < 1.25 * rel_l2(eager.bfloat16(), ref32)
    assert not c.ok and "cosine" in c.why


def test_sizes_are_the_recipe_sizes_plus_the_bounds(tmp_path):
    recipe = load_recipe(str(_write_recipe_file(tmp_path, "verify-toy")))
    cases = verify.size_cases(IoSpec("float32", {}, dynamic={"length": DynamicDim(2, 16)}), recipe)
    assert cases == [{"length": 2}, {"length": 5}, {"length": 16}]
    two = verify.size_cases(IoSpec("float32", {}, dynamic={"length": DynamicDim(2, 16), "frames": DynamicDim(1, 3)}),
                            recipe)
    assert len(two) == 6 and {"length": 16, "frames": 3} in two


def test_inputs_are_fresh_and_seeded():
    specs = [InputSpec("x", "float32", [1, "length", 8]), InputSpec("slots", "int64", [2], "randperm:16")]
    a = verify.draw_inputs(specs, {"length": 5}, 0, "m")
    b = verify.draw_inputs(specs, {"length": 5}, 0, "m")
    c = verify.draw_inputs(specs, {"length": 5}, 1, "m")
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0])
    assert a[0].shape == (1, 5, 8) and len(set(a[1].tolist())) == 2
    export_example = specs[0].sample(torch.Generator().manual_seed(0), {"length": 5})
    assert not torch.equal(a[0], export_example)  # not the example the program was exported with


# --- 2. a whole run folder -------------------------------------------------------------------------------------


def _angles() -> torch.Tensor:
    return torch.arange(16, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(4, dtype=torch.float64) / 4)


class RopeComplex(nn.Module):
    """The source's formulation: complex128 rotation of interleaved pairs (Meta's Llama style)."""

    def __init__(self, proj: nn.Linear) -> None:
        super().__init__()
        self.proj = proj
        angles = _angles()
        self.register_buffer("freqs", torch.polar(torch.ones_like(angles), angles))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        y = torch.view_as_complex(self.proj(x).double().reshape(1, length, 4, 2))
        return torch.view_as_real(y * self.freqs[:length]).flatten(-2).float()


class RopePairs(nn.Module):
    """The same rotation in float32 real pairs (rotary_pairs=float32): what gets lowered."""

    def __init__(self, proj: nn.Linear) -> None:
        super().__init__()
        self.proj = proj
        self.register_buffer("cos", _angles().cos().float())
        self.register_buffer("sin", _angles().sin().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        y = self.proj(x)
        a, b = y[..., 0::2], y[..., 1::2]
        cos, sin = self.cos[:length], self.sin[:length]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


class Pool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("pool", torch.zeros(16, 4))

    def forward(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        self.pool.index_copy_(0, slots, self.proj(x))
        return self.pool * 1.5


IO = {
    "permuted": {"inputs": [{"name": n, "dtype": "float32", "shape": [2, 4], "sampler": "normal"} for n in "abc"],
                 "outputs": ["y"]},
    "rope": {"inputs": [{"name": "x", "dtype": "float32", "shape": [1, "length", 8], "sampler": "normal"}],
             "outputs": ["rotated"]},
    "pool": {"inputs": [{"name": "x", "dtype": "float32", "shape": [2, 4], "sampler": "normal"},
                        {"name": "slots", "dtype": "int64", "shape": [2], "sampler": "randperm:16"}],
             "outputs": ["pool"]},
}


def _write_recipe_file(folder: Path, name: str) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(OmegaConf.to_yaml({
        "name": name, "family": "llama", "source": {"repo_id": "none/none"},
        "unit": {"methods": ["permuted", "rope", "pool"], "dtype": "float32"},
        "dynamic": {"length": {"min": 2, "max": 16}}, "rotary_pairs": "float32",
        "lowering": {"triton_kernel_mode": "OFF", "max_mm_configs": 2},
        "verify": {"seeds": [0, 1], "sizes": {"length": [5]}}}))
    return path


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    """A run folder as the export step leaves it, then lowered (GPU compile faked)."""
    run = tmp_path_factory.mktemp("run")
    torch.manual_seed(0)
    proj = nn.Linear(8, 8)
    length = torch.export.Dim("length", min=2, max=16)
    with torch.no_grad():
        exported = {
            "permuted": torch.export.export(ToyPermuted(), tuple(torch.randn(2, 4) for _ in range(3))),
            "rope": torch.export.export(RopeComplex(proj), (torch.randn(1, 6, 8),), dynamic_shapes=({1: length},)),
            "pool": torch.export.export(Pool(), (torch.randn(2, 4), torch.tensor([1, 2]))),
        }
        rewritten = dict(exported, rope=torch.export.export(RopePairs(proj), (torch.randn(1, 6, 8),),
                                                            dynamic_shapes=({1: length},)))
    folder = RunFolder(run)
    for name in exported:
        folder.save_program(exported[name], "exported", name)
        folder.save_program(rewritten[name], "rewritten", name)
    (_write_recipe_file(run, "verify-toy")).rename(folder.recipe_file)
    folder.write_io_spec(IoSpec.from_json({"format": 1, "dtype": "float32", "methods": IO,
                                           "dynamic": {"length": {"min": 2, "max": 16}}}, "io_spec.json"))
    folder.write_host_settings(NoHostSettings())  # synthetic units: nothing for a host to drive
    fake = fake_cuda.FakeCudaCompile({})
    with pytest.MonkeyPatch.context() as mp:
        fake.install(mp)
        recipe = folder.load_recipe()
        lowering.lower_to_pte(saved_programs(folder, recipe.unit.methods), folder, recipe)
    return {"run": run, "fake": fake, "recipe": recipe}


def _copy(run_folder, tmp_path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(run_folder["run"], target)
    return target


def test_lowered_unit_verifies_with_the_delegate_order(run_folder):
    recipe = run_folder["recipe"]
    result = verify.verify_artifact(run_folder["run"], recipe, device="cpu",
                                    runner_factory=run_folder["fake"].runner_factory)
    assert result.ok
    assert RunFolder(run_folder["run"]).io_order("permuted")["input_order"] == [2, 1, 0]
    # Calls: permuted and pool once per seed, rope at lengths 2, 5 and 16 per seed.
    calls = sorted((r.method, r.seed, r.sizes.get("length")) for r in result.rows)
    assert calls == sorted([("permuted", s, None) for s in (0, 1)] + [("pool", s, None) for s in (0, 1)]
                           + [("rope", s, n) for s in (0, 1) for n in (2, 5, 16)])
    # No runner given (ZOO_ET_RUNNER unset here): the default choice notes the ExecuTorch runtime as not run.
    assert set(result.runtimes) == {"aoti", "executorch"} and {r.runtime for r in result.rows} == {"aoti"}
    assert result.runtimes["executorch"]["status"] == verify.NOT_RUN
    assert "scripts/build_runtime.sh" in result.runtimes["executorch"]["why"]
    assert "verification on cpu" in result.table() and "not run (" in result.table()


def test_float32_pairs_error_against_complex128_is_measured(run_folder):
    result = verify.verify_artifact(run_folder["run"], run_folder["recipe"], device="cpu",
                                    runner_factory=run_folder["fake"].runner_factory)
    row = next(r for r in result.rows if r.method == "rope" and r.seed == 0 and r.sizes == {"length": 5})
    # Independently: the same inputs through the complex128 source and the float32 pairs.
    (x,) = verify.draw_inputs([InputSpec(**IO["rope"]["inputs"][0])], {"length": 5}, 0, "rope")
    reference = torch.export.load(str(run_folder["run"] / "exported.rope.pt2")).module()(x)
    pairs = torch.export.load(str(run_folder["run"] / "rewritten.rope.pt2")).module()(x)
    assert row.rel_l2 == pytest.approx(rel_l2(pairs, reference), rel=1e-6)
    assert 0 < row.rel_l2 < 1e-5  # float32 rounding against complex128: nonzero, far inside tolerance
    assert any("float32" in n for n in result.notes)


def test_ignoring_the_delegate_order_fails(run_folder, tmp_path):
    run = _copy(run_folder, tmp_path)
    io_path = run / "so" / "permuted.io.json"
    order = json.loads(io_path.read_text())
    order["input_order"] = [0, 1, 2]  # signature order, as if the .so took the method's order
    io_path.write_text(json.dumps(order))
    with pytest.raises(VerificationFailed) as info:
        verify.verify_artifact(run, run_folder["recipe"], device="cpu", runner_factory=run_folder["fake"].runner_factory)
    failed = {r.method for r in info.value.result.failures()}
    assert failed == {"permuted"}
    assert "permuted" in info.value.message and "seed=0" in info.value.message


def test_state_is_carried_across_calls(run_folder):
    # The pool output after seed 1 holds the slots written at seed 0 too: only a runner kept across calls
    # (like the .so, whose pool lives inside it) matches an eager module kept across calls.
    fake = run_folder["fake"]

    class Forgetful:  # a runner that starts from the shipped state at every call
        def __init__(self, *args):
            self.args = args

        def run(self, inputs):
            return fake.runner_factory(*self.args).run(inputs)

    def factory(method, so, weights, device):
        return Forgetful(method, so, weights, device)

    with pytest.raises(VerificationFailed) as info:
        verify.verify_artifact(run_folder["run"], run_folder["recipe"], device="cpu", runner_factory=factory)
    failures = info.value.result.failures()
    assert {(r.method, r.seed) for r in failures} == {("pool", 1)}


def test_planted_mismatch_fails_the_command_with_a_report_that_shows_where(run_folder, tmp_path, monkeypatch, capsys):
    run = _copy(run_folder, tmp_path)
    fake = run_folder["fake"]

    class Off:
        def __init__(self, runner):
            self.runner = runner

        def run(self, inputs):
            outs = self.runner.run(inputs)
            return [o + 1e-3 * o.abs().max() for o in outs]

    def planted(method, so, weights, device):
        runner = fake.runner_factory(method, so, weights, device)
        return Off(runner) if method == "rope" else runner

    monkeypatch.setattr(verify, "aoti_runners", lambda state: planted)
    monkeypatch.setattr(verify, "_default_device", lambda: "cpu")
    assert lower_cli.main([str(run), "--verify-only"]) == VerificationFailed.exit_code
    report = json.loads((run / "report.json").read_text())
    assert report["status"] == "failed"
    assert {s["stage"]: s["status"] for s in report["stages"]}["verify"] == "failed"
    bad = [r for r in report["verification"]["rows"] if not r["ok"]]
    assert bad and {r["method"] for r in bad} == {"rope"} and all(r["output"] == "rotated" for r in bad)
    assert "FAIL" in report["verification"]["table"]
    assert "rope" in capsys.readouterr().err


def test_command_runs_every_gpu_step_on_one_report(run_folder, tmp_path, monkeypatch, capsys):
    # The whole of `python -m zoo lower RUN_DIR` with only AOTInductor's compile faked and the .so run by the
    # partition it was compiled from, on the CPU: preflight, lower, audit, verify, then the manifest.
    run = _copy(run_folder, tmp_path)
    (run / "model.pte").unlink()
    fake = fake_cuda.FakeCudaCompile({})
    fake.install(monkeypatch)
    monkeypatch.setattr(verify, "aoti_runners", lambda state: fake.runner_factory)
    monkeypatch.setattr(verify, "_default_device", lambda: "cpu")
    assert lower_cli.main([str(run)]) == 0
    report = json.loads((run / "report.json").read_text())
    assert report["status"] == "verified" and "error" not in report
    assert [(s["stage"], s["status"]) for s in report["stages"]] == [
        ("preflight", "done"), ("lower", "done"), ("audit", "done"), ("verify", "done"),
        ("policy_check_gpu", "skipped")]  # the toy family has no action loop: recorded as not applicable
    assert report["lowering"]["methods"]["permuted"]["input_order"] == [2, 1, 0]  # c, then b, then a
    assert report["verification"]["passed"] and (run / "model.pte").is_file()
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["verification"]["rows"] == report["verification"]["rows"]
    assert "verification on cpu" in capsys.readouterr().out  # the tables are printed as the steps finish


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the command on a machine without a GPU")
def test_command_without_gpu_runs_the_preflight_and_skips_the_rest(run_folder, tmp_path, capsys):
    run = _copy(run_folder, tmp_path)
    pte_before = (run / "model.pte").read_bytes()
    assert lower_cli.main([str(run)]) == NoGpuError.exit_code
    report = json.loads((run / "report.json").read_text())
    stages = {s["stage"]: s["status"] for s in report["stages"]}
    assert stages == {"preflight": "done", "lower": "skipped", "audit": "skipped", "verify": "skipped"}
    assert (run / "model.pte").read_bytes() == pte_before  # nothing of the earlier artifact was touched
    assert "needs a CUDA device" in capsys.readouterr().err


def test_missing_reference_is_a_clear_error(run_folder, tmp_path):
    run = _copy(run_folder, tmp_path)
    (run / "exported.pool.pt2").unlink()
    with pytest.raises(VerificationFailed, match="exported.pool.pt2 is missing"):
        verify.verify_artifact(run, run_folder["recipe"], device="cpu", runner_factory=run_folder["fake"].runner_factory)


def test_references_given_in_memory_stand_in_for_the_saved_programs(run_folder, tmp_path):
    run = _copy(run_folder, tmp_path)

    def fresh():  # new modules each time: pool carries state from call to call
        return {m: torch.export.load(str(run_folder["run"] / f"exported.{m}.pt2")).module()
                for m in ("permuted", "rope", "pool")}

    for path in run.glob("exported.*.pt2"):  # nothing on disk to fall back on
        path.unlink()
    result = verify.verify_artifact(run, run_folder["recipe"], device="cpu", references={"exported": fresh()},
                                    runner_factory=run_folder["fake"].runner_factory)
    assert result.ok and {r.method for r in result.rows} == {"permuted", "rope", "pool"}
    # The given reference is what the artifact is judged against: a wrong one fails that method only.
    modules = fresh()
    off = dict(modules, rope=lambda x: modules["rope"](x) * 1.01)
    result = verify.verify_artifact(run, run_folder["recipe"], device="cpu", references={"exported": off},
                                    runner_factory=run_folder["fake"].runner_factory, raise_on_failure=False)
    assert {r.method for r in result.failures()} == {"rope"}


class Scaled(nn.Module):
    def __init__(self, inner: nn.Module, scale: float):
        super().__init__()
        self.inner, self.scale = inner, scale

    def forward(self, *args):
        return self.inner(*args) * self.scale


def test_verify_unit_step_judges_the_artifact_against_the_units_own_modules(run_folder, tmp_path):
    # The real-size scripts never save their ~10 GB programs: the unit still in memory is the reference.
    from zoo.export.stages import verify_unit_step
    from zoo.policies.base import ExportUnit, MethodSpec
    from zoo.core.report import RunReport

    run = _copy(run_folder, tmp_path)
    for path in run.glob("exported.*.pt2"):  # nothing on disk to fall back on
        path.unlink()

    def unit(scale_rope: float = 1.0) -> ExportUnit:
        modules = {m: torch.export.load(str(run_folder["run"] / f"exported.{m}.pt2")).module()
                   for m in ("permuted", "rope", "pool")}
        modules["rope"] = Scaled(modules["rope"], scale_rope)
        return ExportUnit(family="toy", methods={m: MethodSpec(m, mod, [], []) for m, mod in modules.items()})

    report = RunReport(run, run_folder["recipe"].to_dict())
    result = verify_unit_step(RunFolder(run), run_folder["recipe"], report, unit(), device="cpu",
                              runner_factory=run_folder["fake"].runner_factory)
    assert result.ok and {r.method for r in result.rows} == {"permuted", "rope", "pool"}
    assert [(s["stage"], s["status"]) for s in report.stages] == [("verify", "done")]
    with pytest.raises(VerificationFailed) as failed:
        verify_unit_step(RunFolder(run), run_folder["recipe"], report, unit(scale_rope=1.01), device="cpu",
                         runner_factory=run_folder["fake"].runner_factory)
    assert {r.method for r in failed.value.result.failures()} == {"rope"}


def test_no_gpu_no_device_is_a_clear_error(run_folder):
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    with pytest.raises(NoGpuError):
        verify.verify_artifact(run_folder["run"], run_folder["recipe"])


# --- 3. the ExecuTorch runtime as a second verification backend ----------------------------------------------
# A fake zoo_runner (tests/fixtures/fake_zoo_runner.py) stands in for ExecuTorch's C++ runtime: it speaks the
# runner's command line and tensor files and runs the run folder's exported programs eagerly, so its numbers are
# eager's own; FAKE_ZOO_RUNNER_MODE makes it compute wrong numbers or fail to load. It claims ExecuTorch 1.2.0.


def _verified_on_the_cpu(monkeypatch, factory) -> None:
    monkeypatch.setattr(verify, "aoti_runners", lambda state: factory)
    monkeypatch.setattr(verify, "_default_device", lambda: "cpu")


def _rows_of(report: dict, runtime: str) -> list:
    return [r for r in report["verification"]["rows"] if r["runtime"] == runtime]


def _cases(rows: list) -> list:
    return sorted((r["method"], r["seed"], json.dumps(r["sizes"]), r["output"]) for r in rows)


def test_both_runtimes_get_the_same_cases_side_by_side(run_folder, tmp_path, monkeypatch, fake_zoo_runner):
    run = _copy(run_folder, tmp_path)
    _verified_on_the_cpu(monkeypatch, run_folder["fake"].runner_factory)
    assert lower_cli.main([str(run), "--verify-only", "--runtime", "both", "--et-runner", str(fake_zoo_runner)]) == 0
    report = json.loads((run / "report.json").read_text())
    aoti, et = _rows_of(report, "aoti"), _rows_of(report, "executorch")
    # Every method, seed and size (rope at lengths 2, 5, 16) on both, from the same seeded inputs.
    assert _cases(aoti) == _cases(et) and len(et) == 2 + 2 + 6
    # The runtime is fed in the method's order: the permuted method, whose .so takes c, b, a, matches eager
    # exactly (the fake computes eager's numbers; fed the delegate's order it would not).
    assert all(r["ok"] and r["rel_l2"] == 0.0 and r["max_abs"] == 0.0 for r in et)
    outcome = report["verification"]["runtimes"]["executorch"]
    assert outcome["status"] == "ran" and "ExecuTorch runtime 1.2.0-fake" in outcome["describe"]
    assert outcome["load_ms"] == 1.0  # what the runner reported after loading
    # The table shows each case's two runtimes one under the other.
    lines = [line.split() for line in report["verification"]["table"].splitlines()]
    body = [cells for cells in lines if cells and cells[0] in ("aoti", "executorch")]
    assert [cells[0] for cells in body] == ["aoti", "executorch"] * len(et)
    assert all(a[1:5] == e[1:5] for a, e in zip(body[::2], body[1::2]))
    assert "executorch: worst rel L2 0.00e+00" in report["verification"]["summary"]
    # The audit marks release 1.2 (the runner's) as tested by running; the others stay inferred.
    releases = report["audit"]["releases"]
    assert releases["1.2"]["tested"] == "by running: ok on cpu"
    assert {releases[r]["tested"] for r in ("1.3", "1.4", "1.5")} == {"inferred from symbols"}
    assert report["audit"]["findings"] == [] and "by running: ok on cpu" in report["audit"]["table"]


def test_the_recipe_key_chooses_the_runtime(run_folder, tmp_path, monkeypatch, fake_zoo_runner):
    run = _copy(run_folder, tmp_path)

    def no_aoti(*args):
        raise AssertionError("verify.runtimes=[executorch]: torch's AOTI runner must not run")

    _verified_on_the_cpu(monkeypatch, no_aoti)
    monkeypatch.setenv(et_runtime.RUNNER_ENV, str(fake_zoo_runner))
    assert lower_cli.main([str(run), "verify.runtimes=[executorch]", "--verify-only"]) == 0
    report = json.loads((run / "report.json").read_text())
    assert set(report["verification"]["runtimes"]) == {"executorch"}
    assert {r["runtime"] for r in report["verification"]["rows"]} == {"executorch"}


def test_no_runner_by_default_is_a_note_not_a_failure(run_folder, tmp_path, monkeypatch, capsys):
    run = _copy(run_folder, tmp_path)
    _verified_on_the_cpu(monkeypatch, run_folder["fake"].runner_factory)
    assert lower_cli.main([str(run), "--verify-only"]) == 0
    report = json.loads((run / "report.json").read_text())
    outcome = report["verification"]["runtimes"]["executorch"]
    assert outcome["status"] == "not run" and "scripts/build_runtime.sh" in outcome["why"]
    assert report["verification"]["passed"] and report["status"] == "verified"
    assert "executorch: not run (" in report["verification"]["summary"]
    assert "not run (" in capsys.readouterr().out


def test_executorch_chosen_without_a_runner_fails_before_lowering(run_folder, tmp_path, monkeypatch, capsys):
    run = _copy(run_folder, tmp_path)
    (run / "model.pte").unlink()
    fake = fake_cuda.FakeCudaCompile({})
    fake.install(monkeypatch)
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert lower_cli.main([str(run), "--runtime", "executorch"]) == RuntimeNotBuilt.exit_code
    assert fake.partitions == {} and not (run / "model.pte").exists()  # nothing was lowered
    # Refused before the attempt was staged: the run folder is byte for byte as it was, no attempt kept beside it.
    assert {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    assert not [p for p in run.parent.iterdir() if p.name.startswith(".run.")]
    err = capsys.readouterr().err
    assert "ZOO_ET_RUNNER" in err and "scripts/build_runtime.sh" in err
    # A runner path that is no runner is refused at once too.
    assert lower_cli.main([str(run), "--et-runner", str(tmp_path / "nothing")]) == RuntimeNotBuilt.exit_code
    assert fake.partitions == {}


def test_export_refuses_executorch_without_a_runner_before_any_work(tmp_path):
    out = tmp_path / "out"
    assert export_cli.main(["llama-rope-tiny", "--runtime", "executorch", "--output-dir", str(out)]) == \
        RuntimeNotBuilt.exit_code
    assert not out.exists()


def test_a_runtime_that_computes_wrong_numbers_fails_with_exit_3(run_folder, tmp_path, monkeypatch, fake_zoo_runner):
    run = _copy(run_folder, tmp_path)
    _verified_on_the_cpu(monkeypatch, run_folder["fake"].runner_factory)
    monkeypatch.setenv("FAKE_ZOO_RUNNER_MODE", "wrong")
    assert lower_cli.main([str(run), "--verify-only", "--runtime", "both", "--et-runner", str(fake_zoo_runner)]) == \
        VerificationFailed.exit_code
    report = json.loads((run / "report.json").read_text())
    assert all(r["ok"] for r in _rows_of(report, "aoti"))
    et = _rows_of(report, "executorch")
    assert et and not any(r["ok"] for r in et)
    # Every output scaled by 1 + 1e-3: relative L2 1e-3 against eager, whatever the values.
    assert all(r["rel_l2"] == pytest.approx(1e-3, rel=1e-3) for r in et)
    assert {s["stage"]: s["status"] for s in report["stages"]}["verify"] == "failed"


@pytest.fixture(scope="module")
def float64_run(run_folder, tmp_path_factory):
    """The run folder lowered again with the pool method's .so needing float64, which no release has."""
    run = tmp_path_factory.mktemp("float64-run") / "run"
    shutil.copytree(run_folder["run"], run)
    (run / "model.pte").unlink()
    fake = fake_cuda.FakeCudaCompile({"pool": (fake_cuda.FIXTURE_SO / "float64.so").read_bytes()})
    with pytest.MonkeyPatch.context() as mp:
        fake.install(mp)
        mp.setattr(verify, "_default_device", lambda: "cpu")
        mp.setattr(verify, "aoti_runners", lambda state: fake.runner_factory)
        mp.delenv(et_runtime.RUNNER_ENV, raising=False)
        assert lower_cli.main([str(run), "--runtime", "aoti"]) == 0
    return {"run": run, "fake": fake}


def test_a_load_failure_the_audit_predicted_is_expected(float64_run, tmp_path, monkeypatch, fake_zoo_runner):
    run = tmp_path / "run"
    shutil.copytree(float64_run["run"], run)
    _verified_on_the_cpu(monkeypatch, float64_run["fake"].runner_factory)
    monkeypatch.setenv("FAKE_ZOO_RUNNER_MODE", "fail-load")
    assert lower_cli.main([str(run), "--verify-only", "--runtime", "both", "--et-runner", str(fake_zoo_runner)]) == 0
    report = json.loads((run / "report.json").read_text())
    outcome = report["verification"]["runtimes"]["executorch"]
    assert outcome["status"] == "expected" and outcome["audit"]["reason"] == "1.2 lacks aoti_torch_dtype_float64"
    assert "expected (audit: 1.2 lacks aoti_torch_dtype_float64)" in report["verification"]["table"]
    assert "forward_so_blob" in outcome["log"]  # ExecuTorch's own log, kept in report.json
    assert report["verification"]["passed"] and all(r["ok"] for r in _rows_of(report, "aoti"))
    assert report["audit"]["releases"]["1.2"]["tested"].startswith("by running: FAILED: ")
    assert report["audit"]["findings"] == []


def test_a_load_failure_the_audit_did_not_predict_fails_and_is_a_finding(run_folder, tmp_path, monkeypatch,
                                                                           fake_zoo_runner, capsys):
    run = _copy(run_folder, tmp_path)
    _verified_on_the_cpu(monkeypatch, run_folder["fake"].runner_factory)
    monkeypatch.setenv("FAKE_ZOO_RUNNER_MODE", "fail-load")
    assert lower_cli.main([str(run), "--verify-only", "--runtime", "both", "--et-runner", str(fake_zoo_runner)]) == \
        VerificationFailed.exit_code
    report = json.loads((run / "report.json").read_text())
    outcome = report["verification"]["runtimes"]["executorch"]
    assert outcome["status"] == "FAILED" and "cannot load program" in outcome["why"]
    assert all(r["ok"] for r in report["verification"]["rows"])  # the AOTI runner's rows passed
    assert not report["verification"]["passed"]
    findings = report["audit"]["findings"]
    assert len(findings) == 1 and "the audit calls it loadable, but it failed to run" in findings[0]
    assert "executorch: ExecuTorch's runtime failed loading the program" in capsys.readouterr().err


def test_empty_weights_blob_is_not_given_to_the_runner(tmp_path):
    from zoo.runtimes.aoti import load_weights

    class Container:
        def __init__(self):
            self.loaded = []

        def update_constant_buffer_from_blob(self, path):
            self.loaded.append(path)

    empty, full = tmp_path / "a.weights.blob", tmp_path / "b.weights.blob"
    empty.write_bytes(b"")  # a method without constants (seen on an H200: the runner cannot mmap it)
    full.write_bytes(b"\1" * 64)
    container = Container()
    assert load_weights(container, empty) is False and load_weights(container, None) is False
    assert load_weights(container, full) is True
    assert container.loaded == [str(full)]
