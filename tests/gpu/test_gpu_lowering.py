"""On a CUDA machine: real ExecuTorch CUDA lowering of tiny synthetic units, the shipped .so + weights blob run
through torch's AOTI runner against eager, and the audit of the real .so.

Run folders are written the way the export step writes them (``RunFolder``: recipe.yaml, io_spec.json,
exported/rewritten/reference_fp32 programs), then ``zoo.export.pipeline.lower_run`` (``python -m zoo lower RUN_DIR``)
does the rest:
  unit "toy" (float32, triton OFF): permuted (the .so takes its inputs in another order), rope (Linear + float32
      real-pair rope over a dynamic length, against complex128 eager), rope64 (float64 pairs: loads on no
      released runtime), pool (a buffer written with index_copy_, state kept across calls);
  unit "toy-bf16": a bf16 Linear + rope block judged against its float32 export.
Then: the same unit with the delegate order ignored (must fail), and an int64 scatter_add_ lowered without the
preflight, to see the symbol the preflight predicts in the compiled .so and the counts it computes.
"""

from __future__ import annotations

import copy
import os
import json
from pathlib import Path
from typing import Dict, Optional

import pytest
import torch
from torch import nn

from support.modules import ToyPermuted

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MAX_LEN = 64


# --- the units ----------------------------------------------------------------------------------------------------


def _angles() -> torch.Tensor:
    return (torch.arange(MAX_LEN, dtype=torch.float64)[:, None]
            * 10000.0 ** (-torch.arange(8, dtype=torch.float64) / 8))


class RopeComplex(nn.Module):
    """Meta's formulation: interleaved pairs rotated by a complex128 table sliced to the dynamic length."""

    def __init__(self, proj: nn.Module) -> None:
        super().__init__()
        self.proj = proj
        angles = _angles()
        self.register_buffer("freqs", torch.polar(torch.ones_like(angles), angles))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        y = torch.view_as_complex(self.proj(x).double().reshape(1, length, 8, 2))
        return torch.view_as_real(y * self.freqs[:length]).flatten(-2).to(x.dtype)


