#!/usr/bin/env python3
"""GPU smoke check of zoo's lowering, extraction, AOTI runner, audit and verification on tiny synthetic units.

    python scripts/gpu_verify_smoke.py OUT_DIR              # on a CUDA machine
    python scripts/gpu_verify_smoke.py OUT_DIR --fake-compile   # CPU dry run: only AOTInductor's compile faked

Run folders are written the way the export step writes them (recipe.yaml, io_spec.json, exported/rewritten/
reference_fp32 .pt2), then `python -m zoo.lower RUN_DIR` does the rest:
  unit "toy" (float32, triton OFF): permuted (the .so takes its inputs in another order), rope (Linear + float32
      real-pair rope over a dynamic length, against complex128 eager), rope64 (float64 pairs: loads on no
      released runtime), pool (a buffer written with index_copy_, state kept across calls);
  unit "toy-bf16": a bf16 Linear + rope block judged against its float32 export.
Then: the same unit with the delegate order ignored (must fail), and an int64 scatter_add_ lowered without the
preflight, to see the symbol the preflight predicts in the compiled .so. Results go to OUT_DIR/smoke.json
(written after every step) with each run's report.md; a table is printed last.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Dict

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from torch import nn  # noqa: E402

MAX_LEN = 64


# --- the units ----------------------------------------------------------------------------------------------------


class Permuted(nn.Module):
    """Uses c, then b, then a: the partition's first-use order gives the .so inputs [2, 1, 0]."""

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return torch.tanh(c) * b + a


def _angles(dtype=torch.float64) -> torch.Tensor:
    return (torch.arange(MAX_LEN, dtype=torch.float64)[:, None]
            * 10000.0 ** (-torch.arange(8, dtype=torch.float64) / 8)).to(dtype)


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


def _spec(name, dtype, shape, sampler="normal"):
    return {"name": name, "dtype": dtype, "shape": shape, "sampler": sampler}


def write_run(run: Path, name: str, exported: Dict[str, Any], rewritten: Dict[str, Any], io: Dict[str, Any],
              recipe: Dict[str, Any], reference_fp32: Dict[str, Any] = None) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    for method in exported:
        torch.export.save(exported[method], str(run / f"exported.{method}.pt2"))
        torch.export.save(rewritten[method], str(run / f"rewritten.{method}.pt2"))
        if reference_fp32:
            torch.export.save(reference_fp32[method], str(run / f"reference_fp32.{method}.pt2"))
    (run / "recipe.yaml").write_text(OmegaConf.to_yaml({"name": name, "family": "llama",
                                                        "source": {"repo_id": "zoo-smoke/none"}, **recipe}))
    (run / "io_spec.json").write_text(json.dumps({"methods": io, "dynamic": recipe.get("dynamic", {})}))
    (run / "host_settings.json").write_text("{}\n")  # synthetic units: nothing for a host to drive
    return run


