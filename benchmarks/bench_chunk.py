#!/usr/bin/env python3
"""Chunk latency at real size: observation -> actions for one whole action chunk.

    python benchmarks/bench_chunk.py --out OUT [--policies lingbot_va fast_wam] [--chunks 4] [--episodes 3]

The candidates, what is timed, the weights, the stages (--only), the policy check and --record:
benchmarks/README.md, "bench_chunk.py"; the code it runs is zoo.bench.chunk (tables: zoo.bench.chunk_tables).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import shlex
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

from zoo import bench, policies
from zoo.bench import roofline
from zoo.bench.seeded import depth_overrides
from zoo.bench.chunk import (POLICIES, TARGETS, check_passed, checked_here, policy_check, policy_source,
                             record_timings, refuse_unverified, say, time_candidates)
from zoo.bench.chunk_tables import policy_check_section, ratio_lines, table_rows, write
from zoo.bench.chunk_runners import floor_rows, split_rows
from zoo.contract import chunk_latency
from zoo.runner.backends import BACKENDS
from zoo.contract.recipes import load_recipe
from zoo.contract.run_folder import RunFolder
from zoo.core.report import RunReport, format_table
from zoo.export import pipeline
from zoo.export import stages as gpu_steps


def lower_policy(family: str, recipe, run: RunFolder, checkpoint: Path, weights: Callable, device: str) -> None:
    """Build, quantize (``unit.quantize``), export, rewrite, measure what quantization costs, preflight, lower and
    verify through the pipeline's own steps into ``run``, in ``python -m zoo.export``'s order.

    On a GPU the lowered artifact is verified as every zoo artifact is (``gpu_steps.verify_unit_step``: the
    bf16 rule against the unit's float32 copy, made on the GPU; for a quantized unit, the copy of the quantized
    unit: its int8 weights dequantized in float32) before anything is timed on it; a failed verification fails
    the policy here. The eager backend (a CPU check of this script) saves the rewritten programs instead, and
    there is nothing to verify."""
    run.path.mkdir(parents=True, exist_ok=True)
    report = RunReport(run.path, recipe.to_dict())
    run.write_recipe(recipe)
    try:
        fam = policies.load_family(family)
        with weights():
            unit = pipeline.build_step(None, recipe, run, report, build=lambda: fam.build_unit(checkpoint, recipe))
        # Records the layers and the weights' bytes before and after in the report (its quantization section).
        baselines = pipeline.quantize_step(unit, recipe, report)
        programs, _ = pipeline.export_step(unit, recipe, run, report, save=False, reference=False)
        rewritten = pipeline.rewrite_step(programs, recipe, report)
        del programs
        # On the bench's device: at real size the three units' eager runs would take the CPU many minutes.
        pipeline.quantization_cost_step(unit, baselines, recipe, report, device=device)
        del baselines
        gc.collect()
        # The rewritten programs stay in the run: the pytorch candidate and the roofline's FLOP count read them,
        # and the lowering workers load them from there (each program saved once).
        pipeline.save_step(rewritten, recipe, run, report)
        if torch.device(device).type == "cuda":
            files = {m: run.program("rewritten", m) for m in rewritten}
            del rewritten
            gc.collect()
            # lower_step runs the kernel preflight on each method's own edge program: no second to_edge here.
            gpu_steps.lower_step(files, run, recipe, report)
            say(f"{family}: verify the artifact ({recipe.unit.dtype} unit"
                + (f", {recipe.unit.quantize.words()}" if recipe.unit.quantize.enabled else "") + f", on {device})")
            gpu_steps.verify_unit_step(run, recipe, report, unit, device=device)
            report.record("status", "verified")
        else:
            report.record("status", "lowered")
    finally:
        run.write_report(report)


def bench_policy(family: str, args, out: Path, results: Dict[str, Any]) -> None:
    """One policy's record in ``results``: lowered unless its run is there, then lowered only, checked only, or
    timed (and checked) as ``--only`` and ``--policy-check`` say. A failure is recorded and the next policy runs."""
    real, tiny = POLICIES[family]
    overrides = list(args.set)
    if args.layers:
        overrides += depth_overrides(family, load_recipe(tiny if args.tiny else real, overrides), args.layers)
    recipe = load_recipe(tiny if args.tiny else real, overrides)
    work = out / family
    run = RunFolder(work / "run")
    record: Dict[str, Any] = {"policy": family, "recipe": recipe.name, "dtype": recipe.unit.dtype,
                              "quantize": recipe.unit.quantize.words(), "methods": list(recipe.unit.methods),
                              "candidates": {}}
    if args.layers:
        record["layers"] = args.layers
    if overrides:
        record["overrides"] = overrides
    results["policies"].append(record)
    have = (run.program("rewritten", recipe.unit.methods[0]).is_file() if args.backend == "eager"
            else run.pte.is_file())
    try:
        with policy_source(family, recipe, work, results["settings"]) as (checkpoint, weights):
            if not have and args.only not in ("bench", "check"):
                say(f"{family}: build, export and lower ({', '.join(recipe.unit.methods)}) into {run.path}")
                lower_policy(family, recipe, run, checkpoint, weights, args.device)
            record["run"] = str(run.path)
            record.update(artifact_facts(run))
            if args.only == "lower":
                record["status"] = "lowered"
                return
            if args.only == "check":
                record["status"] = "checked"
                policy_check(family, recipe, run, checkpoint, weights, args, record)
                return
            refuse_unverified(run, args.backend, checked=checked_here(out, family))
            time_candidates(family, recipe, run, checkpoint, weights, args, record, persist=lambda: write(results, out))
            if args.policy_check:
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                policy_check(family, recipe, run, checkpoint, weights, args, record)
    except Exception as exc:  # one policy failing (out of memory, a lowering refusal) must not lose the other
        record["status"] = "failed"
        record["error"] = bench.error_line(exc)
        record["traceback"] = traceback.format_exc(limit=8)
        say(f"{family} failed: {record['error']}")
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def artifact_facts(run: RunFolder) -> Dict[str, Any]:
    """What a policy's record says of its run beside the timings: the artifact's .ptd bytes (None where nothing
    was lowered: the eager backend) and, for a quantized unit, the weights' bytes before and after quantization."""
    facts: Dict[str, Any] = {"ptd_bytes": run.ptd.stat().st_size if run.ptd.is_file() else None}
    applied = (run.read_report().get("quantization") or {}).get("applied") or {}
    if applied.get("weight_bytes"):
        facts["weight_bytes"] = applied["weight_bytes"]
    return facts


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benchmarks/bench_chunk.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--out", type=Path, required=True, help="output folder (one sub-folder per policy)")
    p.add_argument("--policies", nargs="+", choices=sorted(POLICIES), default=["lingbot_va", "fast_wam"])
    p.add_argument("--chunks", type=int, default=4, help="whole chunks per episode; 2..N are timed (default 4)")
    p.add_argument("--episodes", type=int, default=3, help="timed episodes after one untimed (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                   help="recipe overrides, as python -m zoo.export takes them (with one policy), e.g. "
                        "'unit.methods=[prompt_kv,vae_encode_first,vae_encode,video_step,action_step]'")
    p.add_argument("--layers", type=int, default=None, metavar="N",
                   help="the policy's real width at N blocks per transformer (zoo.bench.seeded.depth_overrides): "
                        "several lowerings take less time than one at full depth; not the policy's real latency")
    p.add_argument("--only", choices=("lower", "bench", "check"), default=None,
                   help="lower: build, export and lower only; bench: time an already-lowered run only; check: "
                        "the policy check of an already-lowered run only")
    p.add_argument("--policy-check", action="store_true",
                   help="after the timing, zoo's policy check of the run (bf16 rule for a bf16 unit)")
    p.add_argument("--backend", choices=BACKENDS, default="artifact",
                   help="the runner's backend (executorch: ExecuTorch's runtime, $ZOO_ET_RUNNER; executorch-inprocess: "
                        "the same runtime in this process, alone: no other candidate may run torch's AOTI runner; "
                        "eager: the rewritten programs, for a CPU check of this script)")
    p.add_argument("--executorch", action="store_true",
                   help="also time the runner on ExecuTorch's runtime ($ZOO_ET_RUNNER), side by side")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="also time the runner on the artifact with each method replayed as a CUDA graph "
                        "(zoo.runner.load(..., cuda_graphs=True)), side by side")
    p.add_argument("--pytorch", action="store_true",
                   help="also time the strongest PyTorch: the rewritten steps compiled whole, CUDA graphs, state in "
                        "place (zoo.bench.graphed), driven by the same host loop")
    p.add_argument("--no-roofline", dest="roofline", action="store_false",
                   help="skip the call-by-call episode that gives each method's and chunk's floor")
    p.add_argument("--no-compile", action="store_true", help="skip the LeRobot torch.compile candidate")
    p.add_argument("--tiny", action="store_true", help="the tiny recipes instead (checks this script)")
    p.add_argument("--seeded", action="store_true",
                   help="with --tiny: the weights the real-size run uses (a placeholder checkpoint with no weights, "
                        "seeded random weights, Hub stand-ins), so a CPU run checks that path")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--record", nargs="?", type=Path, const=chunk_latency.MEASURED_JSON, default=None, metavar="JSON",
                   help="after the timing, store each timed policy's numbers per recipe (default: zoo's own table, "
                        "zoo/data/chunk_latency.json, which model cards quote: only the artifact runner on a GPU "
                        "at real size goes there)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.chunks < 3:
        raise SystemExit("--chunks must be >= 3: chunks 2..N are timed and the first two set the chunk length")
    # The table is per recipe: a quantized variant's timing would stand in for the recipe's own on its card.
    quantized = any(item.split("=", 1)[0].strip().startswith("unit.quantize") for item in args.set)
    if (args.record is not None and args.record.resolve() == chunk_latency.MEASURED_JSON
            and (args.tiny or args.layers or quantized or args.backend != "artifact"
                 or torch.device(args.device).type != "cuda")):
        raise SystemExit(f"--record into {chunk_latency.MEASURED_JSON} takes only the artifact runner on a GPU at "
                         "real size, unquantized (model cards quote it); give --record another file for this run")
    out = args.out.expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    measured_rates = None
    if args.roofline and args.only not in ("lower", "check"):
        say(f"the device's copy bandwidth and GEMM rate, for the roofline ({args.device})")
        args.rates, measured_rates = roofline.measure_rates(
            args.device, *((1 << 30, 8192) if torch.device(args.device).type == "cuda" else (1 << 26, 512)))
    command = "python benchmarks/bench_chunk.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    results: Dict[str, Any] = {"command": command, "environment": bench.environment(args.device),
                               "settings": {"chunks": args.chunks, "episodes": args.episodes, "seed": args.seed,
                                            "backend": args.backend, "tiny": args.tiny, "seeded": args.seeded,
                                            "only": args.only, "layers": args.layers,
                                            "policy_check": args.policy_check or args.only == "check"},
                               "targets": TARGETS, "policies": []}
    if measured_rates:
        results["rates"] = {**dataclasses.asdict(args.rates), **measured_rates}
    for family in args.policies:
        bench_policy(family, args, out, results)
        write(results, out)
    if args.only != "check":
        print(format_table(table_rows(results)))
        for line in ratio_lines(results):
            print(line)
        if results.get("rates"):
            print(format_table(floor_rows(results)))
            if split_rows(results):
                print(format_table(split_rows(results)))
        if args.record is not None:
            record_timings(results, args, command)
    for line in policy_check_section(results):
        print(line)
    failed = [r["policy"] for r in results["policies"] if not check_passed(r)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