class RopePairs(nn.Module):
    """The same rotation as real pairs in ``pair_dtype`` (rotary_pairs)."""

    def __init__(self, proj: nn.Module, pair_dtype: torch.dtype) -> None:
        super().__init__()
        self.proj = proj
        self.pair_dtype = pair_dtype
        self.register_buffer("cos", _angles().cos().to(pair_dtype))
        self.register_buffer("sin", _angles().sin().to(pair_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        y = self.proj(x).to(self.pair_dtype)
        a, b = y[..., 0::2], y[..., 1::2]
        cos, sin = self.cos[:length], self.sin[:length]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).to(x.dtype)


class Pool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 16))
        self.register_buffer("pool", torch.zeros(32, 16))

    def forward(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        self.pool.index_copy_(0, slots, x * self.scale)
        return self.pool * 2.0


class ScatterAddInt64(nn.Module):
    def forward(self, counts: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(8, dtype=torch.int64, device=counts.device)
        out.scatter_add_(0, index, counts)
        return out


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 16)
        self.rope = RopePairs(nn.Identity(), torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rope(self.down(torch.nn.functional.gelu(self.up(x))))


def _bf16_copy(block: Block) -> Block:
    twin = copy.deepcopy(block)
    twin.up.to(torch.bfloat16)
    twin.down.to(torch.bfloat16)
    twin.rope.pair_dtype = torch.bfloat16  # the rope in the unit's own dtype; its cos/sin stay as buffers
    twin.rope.cos = twin.rope.cos.to(torch.bfloat16)
    twin.rope.sin = twin.rope.sin.to(torch.bfloat16)
    return twin


# --- run folders as the export step writes them ------------------------------------------------------------------


def _spec(name, dtype, shape, sampler="normal"):
    return {"name": name, "dtype": dtype, "shape": shape, "sampler": sampler}


def _recipe(name: str, methods, dtype: str, triton: str, seeds, sizes):
    from zoo.contract.recipes import DynamicDim, Lowering, Recipe, Source, Unit, Verify

    return Recipe(name=name, family="llama", source=Source(repo_id="zoo-gpu-test/none"),
                  unit=Unit(methods=list(methods), dtype=dtype), rotary_pairs="float32",
                  dynamic={"length": DynamicDim(min=2, max=MAX_LEN)},
                  lowering=Lowering(triton_kernel_mode=triton, max_mm_configs=1),
                  verify=Verify(seeds=list(seeds), sizes={"length": list(sizes)}))


def write_run(path: Path, recipe, exported: Dict, rewritten: Dict, io: Dict,
              reference_fp32: Optional[Dict] = None) -> Path:
    from zoo.contract.host_settings import NoHostSettings
    from zoo.contract.io_spec import IoSpec
    from zoo.contract.run_folder import RunFolder

    run = RunFolder(path)
    run.path.mkdir(parents=True, exist_ok=True)
    for method in exported:
        run.save_program(exported[method], "exported", method)
        run.save_program(rewritten[method], "rewritten", method)
        if reference_fp32:
            run.save_program(reference_fp32[method], "reference_fp32", method)
    run.write_recipe(recipe)
    dynamic = {d: {"min": r.min, "max": r.max} for d, r in recipe.dynamic.items()}
    run.write_io_spec(IoSpec.from_json({"format": 1, "dtype": recipe.unit.dtype, "methods": io, "dynamic": dynamic},
                                       "io_spec.json"))
    run.write_host_settings(NoHostSettings())  # synthetic units: nothing for a host to drive
    return path


def build_toy(path: Path) -> Path:
    torch.manual_seed(0)
    proj = nn.Linear(16, 16)
    length = torch.export.Dim("length", min=2, max=MAX_LEN)
    x = torch.randn(1, 9, 16)
    with torch.no_grad():
        exported = {
            "permuted": torch.export.export(ToyPermuted(), tuple(torch.randn(4, 4) for _ in range(3))),
            "rope": torch.export.export(RopeComplex(proj), (x,), dynamic_shapes=({1: length},)),
            "rope64": torch.export.export(RopeComplex(nn.Identity()), (x,), dynamic_shapes=({1: length},)),
            "pool": torch.export.export(Pool(), (torch.randn(3, 16), torch.tensor([1, 5, 9]))),
        }
        rewritten = dict(exported,
                         rope=torch.export.export(RopePairs(proj, torch.float32), (x,), dynamic_shapes=({1: length},)),
                         rope64=torch.export.export(RopePairs(nn.Identity(), torch.float64), (x,),
                                                    dynamic_shapes=({1: length},)))
    io = {"permuted": {"inputs": [_spec(n, "float32", [4, 4]) for n in "abc"], "outputs": ["y"]},
          "rope": {"inputs": [_spec("x", "float32", [1, "length", 16])], "outputs": ["rotated"]},
          "rope64": {"inputs": [_spec("x", "float32", [1, "length", 16])], "outputs": ["rotated"]},
          "pool": {"inputs": [_spec("x", "float32", [3, 16]), _spec("slots", "int64", [3], "randperm:32")],
                   "outputs": ["pool"]}}
    recipe = _recipe("toy", exported, "float32", "OFF", seeds=[0, 1], sizes=[7, 33])
    return write_run(path, recipe, exported, rewritten, io)


def build_bf16(path: Path) -> Path:
    torch.manual_seed(1)
    block = Block()
    length = torch.export.Dim("length", min=2, max=MAX_LEN)
    with torch.no_grad():
        fp32 = torch.export.export(block, (torch.randn(1, 9, 64),), dynamic_shapes=({1: length},))
        bf16 = torch.export.export(_bf16_copy(block), (torch.randn(1, 9, 64, dtype=torch.bfloat16),),
                                   dynamic_shapes=({1: length},))
    io = {"block": {"inputs": [_spec("x", "bfloat16", [1, "length", 64])], "outputs": ["y"]}}
    recipe = _recipe("toy-bf16", ["block"], "bfloat16", "ON", seeds=[0], sizes=[17])
    return write_run(path, recipe, {"block": bf16}, {"block": bf16}, io, reference_fp32={"block": fp32})


# --- the checks --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    from zoo.export.pipeline import lower_run

    run = build_toy(tmp_path_factory.mktemp("gpu") / "toy")
    return run, lower_run(run)


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
    from zoo.export import verify
    from zoo.contract.run_folder import RunFolder

    run, _ = toy_run
    folder = RunFolder(run)
    io_path = folder.io_order_file("permuted")
    saved = io_path.read_text()
    order = json.loads(saved)
    order["input_order"] = [0, 1, 2]
    io_path.write_text(json.dumps(order))
    try:
        result = verify.verify_artifact(run, folder.load_recipe(), raise_on_failure=False, runtimes=["aoti"])
    finally:
        io_path.write_text(saved)
    assert {r.method for r in result.failures()} == {"permuted"}


def test_audit_of_the_real_so(toy_run):
    from zoo.export import audit

    run, _ = toy_run
    result = audit.audit_artifact(run)
    by_method = {m.method: m for m in result.methods}
    assert "float64" in by_method["rope64"].dtypes and "float64" not in by_method["rope"].dtypes
    assert by_method["rope64"].missing["1.2"] == ["aoti_torch_dtype_float64"]
    assert all(s.startswith("aoti_torch_") for m in result.methods for s in m.symbols)


def test_bf16_unit_verifies_against_its_float32_export(tmp_path):
    from zoo.export.pipeline import lower_run

    report = lower_run(build_bf16(tmp_path / "bf16"))
    assert report.get("status") == "verified"
    rows = report.get("verification")["rows"]
    assert rows and all(r["reference"] == "eager float32" and r["eager_rel_l2"] > 0 for r in rows)
    # No further from float32 than eager bf16 is (times the recipe's factor), and pointing the same way.
    assert all(r["rel_l2"] <= max(1.25 * r["eager_rel_l2"], 1e-5) and r["cosine"] >= 0.999 for r in rows)


def test_int64_scatter_add_compiles_to_the_symbol_the_preflight_names(tmp_path):
    from zoo.export import audit
    from zoo.export.lower import lowering
    from zoo.export.lower import preflight
    from zoo.runtimes.aoti import AotiRunner
    from zoo.contract.recipes import Lowering, Recipe, Source, Unit
    from zoo.contract.run_folder import RunFolder

    counts, index = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 3, 3, 7])
    with torch.no_grad():
        ep = torch.export.export(ScatterAddInt64(), (counts, index))
    predicted = [n.symbol for n in preflight.check_kernels({"forward": ep}, "1.2", triton_kernel_mode="OFF").refused]
    recipe = Recipe(name="scatter", family="llama", source=Source(repo_id="none/none"), unit=Unit(methods=["forward"]),
                    lowering=Lowering(triton_kernel_mode="OFF", max_mm_configs=1))
    lowered = lowering.lower_to_pte({"forward": ep}, tmp_path, recipe, run_preflight=False)
    symbols = audit.audit_artifact(tmp_path).methods[0].symbols
    assert predicted == ["aoti_torch_cuda_scatter_reduce_two_out"]
    assert set(predicted) <= set(symbols)
    # The .so runs on libtorch's shims (which have the kernel) and counts as scatter_add does.
    run = RunFolder(tmp_path)
    runner = AotiRunner(run.so_file("forward"), run.weights_file("forward"))
    inputs = [counts.cuda(), index.cuda()]
    got = runner.run([inputs[i] for i in lowered.methods["forward"].input_order])[0]
    assert got.tolist() == [1, 0, 0, 5, 0, 0, 0, 4]


