"""zoo/export/runtime_sequence.py (what benchmarks/gpu_runtime_check.py reports) on the CPU: the summary table of a
two-runtime verification from hand-made rows (worked by hand), and the LingBot-VA KV pool sequence on the
fake runner against a hand-worked chain. The GPU paths themselves run on the GPU box (docs/runtime.md)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from zoo.contract.io_spec import IoSpec
from zoo.export import runtime_sequence as runtime_check
from support.contract_cases import lingbot_va_settings
from support.modules import PoolWrite  # noqa: E402

@pytest.fixture(scope="module")
def check():
    return runtime_check


def _row(runtime, method, output, rel_l2, cosine, ok=True, tolerance=1e-5, seed=0, sizes=None, why=""):
    return {"runtime": runtime, "method": method, "seed": seed, "sizes": sizes or {"n": 4}, "output": output,
            "rel_l2": rel_l2, "cosine": cosine, "tolerance": tolerance, "ok": ok, "why": why}


def test_summary_is_the_worst_output_per_method_runtime_seed_and_size(check):
    verification = {"passed": False, "rows": [
        _row("aoti", "forward", "a", 1e-7, 0.9999999),
        _row("aoti", "forward", "b", 3e-7, 0.9999990),
        _row("aoti", "forward", "ids", 0.0, 1.0, tolerance=0.0),  # exact output: no error to report
        _row("executorch", "forward", "a", 2e-7, 0.9999995),
        _row("executorch", "forward", "b", 4e-3, 0.99, ok=False, why="rel L2 4.0e-03 > 1.0e-05"),
    ], "runtimes": {"aoti": {"status": "ran"}, "executorch": {"status": "ran"}}}
    rows = check.summary_rows("toy", verification)
    assert rows == [["toy", "forward", "aoti", "0/n=4", "3.00e-07", "0.999999", "ok"],
                    ["toy", "forward", "executorch", "0/n=4", "4.00e-03", "0.990000",
                     "FAIL b: rel L2 4.0e-03 > 1.0e-05"]]


def test_a_runtime_without_rows_gets_a_row_saying_why(check):
    verification = {"passed": True, "rows": [_row("aoti", "forward", "a", 1e-7, 1.0)], "runtimes": {
        "aoti": {"status": "ran"},
        "executorch": {"status": "expected", "why": "exit 1", "audit": {"reason": "1.2 lacks aoti_torch_dtype_float64"}}}}
    rows = check.summary_rows("toy", verification)
    assert rows[-1] == ["toy", "(all)", "executorch", "-", "-", "-",
                        "expected (audit: 1.2 lacks aoti_torch_dtype_float64)"]
    assert check.result_passed({"verification": verification, "latency": []})


def test_a_nan_is_the_worst(check):
    verification = {"rows": [_row("aoti", "forward", "a", math.nan, math.nan, ok=False, why="non-finite"),
                             _row("aoti", "forward", "b", 1e-7, 1.0)]}
    assert check.summary_rows("toy", verification)[0][4] == "nan"


def test_the_sequence_and_latency_decide_too(check):
    verification = {"passed": True, "rows": []}
    assert not check.result_passed({"verification": verification, "sequence": {"passed": False, "rows": []}})
    assert check.result_passed({"verification": verification, "sequence": {"skipped": "not io"}})
    slow = {"executorch": {"ok": False}, "aoti": {"ok": True}}
    assert not check.result_passed({"latency": [slow]})
    failed_mode = {"executorch_device": {"ok": True}, "executorch_state": {"ok": False}, "aoti_state": {"ok": True}}
    assert not check.result_passed({"latency": [failed_mode]})
    assert check.result_passed({"latency": [{**failed_mode, "executorch_state": {"ok": True}}]})
    memory = {"methods": ["a"], "shared": {"ok": True}, "own_copy": {"ok": False}}
    assert not check.result_passed({"memory": memory})
    assert check.result_passed({"memory": {**memory, "own_copy": {"ok": True}}})
    assert not check.result_passed({"policy_check": {"ok": False, "error": "x"}})
    assert check.result_passed({"policy_check": {"skipped": "no lerobot"}})


# --- the LingBot-VA KV pool sequence, on the fake runner ---------------------------------------------------------------


SCALES = {"video_step": 1.0, "action_step": -2.0}


@pytest.fixture(scope="module")
def pool_run(tmp_path_factory):
    """A run folder with two methods passing a pool in and out (``pool`` -> ``pool_next``), as LingBot-VA's io
    layout does, and a recipe-shaped object with what the sequence reads."""
    from zoo.contract.recipes import Tolerance

    d = tmp_path_factory.mktemp("pool-run")
    values, slots, pool = torch.randn(2, 4), torch.tensor([1, 3]), torch.zeros(5, 4)
    specs = [{"name": "values", "dtype": "float32", "shape": [2, 4], "sampler": "normal"},
             {"name": "slots", "dtype": "int64", "shape": [2], "sampler": "randperm:5"},
             {"name": "pool", "dtype": "float32", "shape": [5, 4], "sampler": "normal"}]
    for name, scale in SCALES.items():
        torch.export.save(torch.export.export(PoolWrite(scale), (values, slots, pool)), str(d / f"exported.{name}.pt2"))
    (d / "io_spec.json").write_text(json.dumps({"format": 1, "dtype": "float32", "methods": {
        m: {"inputs": specs, "outputs": ["readout", "pool_next"]} for m in SCALES}}))
    (d / "model.pte").write_bytes(b"stands in for the program; the fake runs exported.*.pt2")
    # a method that keeps no pool (LingBot-VA's VAE encodes) stays out of the sequence
    unit = SimpleNamespace(methods=["vae_encode", *SCALES], dtype="float32")
    recipe = SimpleNamespace(name="pool-toy", unit=unit, dynamic={},
                             verify=SimpleNamespace(seeds=[0], sizes={}, tolerance=Tolerance()))
    return d, recipe


def _hand_chain(run_dir: Path, steps: int):
    """The pool after each call, worked directly from the drawn inputs (index_copy of scaled rows)."""
    from zoo.export import verify
    from zoo.policies.base import InputSpec

    specs = [InputSpec(**d) for d in json.loads((run_dir / "io_spec.json").read_text())["methods"]["video_step"]["inputs"]]
    pool, pools = torch.zeros(5, 4), []
    for s in range(steps):
        method = "video_step" if s % 2 == 0 else "action_step"
        values, slots, _ = verify.draw_inputs(specs, {}, seed=s, method=method)
        pool = pool.clone()
        pool[slots] = values * SCALES[method]
        pools.append(pool)
    return pools


@pytest.mark.parametrize("mode, passed", [("", True), ("wrong", False)])
def test_pool_sequence_feeds_the_pool_from_call_to_call(check, pool_run, fake_zoo_runner, monkeypatch, mode, passed):
    from zoo.contract.run_folder import RunFolder

    run_dir, recipe = pool_run
    monkeypatch.setenv("FAKE_ZOO_RUNNER_MODE", mode)
    seen = []
    original = check.et_runtime.run_plan

    def spy(*args, **kwargs):
        result = original(*args, **kwargs)
        seen.append(result)
        return result

    monkeypatch.setattr(check.et_runtime, "run_plan", spy)
    out = check.pool_sequence(RunFolder(run_dir), recipe, fake_zoo_runner, 3, device="cpu")
    assert out["steps"] == ["video_step", "action_step", "video_step"] and len(out["step_ms"]) == 3
    assert out["passed"] is passed and len(out["rows"]) == 6
    if passed:  # the runner's pools are the hand-worked chain: each call's pool went into the next call
        for got, want in zip(seen[0].outputs, _hand_chain(run_dir, 3)):
            assert torch.equal(got[1], want)
        # ... held by the runner from call to call: never copied to the host, never copied to outlive a call
        assert out["state"] == {"host_copies": 0, "rescued": 0, "kept_on_gpu": True}


@pytest.mark.parametrize("planned_in_runtime_json, passed", [(True, True), (False, False)])
def test_pool_sequence_judges_what_crosses_to_the_host(check, pool_run, fake_zoo_runner, monkeypatch, tmp_path,
                                                       planned_in_runtime_json, passed):
    """An artifact whose graph inputs are planned (lowered before zoo left them out) hands the pool over through
    the host, as its runtime.json says: counted, and fine. The same crossing where runtime.json says the inputs
    are not planned is a runtime doing what it should not: the check fails."""
    import shutil

    from zoo.contract.run_folder import RunFolder
    from zoo.contract.releases import lowering_requirement

    run_dir, recipe = pool_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    planned = {m: {"inputs": [planned_in_runtime_json] * 3, "outputs": [False, False]} for m in SCALES}
    RunFolder(copy).write_runtime_requirement(lowering_requirement("1.2.0", planned).as_dict())
    monkeypatch.setenv("FAKE_ZOO_RUNNER_MODE", "planned")
    out = check.pool_sequence(RunFolder(copy), recipe, fake_zoo_runner, 3, device="cpu")
    assert all(r["ok"] for r in out["rows"])  # the numbers are right either way
    assert out["state"]["host_copies"] == 2 and out["state"]["rescued"] == 0  # calls 1 and 2 bind a held pool
    assert out["passed"] is passed


def test_the_latency_state_is_the_familys_device_state(check, tmp_path):
    """What gpu_runtime_check keeps on the GPU in its "state" mode, for a LingBot-VA-shaped run folder, worked by
    hand from the method signatures: the pool in and out of the DiT steps, the caches in and out of the VAE."""
    from zoo.contract.run_folder import RunFolder

    script = check
    run = RunFolder(tmp_path)
    settings = lingbot_va_settings()
    settings.vae.cache = ["c0", "c1"]
    run.write_host_settings(settings)
    named = lambda *names: [{"name": n, "dtype": "float32", "shape": [1]} for n in names]  # noqa: E731
    run.write_io_spec(IoSpec.from_json({"format": 1, "dtype": "float32", "methods": {
        "video_step": {"inputs": named("noisy_latents", "timesteps", "k_pool", "v_pool"),
                       "outputs": ["noise_pred", "k_pool_next", "v_pool_next"]},
        "vae_encode_first": {"inputs": named("frames"), "outputs": ["latent", "c0", "c1"]},
        "vae_encode": {"inputs": named("frames", "c0", "c1"), "outputs": ["latent", "c0", "c1"]}}}, "io_spec.json"))
    assert script.state_positions(run, "video_step") == {"inputs": [2, 3], "outputs": [1, 2]}
    assert script.state_positions(run, "vae_encode_first") == {"inputs": [], "outputs": [1, 2]}
    assert script.state_positions(run, "vae_encode") == {"inputs": [1, 2], "outputs": [1, 2]}
    state = script.state_positions(run, "video_step")
    assert script.io_positions("device", state, 4, 3) == ([0, 1, 2, 3], [0, 1, 2])
    assert script.io_positions("state", state, 4, 3) == ([2, 3], [1, 2])
    assert script.io_positions("host_io", state, 4, 3) == ([], [])
