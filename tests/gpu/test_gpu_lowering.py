"""On a CUDA machine: real ExecuTorch CUDA lowering of tiny units, the shipped .so + weights blob run through
torch's AOTI runner against eager, and the audit of the real .so. The units come from
scripts/gpu_verify_smoke.py (a Linear + real-pair rope over a dynamic length against complex128 eager, float64
pairs, a permuted-input method, a stateful pool, an int64 scatter-add)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("zoo_gpu_smoke", ROOT / "scripts" / "gpu_verify_smoke.py")
smoke = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(smoke)


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    from zoo import lower

    run = smoke.build_toy(tmp_path_factory.mktemp("gpu") / "toy")
    report = lower.lower_run(run)
    return run, report


def test_toy_unit_lowers_and_verifies(toy_run):
    run, report = toy_run
    assert report.get("status") == "verified"
    assert {s["stage"]: s["status"] for s in report.stages} == {
        "preflight": "done", "lower": "done", "audit": "done", "verify": "done"}
    lowering = report.get("lowering")
    assert lowering["methods"]["permuted"]["input_order"] == [2, 1, 0]
    assert lowering["methods"]["pool"]["mutable_buffers"] == {"pool": 32 * 16 * 4}
    assert lowering["gpu"]["capability"] == "".join(map(str, torch.cuda.get_device_capability()))
    rows = report.get("verification")["rows"]
    rope = [r for r in rows if r["method"] == "rope"]
    assert sorted({r["sizes"]["length"] for r in rope}) == [2, 7, 33, 64]
    assert all(0 < r["rel_l2"] < 1e-5 for r in rope)  # float32 pairs against complex128 eager


def test_ignoring_the_delegate_order_fails_on_the_real_so(toy_run):
    from zoo import lower, verify

    run, _ = toy_run
    io_path = run / "so" / "permuted.io.json"
    saved = io_path.read_text()
    order = json.loads(saved)
    order["input_order"] = [0, 1, 2]
    io_path.write_text(json.dumps(order))
    try:
        result = verify.verify_artifact(run, lower.load_run_recipe(run), raise_on_failure=False,
                                        try_executorch=False)
    finally:
        io_path.write_text(saved)
    assert {r.method for r in result.failures()} == {"permuted"}


def test_audit_of_the_real_so(toy_run):
    from zoo import audit

    run, _ = toy_run
    result = audit.audit_artifact(run)
    by_method = {m.method: m for m in result.methods}
    assert "float64" in by_method["rope64"].dtypes and "float64" not in by_method["rope"].dtypes
    assert by_method["rope64"].missing["1.2"] == ["aoti_torch_dtype_float64"]
    assert all(s.startswith("aoti_torch_") for m in result.methods for s in m.symbols)


def test_int64_scatter_add_compiles_to_the_symbol_the_preflight_names(tmp_path):
    from zoo import audit, lowering, preflight
    from zoo.recipes import Lowering, Recipe, Source, Unit

    with torch.no_grad():
        ep = torch.export.export(smoke.ScatterAddInt64(), (torch.tensor([1, 2, 3, 4]), torch.tensor([0, 3, 3, 7])))
    predicted = [n.symbol for n in preflight.check_kernels({"forward": ep}, "1.2", triton_kernel_mode="OFF").refused]
    recipe = Recipe(name="scatter", family="llama", source=Source(repo_id="none/none"), unit=Unit(methods=["forward"]),
                    lowering=Lowering(triton_kernel_mode="OFF", max_mm_configs=1))
    lowering.lower_to_pte({"forward": ep}, tmp_path, recipe, run_preflight=False)
    symbols = audit.audit_artifact(tmp_path).methods[0].symbols
    assert predicted == ["aoti_torch_cuda_scatter_reduce_two_out"]
    assert set(predicted) <= set(symbols)