class GemmBlock(nn.Module):
    """The GEMMs of a DiT block at an action step's small M: a Linear with bias (addmm), one without (mm), a batched
    product over heads (bmm) with a transposed operand."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(256, 3 * 256)
        self.out = nn.Linear(256, 256, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        heads = lambda t: t.reshape(32, 4, 64).transpose(0, 1)  # noqa: E731
        scores = torch.bmm(heads(q), heads(k).transpose(1, 2)) * 0.125
        mixed = torch.bmm(scores.softmax(-1), heads(v)).transpose(0, 1).reshape(32, 256)
        return self.out(mixed)


@pytest.mark.parametrize("gemm", ["cublas", "autotune"])
def test_gemms_lowered_to_cublas_shims_match_eager_on_both_runtimes(tmp_path, gemm):
    """lowering.gemm=cublas puts every GEMM through aoti_torch_cuda_{addmm,mm,bmm}_out; autotune lets Inductor
    choose per GEMM. Torch's AOTI runner serves the shims from libtorch, zoo_runner (when built) from zoo's cuBLAS
    shims: both must give eager's numbers under the bf16 rule."""
    from zoo.contract.recipes import Lowering, Recipe, Source, Unit
    from zoo.contract.releases import requirement_for
    from zoo.contract.run_folder import RunFolder
    from zoo.export import audit
    from zoo.export.lower import lowering
    from zoo.runtimes.aoti import AotiRunner
    from zoo.runtimes.executorch import RUNNER_ENV

    module = GemmBlock().to(torch.bfloat16).cuda().eval()
    x = torch.randn(32, 256, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        ep = torch.export.export(module, (x,))
        eager = module(x).float()
        reference = GemmBlock().double().cuda()(x.double()).float()
    recipe = Recipe(name="gemm", family="llama", source=Source(repo_id="none/none"), unit=Unit(methods=["forward"]),
                    lowering=Lowering(triton_kernel_mode="OFF", max_mm_configs=2, gemm=gemm))
    lowering.lower_to_pte({"forward": ep}, tmp_path, recipe)
    symbols = set(audit.audit_artifact(tmp_path).methods[0].symbols)
    if gemm == "cublas":
        assert {"aoti_torch_cuda_addmm_out", "aoti_torch_cuda_mm_out", "aoti_torch_cuda_bmm_out"} <= symbols
    run = RunFolder(tmp_path)
    # runtime.json names the feature exactly when the .so calls a shim (autotune may have kept every template).
    calls_shims = any(s.startswith("aoti_torch_cuda_") and s.endswith("mm_out") for s in symbols)
    assert requirement_for(run).features == (["cublas-gemm"] if calls_shims else [])
    eager_error = float((eager - reference).norm() / reference.norm())
    runner = AotiRunner(run.so_file("forward"), run.weights_file("forward"))
    outputs = {"aoti": runner.run([x])[0].float()}
    if os.environ.get(RUNNER_ENV):
        from zoo.export.verify_runtimes import executorch_caller

        with executorch_caller(run.pte, run.ptd, ["forward"], "cuda", requirement=requirement_for(run)) as (_, call):
            outputs["executorch"] = call("forward", [x])[0].float()
    for name, got in outputs.items():
        error = float((got - reference).norm() / reference.norm())
        assert error <= 1.25 * eager_error + 1e-3, (name, error, eager_error)
