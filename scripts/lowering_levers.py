#!/usr/bin/env python3
"""What each lowering lever saves, and what it does to the kernels: one LingBot-VA method at real width and a
few layers, lowered once per variant, each in its own process with cold Inductor/Triton caches (GPU only).

    python scripts/lowering_levers.py --out OUT [--layers 3] [--method action_step]
                                      [--variants baseline no_epilogue_bench wrapper_o0 single_arch mm_configs_6]

Each variant prints and records: the lowering's wall time, Inductor's own phase timers (Scheduler.__init__,
CppWrapperGpu.generate, AotCodeCompiler.compile, <op>_template_autotuning, ...), the number of compiled
kernels, the artifact's latency against eager (CUDA events), its agreement with eager (rel L2, cosine) and
with the baseline variant's artifact (same inputs), and a sampling profile (OUT/<variant>/profile.txt).
OUT/levers.md and OUT/levers.json are rewritten after every variant, so a run cut short keeps what it measured.

Variants (each changes one thing against ``baseline``, zoo's lowering as it is):
  baseline           zoo.export.lower.lowering.lower_to_pte, no preflight (the preflight is measured on the CPU)
  no_epilogue_bench  TORCHINDUCTOR_BENCHMARK_EPILOGUE_FUSION=0: GEMM epilogue fusion decided by Inductor's
                     estimate instead of compiling and benchmarking each template+epilogue pair
  wrapper_o0         AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL=O0 and TORCHINDUCTOR_VEC_ISA_OK=0: the C++ wrapper
                     (host code only) built at -O0, no CPU vector-ISA probe
  single_arch        aot_inductor.emit_multi_arch_kernel=False: Triton's own cubin embedded, no per-kernel
                     `nvcc -fatbin` (serial in AotCodeCompiler.compile); the .so then carries sm_XX SASS only,
                     no PTX (this measures the serial nvcc loop; a parallel loop keeps the PTX)
  mm_configs_6       lowering.max_mm_configs=6: at most 6 Triton GEMM configs autotuned per shape
  gemm_only_tuning   max_autotune off, max_autotune_gemm on (CudaBackend's options set max_autotune): GEMM
                     templates still autotuned, but reductions get Inductor's hint-filtered config list
                     instead of benchmarking every candidate (runtime/triton_heuristics.py:3225-3232,
                     3645-3652)
  all_safe           no_epilogue_bench + wrapper_o0 together

Weights are seeded (zoo.policies.fast_init), so every variant lowers the same program. Layers scale the
per-node phases (scheduling, codegen); GEMM autotuning is per distinct shape and does not grow with layers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

VARIANTS: Dict[str, Dict[str, Any]] = {
    "baseline": {},
    "no_epilogue_bench": {"env": {"TORCHINDUCTOR_BENCHMARK_EPILOGUE_FUSION": "0"}},
    "wrapper_o0": {"env": {"AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL": "O0", "TORCHINDUCTOR_VEC_ISA_OK": "0"}},
    "single_arch": {"options": {"aot_inductor.emit_multi_arch_kernel": False}},
    "mm_configs_6": {"max_mm_configs": 6},
    "gemm_only_tuning": {"options": {"max_autotune": False, "max_autotune_gemm": True}},
    "all_safe": {"env": {"TORCHINDUCTOR_BENCHMARK_EPILOGUE_FUSION": "0", "AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL": "O0",
                         "TORCHINDUCTOR_VEC_ISA_OK": "0"}},
}


def say(message: str) -> None:
    print(f"[levers {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------------
# child: one variant, one process


def build_method(layers: int, method: str):
    """LingBot-VA at the recipe's width with ``layers`` layers, seeded weights, exported and rewritten."""
    from lerobot.policies.lingbot_va import LingBotVAPolicy
    from lerobot.policies.lingbot_va.utils import WanTransformer3DModel

    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_real_size as brs

    from zoo.export import trace as exporting
    from zoo.export import pipeline
    from zoo.policies import fast_init
    from zoo.policies.lingbot_va import unit as lingbot_va

    recipe = brs.unit_recipe(brs.parse_unit("lingbot_va"), tiny=False)
    options = recipe.unit.options  # a dict, or (families by convention) the family's options dataclass
    policy_config = options["policy_config"] if isinstance(options, dict) else options.policy_config
    policy_config["num_layers"] = layers
    recipe.unit.methods = [method]
    folder = brs.placeholder_checkpoint(lingbot_va._fabricated_config(recipe, lingbot_va._validate_recipe(recipe)),
                                        Path(tempfile.mkdtemp(prefix="levers-ckpt-")))
    with fast_init.built_on_meta(LingBotVAPolicy, [WanTransformer3DModel]), \
            fast_init.seeded_weights(recipe.source.seed):
        unit = lingbot_va.build_unit(folder, recipe)
    sizes = exporting.example_sizes(recipe)
    ep = exporting.export_method(unit.methods[method], recipe, sizes)
    ep = pipeline.apply_rewrites(ep, recipe, method)[0]
    inputs = unit.methods[method].example_inputs(sizes, seed=0)
    return recipe, unit, ep, inputs


