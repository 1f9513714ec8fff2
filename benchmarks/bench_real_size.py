#!/usr/bin/env python3
"""Real-size benchmarks with seeded random weights, no network: export -> rewrite -> lower -> verify -> bench.

    python benchmarks/bench_real_size.py --out OUT [--units llama:128,512,2048 lingbot_va fast_wam] [--runs N]

Units: ``NAME[:ARG]`` with NAME llama, lingbot_va or fast_wam (``zoo.bench.seeded`` says what each builds);
the weights, OUT's layout and the tables: benchmarks/README.md, "bench_real_size.py".
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import shlex
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from zoo import bench
from zoo.bench.seeded import UnitSpec, build_unit, parse_unit, selected_methods, unit_candidates, unit_recipe
from zoo.contract.io_spec import DynamicDim, IoSpec
from zoo.contract.run_folder import RunFolder
from zoo.core.report import RunReport, timed_stage
from zoo.export import pipeline
from zoo.export import stages as gpu_steps
from zoo.export import trace as exporting

SAVE_PROGRAMS_MAX_BYTES = 1 << 30  # above this, .pt2 copies of the weights cost more disk than they are worth


# ------------------------------------------------------------------------------------------------------
# One unit, end to end


def run_unit(spec: UnitSpec, args, out_dir: Path, results: Dict[str, Any]) -> None:
    """One unit through the pipeline's own steps (build, export, rewrite, save, preflight, lower, verify), each
    recorded into the unit's run report by the pipeline's stage recorder, then timed. A failure ends the unit,
    not the run; the unit's record mirrors the report's stages for the bench table."""
    recipe = unit_recipe(spec, args.tiny)
    unit_name = spec.name if not args.tiny else f"{spec.name} (tiny)"
    run = RunFolder(out_dir / spec.name)
    run.path.mkdir(parents=True, exist_ok=True)
    record: Dict[str, Any] = {"unit": unit_name, "recipe": recipe.name, "dtype": recipe.unit.dtype, "stages": {}}
    results["units"].append(record)
    report = RunReport(run.path, recipe.to_dict())
    run.write_recipe(recipe)
    try:
        sizes = exporting.example_sizes(recipe)
        # Sizes outside the recipe's dynamic range fail here, before minutes of building and lowering.
        planned = IoSpec(dtype=recipe.unit.dtype, methods={}, example_sizes=sizes,
                         dynamic={d: DynamicDim(min=r.min, max=r.max) for d, r in recipe.dynamic.items()})
        cases = bench.size_cases(planned, {"seq": spec.sizes} if spec.sizes else {})
        methods = spec.methods or list(recipe.unit.methods)
        record["methods"] = methods
        # The steps see the selected methods only: the recipe (for export, io_spec.json, verification) and the
        # unit (built from the whole recipe, since a family builds the methods its recipe names).
        selected = dataclasses.replace(recipe, unit=dataclasses.replace(recipe.unit, methods=list(methods)))
        with tempfile.TemporaryDirectory(prefix="zoo-bench-build-") as work:
            unit = pipeline.build_step(None, selected, run, report,
                                       build=lambda: selected_methods(build_unit(spec, recipe, Path(work)), methods))
        params = sum(p.numel() * p.element_size() for p in torch.nn.ModuleList(
            [m.module for m in unit.methods.values()]).parameters())
        record["weights_gib"] = round(params / 2**30, 2)
        save = params <= SAVE_PROGRAMS_MAX_BYTES
        export_lower_verify(unit, selected, run, report, args, save)
        record["artifact_sizes"] = bench.artifact_sizes(run.path)
        time_unit(unit, unit_name, recipe, methods, cases, run, report, args, results)
        record["status"] = "done"
        if not save and not args.keep_artifacts:
            drop_large_weights(run, methods, record)
    except Exception as exc:  # one unit failing (out of memory, a lowering refusal) must not lose the others
        record["status"] = "failed"
        record["error"] = bench.error_line(exc)
        record["traceback"] = traceback.format_exc(limit=8)
        say(f"{unit_name} failed: {bench.error_line(exc)}")
    finally:
        record["stages"] = {s["stage"]: {"status": s["status"], "seconds": s["seconds"], "detail": s["detail"]}
                            for s in report.stages}
        report.record("status", record.get("status", "failed"))
        run.write_report(report)


def export_lower_verify(unit, selected, run: RunFolder, report: RunReport, args, save: bool) -> None:
    """Export, rewrite (and save the programs where ``save``: they are what verification compares with), then
    on a GPU lower and verify; each step a stage of ``report``."""
    verify = save and not args.no_verify  # verification compares with the saved programs
    programs, _ = pipeline.export_step(unit, selected, run, report, save=save, reference=verify)
    rewritten = pipeline.rewrite_step(programs, selected, report)
    if save:
        pipeline.save_step(rewritten, selected, run, report)
    del programs
    gc.collect()
    if torch.device(args.device).type != "cuda":
        for name in ("lower", "verify"):
            report.stage(name, "skipped", None, "needs a CUDA GPU")
        return
    # lower_step runs the kernel preflight on each method's own edge program: no second to_edge here.
    gpu_steps.lower_step(rewritten, run, selected, report)
    del rewritten
    gc.collect()
    if args.no_verify:
        report.stage("verify", "skipped", None, "--no-verify")
    elif not save:
        report.stage("verify", "skipped", None, "programs not saved at this size; the bench table's "
                                                "artifact-vs-eager agreement on the timed inputs stands in")
    else:
        try:
            gpu_steps.verify_step(run, selected, report)
        except Exception:  # recorded by the stage; the bench still runs and shows how far off it is
            pass


def time_unit(unit, unit_name: str, recipe, methods: List[str], cases, run: RunFolder, report: RunReport, args,
              results: Dict[str, Any]) -> None:
    """Each method timed at every size against its candidates, and the cost of the state it hands back, into
    ``results`` (and the report's ``bench`` record), under the report's bench stage."""
    dynamic = True if recipe.dynamic else None  # the artifact covers the range with one compile; so does this
    with timed_stage(report, "bench", f"{unit_name}: bench") as facts:
        for m in methods:
            cands = unit_candidates(unit, m, run.path, args.device, not args.no_compile, dynamic)
            specs = unit.methods[m].inputs
            timed = bench.bench_method(m, specs, cases, cands, args.warmup, args.runs, args.device,
                                       args.input_sets, profile=args.profile)
            for r in timed:
                r["unit"] = unit_name
                results["methods"].append(r)
                report.record("bench", [x for x in results["methods"] if x.get("unit") == unit_name])
            # The io KV pool: what handing it back costs per call.
            for r in bench.carried_state_cost(m, specs, unit.methods[m].output_names, timed, args.warmup,
                                              args.runs, args.device, args.input_sets):
                r["unit"] = unit_name
                results.setdefault("carried_state", []).append(r)
        facts["detail"] = f"{len(cases)} size(s) x {len(methods)} method(s)"


def drop_large_weights(run: RunFolder, methods: List[str], record: Dict[str, Any]) -> None:
    """Remove the weights files of a large unit once it is measured (their sizes stay in the record): two
    real-size units' .ptd plus extracted blobs would not fit on a 64 GB disk together."""
    for path in [run.ptd] + [run.weights_file(m) for m in methods]:
        if path.is_file():
            path.unlink()
            record.setdefault("removed_after_bench", []).append(str(path.relative_to(run.path)))


# ------------------------------------------------------------------------------------------------------
# Command line


def say(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benchmarks/bench_real_size.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:3]))
    p.add_argument("--out", type=Path, required=True, help="output folder (one sub-folder per unit)")
    p.add_argument("--units", nargs="+", default=["llama:128,512,2048", "lingbot_va", "fast_wam"],
                   help="units to run, in order (default: llama:128,512,2048 lingbot_va fast_wam)")
    p.add_argument("--runs", type=int, default=30, help="timed calls per candidate and size (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls first (default 5)")
    p.add_argument("--input-sets", type=int, default=None, help="input sets to rotate through (default: auto)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile candidate (saves its compile)")
    p.add_argument("--no-rotary", action="store_true", help="skip the rotary microbenchmark")
    p.add_argument("--profile", nargs="?", type=int, const=6, default=0, metavar="TOP",
                   help="also list each candidate's device time by kind of kernel and its TOP kernels (default 6; "
                        "CUDA profiler, after timing)")
    p.add_argument("--no-verify", action="store_true", help="skip zoo's verification (the bench still compares "
                                                            "the artifact's outputs with eager's)")
    p.add_argument("--keep-artifacts", action="store_true",
                   help="keep the weights files of units over 1 GiB (default: removed once measured, sizes kept)")
    p.add_argument("--tiny", action="store_true", help="the tiny recipes instead (checks this script on a CPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda (default where present) or cpu (no lowering; eager only)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    bench.check_counts(args.runs, args.warmup, args.input_sets)
    specs = [parse_unit(u) for u in args.units]
    device = bench.resolve_device(args.device)
    out_dir = args.out.expanduser().resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/bench_real_size.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    results: Dict[str, Any] = {
        "format": bench.FORMAT, "name": "real size, seeded random weights" + (" (tiny recipes)" if args.tiny else ""),
        "command": command, "environment": bench.environment(device),
        "settings": {"runs": args.runs, "warmup": args.warmup, "input_sets": args.input_sets or "auto",
                     "timer": bench.timer_for(device).name},
        "targets": asdict(bench.TARGETS), "units": [], "methods": [],
    }

    def flush() -> None:
        bench.write_results(results, out_dir / bench.BENCH_JSON, out_dir / bench.BENCH_MD)

    if not args.no_rotary:
        say("rotary microbenchmark ...")
        from zoo.bench.rotary import run_rotary

        try:
            results.update(run_rotary(device, runs=args.runs, warmup=args.warmup, compile=not args.no_compile,
                                      copy_bytes=(1 << 30) if device != "cpu" else (64 << 20)))
        except Exception as exc:  # the rotary numbers are one section; the units still run
            results["rotary_error"] = bench.error_line(exc)
            say(f"rotary failed: {bench.error_line(exc)}")
        flush()
    for spec in specs:
        run_unit(spec, argparse.Namespace(**{**vars(args), "device": device}), out_dir, results)
        flush()
    print(bench.render(results, markdown=False))
    failed = [u["unit"] for u in results["units"] if u.get("status") != "done"]
    if failed:
        say(f"failed: {', '.join(failed)} (see bench.json: error and traceback per unit)")
    return 1 if failed else 0


if __name__ == "__main__":
    from zoo.cli.common import guarded

    sys.exit(guarded(main))
