#!/usr/bin/env python3
"""Does the lowering process find the GEMM autotuning choices that Inductor's compile pool compiled? (issue 12)

    python scripts/ptxas_cache_check.py --out OUT        # on a CUDA machine; about 4 minutes on an H200

A small bf16 graph with two GEMMs (``relu(addmm(c, a, b)) @ d``, 20 Triton choices each) is AOT-compiled with the
ExecuTorch CUDA backend's autotuning options (``max_autotune``, Triton-only GEMMs), twice, each in a fresh process
with an empty cache directory and a warmed 8-process compile pool:

  inductor   Inductor as it is: the lowering process runs Triton's own ptxas, the pool's workers torch's
  zoo        inside ``zoo.export.lower.lowering.inductor_settings``: the lowering process runs the workers' ptxas too

Triton's compile listener counts the lowering process's own compiles, found in Triton's cache or not, per
thread. Inductor's phase timers give the template autotuning and precompiling time. The table ends the run;
OUT/ptxas_cache_check.json holds every number.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = ("inductor", "zoo")


def one_mode(mode: str) -> dict:
    """Runs in its own process: compile the graph once, return what the lowering process compiled."""
    import threading

    import torch
    from torch._dynamo.utils import compilation_time_metrics
    from torch._inductor.async_compile import AsyncCompile
    from triton import knobs

    from zoo.export.lower.lowering import inductor_settings

    compiles: dict = {}

    def listener(*, cache_hit, **_):
        key = f"{'hit' if cache_hit else 'miss'} {threading.current_thread().name.split('-')[0]}"
        compiles[key] = compiles.get(key, 0) + 1

    knobs.compilation.listener = listener
    AsyncCompile.warm_pool()
    AsyncCompile.wait_pool_ready()

    class TwoGemms(torch.nn.Module):
        def forward(self, a, b, c, d):
            return torch.relu(torch.addmm(c, a, b)) @ d

    def draw(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    program = torch.export.export(TwoGemms(), (draw(512, 1024), draw(1024, 2048), draw(2048), draw(2048, 768)))
    options = {"max_autotune": True, "max_autotune_gemm_backends": "TRITON", "max_autotune_conv_backends": "TRITON"}
    start = time.perf_counter()
    with inductor_settings(None) if mode == "zoo" else contextlib.nullcontext():
        # No package path: Inductor writes the package into its own temporary place (the cache is a fresh folder).
        torch._inductor.aoti_compile_and_package(program, inductor_configs=options)
        ptxas = os.environ.get("TRITON_PTXAS_PATH")
    phases = {k: round(sum(v), 2) for k, v in compilation_time_metrics.items()
              if "template_autotuning" in k or "template_precompiling" in k}
    return {"mode": mode, "compile_s": round(time.perf_counter() - start, 1), "ptxas": ptxas,
            "own_compiles": compiles, "phases": phases}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="folder for ptxas_cache_check.json")
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one mode, in this process
    args = p.parse_args(argv)
    if args.mode:
        print(json.dumps(one_mode(args.mode)))
        return 0
    if args.out is None:
        p.error("--out is required")
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for mode in MODES:
        with tempfile.TemporaryDirectory(prefix=f"zoo-ptxas-{mode}-") as cache:
            env = {k: v for k, v in os.environ.items() if k != "TRITON_PTXAS_PATH"}
            env.update(TORCHINDUCTOR_CACHE_DIR=cache, ZOO_INDUCTOR_CACHE=cache, TORCHINDUCTOR_COMPILE_THREADS="8",
                       PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
            print(f"[ptxas-cache] {mode}: compiling ...", file=sys.stderr, flush=True)
            done = subprocess.run([sys.executable, __file__, "--mode", mode], env=env, capture_output=True,
                                  text=True, timeout=900)
            if done.returncode != 0:
                print(done.stderr[-3000:], file=sys.stderr)
                results.append({"mode": mode, "error": done.stderr.strip().splitlines()[-1:]})
                continue
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    (args.out / "ptxas_cache_check.json").write_text(json.dumps(results, indent=1))
    print(f"{'mode':<9} {'compile s':>9} {'own hits':>8} {'own misses':>10} {'autotune s':>10} {'precompile s':>12}  ptxas")
    for r in results:
        if "error" in r:
            print(f"{r['mode']:<9} failed: {r['error']}")
            continue
        own = r["own_compiles"]
        hits = sum(n for k, n in own.items() if k.startswith("hit"))
        misses = sum(n for k, n in own.items() if k.startswith("miss"))
        tune = sum(v for k, v in r["phases"].items() if "autotuning" in k)
        pre = sum(v for k, v in r["phases"].items() if "precompiling" in k)
        print(f"{r['mode']:<9} {r['compile_s']:>9} {hits:>8} {misses:>10} {tune:>10.2f} {pre:>12.2f}  {r['ptxas'] or 'Triton own'}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