def cuda_ms(fn, warmup: int, runs: int) -> float:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def run_child(args) -> int:
    spec = VARIANTS[args.child]
    out = Path(args.out) / args.child
    out.mkdir(parents=True, exist_ok=True)
    from zoo.core.sampling_profiler import SamplingProfiler, compile_phase_times

    record: Dict[str, Any] = {"variant": args.child, "layers": args.layers, "method": args.method,
                              "env": spec.get("env", {}), "options": spec.get("options", {}),
                              "max_mm_configs": spec.get("max_mm_configs"), "status": "started"}
    with SamplingProfiler(out / "profile.txt", title=f"lowering_levers {args.child}") as prof:
        t0 = time.perf_counter()
        with prof.section("build+export+rewrite"):
            recipe, unit, ep, inputs = build_method(args.layers, args.method)
        record["prepare_s"] = round(time.perf_counter() - t0, 1)
        if "max_mm_configs" in spec:
            recipe.lowering.max_mm_configs = spec["max_mm_configs"]
        import torch
        import torch._inductor.codecache as codecache
        from torch._dynamo.utils import compilation_time_metrics
        from torch._inductor.utils import fresh_cache

        from zoo.export.lower import lowering
        from zoo.runtimes.aoti import AotiRunner
        from zoo.core.numerics import compare
        from zoo.export.verify import run_in_delegate_order

        patch_options = None
        if spec.get("options"):  # CudaBackend passes its options to aot_compile, over any outer config patch
            from executorch.backends.cuda.cuda_backend import CudaBackend

            original = CudaBackend.__dict__["get_aoti_compile_options"]
            changed = dict(spec["options"])

            def variant_options(cls, compile_specs):
                return {**original.__func__(cls, compile_specs), **changed}

            CudaBackend.get_aoti_compile_options = classmethod(variant_options)
            patch_options = (CudaBackend, original)
        compilation_time_metrics.clear()
        try:
            with fresh_cache(), prof.section("lower"):
                t0 = time.perf_counter()
                result = lowering.lower_to_pte({args.method: ep}, out, recipe, run_preflight=False)
                record["lower_s"] = round(time.perf_counter() - t0, 1)
                record["kernels"] = len(codecache.CudaKernelParamCache.cache)
        finally:
            if patch_options:
                patch_options[0].get_aoti_compile_options = patch_options[1]
        record["phases"] = {k: round(sum(v), 2) for k, v in sorted(compilation_time_metrics.items(),
                                                                    key=lambda kv: -sum(kv[1])) if v}
        record["pte_bytes"], record["ptd_bytes"] = result.pte_bytes, result.ptd_bytes
        say(f"{args.child}: lowered in {record['lower_s']} s, {record['kernels']} kernels")
        print(compile_phase_times(top=20), file=sys.stderr, flush=True)
        with prof.section("latency"):
            art = result.methods[args.method]
            order = art.delegate_order
            runner = AotiRunner(*art.files(out), "cuda")
            dev_inputs = [t.to("cuda") for t in inputs]
            module = unit.methods[args.method].module.to("cuda")
            with torch.no_grad():
                got = run_in_delegate_order(runner, order, dev_inputs)
                want = module(*dev_inputs)
                want = list(want) if isinstance(want, (tuple, list)) else [want]
                record["artifact_ms"] = round(cuda_ms(lambda: run_in_delegate_order(runner, order, dev_inputs),
                                                      args.warmup, args.runs), 3)
                record["eager_ms"] = round(cuda_ms(lambda: module(*dev_inputs), args.warmup, args.runs), 3)
            c = compare("out0", got[0], want[0])
            record["rel_l2_vs_eager"], record["cosine_vs_eager"] = c.rel_l2, c.cosine
            torch.save(got[0].cpu(), out / "output0.pt")
        record["status"] = "done"
    (out / "record.json").write_text(json.dumps(record, indent=2))
    return 0