def build_toy(run: Path) -> Path:
    torch.manual_seed(0)
    proj = nn.Linear(16, 16)
    length = torch.export.Dim("length", min=2, max=MAX_LEN)
    x = torch.randn(1, 9, 16)
    with torch.no_grad():
        exp = {
            "permuted": torch.export.export(Permuted(), tuple(torch.randn(4, 16) for _ in range(3))),
            "rope": torch.export.export(RopeComplex(proj), (x,), dynamic_shapes=({1: length},)),
            "rope64": torch.export.export(RopeComplex(nn.Identity()), (x,), dynamic_shapes=({1: length},)),
            "pool": torch.export.export(Pool(), (torch.randn(3, 16), torch.tensor([1, 5, 9]))),
        }
        rew = dict(exp,
                   rope=torch.export.export(RopePairs(proj, torch.float32), (x,), dynamic_shapes=({1: length},)),
                   rope64=torch.export.export(RopePairs(nn.Identity(), torch.float64), (x,),
                                              dynamic_shapes=({1: length},)))
    io = {"permuted": {"inputs": [_spec(n, "float32", [4, 16]) for n in "abc"], "outputs": ["y"]},
          "rope": {"inputs": [_spec("x", "float32", [1, "length", 16])], "outputs": ["rotated"]},
          "rope64": {"inputs": [_spec("x", "float32", [1, "length", 16])], "outputs": ["rotated"]},
          "pool": {"inputs": [_spec("x", "float32", [3, 16]), _spec("slots", "int64", [3], "randperm:32")],
                   "outputs": ["pool"]}}
    recipe = {"unit": {"methods": list(exp), "dtype": "float32"}, "rotary_pairs": "float32",
              "dynamic": {"length": {"min": 2, "max": MAX_LEN}},
              "lowering": {"triton_kernel_mode": "OFF", "max_mm_configs": 1},
              "verify": {"seeds": [0, 1], "sizes": {"length": [7, 33]}}}
    return write_run(run, "toy", exp, rew, io, recipe)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 16)
        self.rope = RopePairs(nn.Identity(), torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rope(self.down(torch.nn.functional.gelu(self.up(x))))


def build_bf16(run: Path) -> Path:
    torch.manual_seed(1)
    block = Block()
    length = torch.export.Dim("length", min=2, max=MAX_LEN)
    with torch.no_grad():
        fp32 = torch.export.export(block, (torch.randn(1, 9, 64),), dynamic_shapes=({1: length},))
        bf16 = torch.export.export(_bf16_copy(block), (torch.randn(1, 9, 64, dtype=torch.bfloat16),),
                                   dynamic_shapes=({1: length},))
    io = {"block": {"inputs": [_spec("x", "bfloat16", [1, "length", 64])], "outputs": ["y"]}}
    recipe = {"unit": {"methods": ["block"], "dtype": "bfloat16"}, "rotary_pairs": "float32",
              "dynamic": {"length": {"min": 2, "max": MAX_LEN}},
              "lowering": {"triton_kernel_mode": "ON", "max_mm_configs": 1},
              "verify": {"seeds": [0], "sizes": {"length": [17]}}}
    return write_run(run, "toy-bf16", {"block": bf16}, {"block": bf16}, io, recipe, reference_fp32={"block": fp32})


def _bf16_copy(block: nn.Module) -> nn.Module:
    import copy

    twin = copy.deepcopy(block)
    twin.up.to(torch.bfloat16)
    twin.down.to(torch.bfloat16)
    twin.rope.pair_dtype = torch.bfloat16  # the rope in the unit's own dtype; its cos/sin stay as buffers
    twin.rope.cos = twin.rope.cos.to(torch.bfloat16)
    twin.rope.sin = twin.rope.sin.to(torch.bfloat16)
    return twin


# --- running ---------------------------------------------------------------------------------------------------------


def install_fake(patcher) -> Any:
    """CPU dry run: fake AOTInductor's compile (tests/fixtures/fake_cuda.py) and verify on the CPU."""
    spec = importlib.util.spec_from_file_location("fake_cuda", ROOT / "tests" / "fixtures" / "fake_cuda.py")
    fake_cuda = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake_cuda)
    import zoo.verify

    fake = fake_cuda.FakeCudaCompile({})
    fake.install(patcher)
    patcher.setattr(zoo.verify, "aoti_runner_factory", fake.runner_factory)
    patcher.setattr(zoo.verify, "_default_device", lambda: "cpu")
    return fake


