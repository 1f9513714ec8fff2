"""``python -m zoo bench RUN_DIR``: how fast the artifact runs, against eager PyTorch and torch.compile.

Reads the run folder and puts ``zoo.bench``'s modules together: for each method (and each size of its dynamic
dims asked for), the artifact, eager and torch.compile on the same pre-drawn inputs. What is measured and how:
docs/benchmarks.md, "What is measured".
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import torch

from zoo.core.errors import EXIT_ERROR, EXIT_OK, NoGpuError, ZooError, exit_status_help
from zoo.contract.artifact import so_file_name, weights_file_name
from zoo.contract.io_spec import IoSpec
from zoo.contract.run_folder import IO_SPEC_JSON, RunFolder
from zoo.bench.candidates import (
    bench_method,
    carried_state_cost,
    error_line,
    input_specs,
    parse_sizes,
    run_folder_candidates,
    size_cases,
)
from zoo.bench.measuring import environment, timer_for
from zoo.bench.rendering import BENCH_JSON, BENCH_MD, FORMAT, TARGETS, render, write_results
from zoo.bench.rotary import DEFAULT_CASES, parse_case, run_rotary


# ------------------------------------------------------------------------------------------------------
# What the run folder already knows: its io spec, name, stage times and artifact sizes


def load_io_spec(run_dir: Path) -> IoSpec:
    path = RunFolder(run_dir).io_spec_file
    if not Path(run_dir).is_dir():
        raise ZooError(f"run folder {run_dir} does not exist", "pass the folder `python -m zoo export` wrote")
    if not path.is_file():
        raise ZooError(f"{run_dir} has no {IO_SPEC_JSON}, so it is not a zoo run folder (or its export failed)",
                       "pass the folder `python -m zoo export RECIPE` wrote; report.md there says what failed")
    return RunFolder(run_dir).read_io_spec()


def run_name(run_dir: Path) -> str:
    with contextlib.suppress(Exception):  # the name is a label only; the folder name stands in
        recipe = RunFolder(run_dir).recipe_dict()
        if recipe is not None:
            return str(recipe.get("name") or Path(run_dir).name)
    return Path(run_dir).resolve().name


COST_STAGES = ("export", "rewrite", "cpu_check", "lower", "audit", "verify")


def export_cost(run_dir: Path) -> Dict[str, Optional[float]]:
    """Seconds per pipeline stage, from report.json (None for a stage that did not run)."""
    run = RunFolder(run_dir)
    if not run.is_run():
        return {}
    try:
        stages = run.read_report().get("stages") or []
    except ValueError:
        return {}
    found = {s.get("stage"): s.get("seconds") for s in stages if s.get("status") == "done"}
    return {stage: found.get(stage) for stage in COST_STAGES}


def artifact_sizes(run_dir: Path) -> Dict[str, int]:
    run = RunFolder(run_dir)
    files = [run.pte, run.ptd] + sorted(run.so_dir.glob(so_file_name("*"))) \
        + sorted(run.so_dir.glob(weights_file_name("*")))
    return {str(p.relative_to(run.path)): p.stat().st_size for p in files if p.is_file()}


# ------------------------------------------------------------------------------------------------------
# Command line


def build_parser(prog: str = "python -m zoo bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=exit_status_help([EXIT_OK, EXIT_ERROR], {
            EXIT_OK: "measured; the tables are printed and written beside the run (a candidate that failed is "
                     "reported in them)",
            EXIT_ERROR: "bad arguments, or a run folder that cannot be benchmarked here"}))
    p.add_argument("run_dir", type=Path, help="a run folder written by `python -m zoo export` (lowered on a GPU)")
    p.add_argument("--methods", default=None, help="comma-separated methods (default: all in io_spec.json)")
    p.add_argument("--sizes", action="append", default=[], metavar="DIM=N[,N...]",
                   help="dynamic sizes to bench at, e.g. seq=128,512,2048 (default: the export's example sizes)")
    p.add_argument("--runs", type=int, default=50, help="timed calls per candidate and size (default 50)")
    p.add_argument("--warmup", type=int, default=10, help="untimed calls first (default 10)")
    p.add_argument("--input-sets", type=int, default=None,
                   help="distinct input sets to rotate through (default: enough to exceed twice the L2 cache)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile candidate")
    p.add_argument("--compile-program", choices=("exported", "rewritten"), default="exported",
                   help="which saved program torch.compile gets (default: exported, what a user would compile)")
    p.add_argument("--compile-dynamic", choices=("auto", "true", "false"), default="auto",
                   help="torch.compile's dynamic= (auto: true when the unit has dynamic dims, as the artifact "
                        "is compiled once for the whole range; otherwise torch's default)")
    p.add_argument("--rotary", action="store_true", help="also run the rotary-only microbenchmark")
    p.add_argument("--profile", nargs="?", type=int, const=6, default=0, metavar="TOP",
                   help="also list each candidate's device time by kind of kernel and its TOP kernels (default 6; "
                        "CUDA profiler, after timing)")
    p.add_argument("--rotary-shape", action="append", default=[], metavar="B,L,H,D",
                   help="rotary case shape (repeatable; default: SmolLM2 at seq 2048 and a 16k-token 24x128 case)")
    p.add_argument("--device", default=None,
                   help="cuda (default) or cpu; cpu checks the harness only: the artifact needs CUDA")
    p.add_argument("--json", type=Path, default=None, help=f"where to write JSON (default RUN_DIR/{BENCH_JSON})")
    p.add_argument("--markdown", type=Path, default=None, help=f"where to write Markdown (default RUN_DIR/{BENCH_MD})")
    return p


def resolve_device(requested: Optional[str]) -> str:
    if requested in (None, "cuda") or (requested or "").startswith("cuda"):
        if not torch.cuda.is_available():
            raise NoGpuError("`python -m zoo bench` times the artifact on a CUDA GPU, and none is visible here",
                             "run it on the GPU machine the run was lowered on; --device cpu only checks the "
                             "harness (eager and torch.compile, no artifact)")
        return requested or "cuda"
    if requested != "cpu":
        raise ZooError(f"--device {requested!r} is not a device zoo benches on", "use cuda or cpu")
    return "cpu"


def check_counts(runs: int, warmup: int, input_sets: Optional[int]) -> None:
    if runs < 1:
        raise ZooError(f"--runs {runs}: at least one timed run is needed", "use e.g. --runs 50")
    if warmup < 0:
        raise ZooError(f"--warmup {warmup} is negative", "use 0 or more warm-up calls (default 10)")
    if input_sets is not None and input_sets < 1:
        raise ZooError(f"--input-sets {input_sets}: at least one input set is needed",
                       "leave it out to use enough sets to exceed the L2 cache")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    check_counts(args.runs, args.warmup, args.input_sets)
    run_dir = Path(args.run_dir).expanduser()
    io_spec = load_io_spec(run_dir)
    device = resolve_device(args.device)
    methods = args.methods.split(",") if args.methods else list(io_spec.methods)
    for m in methods:
        input_specs(io_spec, m)  # unknown names fail before anything is timed
    cases = size_cases(io_spec, parse_sizes(args.sizes))
    dynamic = {"auto": True if io_spec.dynamic else None, "true": True, "false": False}[args.compile_dynamic]

    result: Dict[str, Any] = {
        "format": FORMAT, "name": run_name(run_dir), "run_dir": str(run_dir), "environment": environment(device),
        "settings": {"runs": args.runs, "warmup": args.warmup, "input_sets": args.input_sets or "auto",
                     "timer": timer_for(device).name, "compile_program": args.compile_program,
                     "compile_dynamic": dynamic},
        "targets": asdict(TARGETS), "methods": [],
        "export_cost": export_cost(run_dir), "artifact_sizes": artifact_sizes(run_dir),
    }
    for m in methods:
        print(f"[zoo] bench {m} at {len(cases)} size(s) ...", file=sys.stderr, flush=True)
        candidates = run_folder_candidates(run_dir, m, device, args.compile_program, dynamic, not args.no_compile)
        specs = input_specs(io_spec, m)
        timed = bench_method(m, specs, cases, candidates, args.warmup, args.runs, device, args.input_sets,
                             profile=args.profile)
        result["methods"] += timed
        carried = carried_state_cost(m, specs, io_spec.methods[m].outputs, timed, args.warmup,
                                     args.runs, device, args.input_sets)
        if carried:
            result.setdefault("carried_state", []).extend(carried)
    if args.rotary or args.rotary_shape:
        cases_r = [parse_case(text) for text in args.rotary_shape] or list(DEFAULT_CASES)
        # The method timings above stand on their own: a rotary failure is recorded, not allowed to lose them.
        write_results(result, args.json or run_dir / BENCH_JSON, args.markdown or run_dir / BENCH_MD)
        try:
            result.update(run_rotary(device, runs=args.runs, warmup=args.warmup, cases=cases_r,
                                     compile=not args.no_compile))
        except Exception as exc:  # noqa: BLE001 - reported in the results and on stderr
            result["rotary_error"] = error_line(exc)
            print(f"[zoo] rotary benchmark failed: {result['rotary_error']}", file=sys.stderr)
    write_results(result, args.json or run_dir / BENCH_JSON, args.markdown or run_dir / BENCH_MD)
    print(render(result, markdown=False))
    return 0