# ------------------------------------------------------------------------------------------------------
# parent


def table(records: List[Dict[str, Any]]) -> str:
    phases = ["Scheduler.__init__", "Scheduler.codegen", "CppWrapperGpu.generate", "AotCodeCompiler.compile",
              "compile_file", "benchmark_fused_nodes", "benchmark_codegened_module", "async_compile.wait",
              "CachingAutotuner.benchmark_all_configs", "GraphLowering.run"]
    head = ["variant", "lower s", "kernels", "artifact ms", "eager ms", "rel L2 vs eager", "rel L2 vs baseline"]
    head += phases + ["autotuning (sum of *_template_autotuning)"]
    rows = [head]
    for r in records:
        ph = r.get("phases", {})
        tune = sum(v for k, v in ph.items() if k.endswith("_template_autotuning"))
        rows.append([r["variant"], r.get("lower_s", "-"), r.get("kernels", "-"), r.get("artifact_ms", "-"),
                     r.get("eager_ms", "-"), _fmt(r.get("rel_l2_vs_eager")), _fmt(r.get("rel_l2_vs_baseline"))]
                    + [ph.get(p, "-") for p in phases] + [round(tune, 1)])
    return "\n".join("| " + " | ".join(str(x) for x in row) + " |" + ("\n|" + "---|" * len(head) if i == 0 else "")
                     for i, row in enumerate(rows))


def _fmt(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2e}"


def run_parent(args) -> int:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    records: List[Dict[str, Any]] = []
    for variant in args.variants:
        if variant not in VARIANTS:
            raise SystemExit(f"unknown variant {variant!r}; variants: {', '.join(VARIANTS)}")
    for variant in args.variants:
        env = {**os.environ, **VARIANTS[variant].get("env", {})}
        say(f"variant {variant} ...")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", variant, "--out", str(out),
               "--layers", str(args.layers), "--method", args.method, "--runs", str(args.runs),
               "--warmup", str(args.warmup)]
        done = subprocess.run(cmd, env=env, timeout=args.variant_timeout)
        path = out / variant / "record.json"
        record = json.loads(path.read_text()) if path.exists() else {"variant": variant, "status": f"rc {done.returncode}"}
        base = out / "baseline" / "output0.pt"
        mine = out / variant / "output0.pt"
        if variant != "baseline" and base.exists() and mine.exists():
            import torch

            from zoo.core.numerics import compare

            record["rel_l2_vs_baseline"] = compare("out0", torch.load(mine), torch.load(base)).rel_l2
        records.append(record)
        (out / "levers.json").write_text(json.dumps(records, indent=2))
        (out / "levers.md").write_text(table(records) + "\n")
        print(table(records), flush=True)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/lowering_levers.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--method", default="action_step", choices=["action_step", "video_step"])
    p.add_argument("--variants", nargs="+", default=["baseline", "no_epilogue_bench", "wrapper_o0", "single_arch"])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--variant-timeout", type=int, default=300, help="seconds per variant before it is cut")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    return run_child(args) if args.child else run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