def summarize_run(run: Path) -> Dict[str, Any]:
    report = json.loads((run / "report.json").read_text())
    out: Dict[str, Any] = {"stages": {s["stage"]: [s["status"], s["seconds"], s["detail"]] for s in report["stages"]},
                           "status": report.get("status"), "error": report.get("error")}
    low = report.get("lowering")
    if low:
        out["lowering"] = {"seconds": low["seconds"], "compile_seconds": low["compile_seconds"], "gpu": low["gpu"],
                           "pte_bytes": low["pte_bytes"], "ptd_bytes": low["ptd_bytes"],
                           "methods": {m: {k: v[k] for k in ("input_order", "output_order", "so_bytes",
                                                             "weights_bytes", "mutable_buffers")}
                                       for m, v in low["methods"].items()}}
    aud = report.get("audit")
    if aud:
        out["audit"] = {"dtypes": aud["dtypes"], "releases": aud["releases"],
                        "symbols": {m["method"]: m["symbols"] for m in aud["methods"]}}
    ver = report.get("verification")
    if ver:
        out["verification"] = {"ok": ver["passed"], "executorch_runtime": ver["executorch_runtime"],
                               "rows": [{k: r[k] for k in ("method", "seed", "sizes", "output", "max_abs", "rel_l2",
                                                           "cosine", "tolerance", "ok", "eager_rel_l2")}
                                        for r in ver["rows"]]}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--fake-compile", action="store_true", help="CPU dry run with the compile faked")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    from zoo import audit, lower, lowering, preflight, verify
    from zoo.recipes import Lowering, Recipe, Source, Unit

    patcher = __import__("pytest").MonkeyPatch() if args.fake_compile else None
    fake = install_fake(patcher) if args.fake_compile else None
    device = "cpu" if args.fake_compile else "cuda"
    results: Dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                               "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                               "fake_compile": args.fake_compile}
    work = Path(tempfile.mkdtemp(prefix="zoo-smoke-"))

    def save():
        (args.out / "smoke.json").write_text(json.dumps(results, indent=2, default=str))

    def step(name, fn):
        start = time.perf_counter()
        try:
            results[name] = fn()
        except Exception as exc:  # keep going: every step's outcome is worth having from one GPU call
            results[name] = {**(results.get(name) or {}), "exception": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        results[name + "_seconds"] = round(time.perf_counter() - start, 1)
        print(f"[smoke] {name}: {results[name + '_seconds']} s", flush=True)
        save()

    def toy():
        run = build_toy(work / "toy")
        rc = lower.main([str(run)])
        shutil.copy(run / "report.md", args.out / "toy.report.md")
        return {"rc": rc, **summarize_run(run)}

    def toy_order_ignored():
        run = work / "toy"
        io_path = run / "so" / "permuted.io.json"
        order = json.loads(io_path.read_text())
        order["input_order"] = sorted(order["input_order"])
        io_path.write_text(json.dumps(order))
        recipe = lower.load_run_recipe(run)
        result = verify.verify_artifact(run, recipe, raise_on_failure=False, try_executorch=False,
                                        device=device, runner_factory=fake.runner_factory if fake else None)
        return {"ok": result.ok, "permuted_rel_l2": [r.rel_l2 for r in result.rows if r.method == "permuted"]}

    def bf16():
        run = build_bf16(work / "bf16")
        rc = lower.main([str(run)])
        shutil.copy(run / "report.md", args.out / "bf16.report.md")
        return {"rc": rc, **summarize_run(run)}

    def scatter():
        with torch.no_grad():
            ep = torch.export.export(ScatterAddInt64(), (torch.tensor([1, 2, 3, 4]), torch.tensor([0, 3, 3, 7])))
        pre = preflight.check_kernels({"forward": ep}, "1.2", triton_kernel_mode="OFF")
        recipe = Recipe(name="scatter", family="llama", source=Source(repo_id="zoo-smoke/none"),
                        unit=Unit(methods=["forward"]), lowering=Lowering(triton_kernel_mode="OFF", max_mm_configs=1))
        out = work / "scatter"
        found = results["scatter"] = {"preflight_refused": [n.kernel for n in pre.refused],
                                      "expected": [1, 0, 0, 5, 0, 0, 0, 4]}
        lowered = lowering.lower_to_pte({"forward": ep}, out, recipe, run_preflight=False)
        found["so_symbols"] = audit.audit_artifact(out).methods[0].symbols
        found["predicted_symbol_in_so"] = "aoti_torch_cuda_scatter_reduce_two_out" in found["so_symbols"]
        save()
        if not args.fake_compile:
            from zoo.aoti_runner import AotiRunner

            runner = AotiRunner(out / "so" / "forward.so", out / "so" / "forward.weights.blob")
            order = lowered.methods["forward"].input_order
            inputs = [torch.tensor([1, 2, 3, 4], device="cuda"), torch.tensor([0, 3, 3, 7], device="cuda")]
            found["aoti_result"] = runner.run([inputs[i] for i in order])[0].tolist()
        return found

    step("toy", toy)
    step("toy_order_ignored", toy_order_ignored)
    step("scatter", scatter)
    step("bf16", bf16)
    for name in ("rope", "rope64"):
        so = work / "toy" / "so" / f"{name}.so"
        if so.exists() and so.stat().st_size < 15 * 2**20:
            shutil.copy(so, args.out / f"toy.{name}.so")
    save()
    print_table(results)
    if patcher:
        patcher.undo()
    return 0


def print_table(results: Dict[str, Any]) -> None:
    print(f"\n=== zoo GPU smoke: {results['gpu']} torch {results['torch']} fake_compile={results['fake_compile']}")
    for unit in ("toy", "bf16"):
        r = results.get(unit, {})
        if "exception" in r:
            print(f"{unit}: EXCEPTION {r['exception'][:300]}")
            continue
        stages = " ".join(f"{k}={v[0]}({v[1]}s)" for k, v in r.get("stages", {}).items())
        print(f"{unit}: rc={r.get('rc')} {stages}")
        low = r.get("lowering") or {}
        for m, v in low.get("methods", {}).items():
            print(f"  {m:9s} in={v['input_order']} out={v['output_order']} so={v['so_bytes']} "
                  f"weights={v['weights_bytes']} buffers={v['mutable_buffers']}")
        if low:
            print(f"  pte={low['pte_bytes']} ptd={low['ptd_bytes']} lowering={low['seconds']}s gpu={low['gpu']}")
        aud = r.get("audit") or {}
        if aud:
            print("  audit: " + ", ".join(f"{k}:{'yes' if v['loadable'] else 'NO'}" for k, v in aud["releases"].items())
                  + f" dtypes={aud['dtypes']}")
            for m, syms in aud["symbols"].items():
                print(f"    {m}: {len(syms)} symbols, missing@1.2: "
                      f"{aud['releases']['1.2']['missing'].get(m, [])}")
        ver = r.get("verification") or {}
        worst: Dict[str, Any] = {}
        for row in ver.get("rows", []):
            w = worst.setdefault(row["method"], [0.0, 1.0, True, None])
            w[0], w[1], w[2] = max(w[0], row["rel_l2"]), min(w[1], row["cosine"]), w[2] and row["ok"]
            if row.get("eager_rel_l2") is not None:
                w[3] = max(w[3] or 0.0, row["eager_rel_l2"])
        for m, (rel, cos, ok, eager) in worst.items():
            print(f"  verify {m:9s} worst rel_l2={rel:.3e} min cos={cos:.8f} ok={ok}"
                  + (f" eager_bf16_vs_fp32={eager:.3e}" if eager is not None else ""))
        if ver:
            print(f"  {ver['executorch_runtime'][:120]}")
    o = results.get("toy_order_ignored", {})
    print(f"order ignored: ok={o.get('ok')} permuted rel_l2={o.get('permuted_rel_l2')} {o.get('exception', '')}")
    s = results.get("scatter", {})
    print(f"int64 scatter_add: preflight refused={s.get('preflight_refused')} symbol in .so="
          f"{s.get('predicted_symbol_in_so')} aoti={s.get('aoti_result')} expected={s.get('expected')} "
          f"{s.get('exception', '')[:300]}")


if __name__ == "__main__":
    sys.exit(main())
