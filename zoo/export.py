"""``python -m zoo.export RECIPE [key=value ...] [--output-dir DIR]``: run the export pipeline for a recipe.

On a machine without a CUDA device this exports, rewrites and checks the programs against eager on the CPU,
saves them with everything a deploy side needs, and says that lowering, audit and verification were skipped
and how to run them later (``python -m zoo.lower RUN_DIR`` on a GPU machine).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from .cli import guarded
from .pipeline import run_pipeline
from .progress import setup_logging
from .publishing import publish_run
from .recipes import load_recipe
from .report import RunReport
from .verify_backends import add_runtime_arguments, runner_from_arguments, runtime_overrides

DEFAULT_RUNS = Path("runs")


def build_parser(prog: str = "python -m zoo.export") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Export a recipe's policy: pull, export, rewrite, check on the CPU, "
                               "then lower, audit and verify on a CUDA GPU when there is one.")
    parser.add_argument("recipe", help="recipe name (`python -m zoo list`) or path to a recipe YAML file")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="omegaconf dotted overrides, e.g. unit.dtype=bfloat16 verify.seeds=[0,1]")
    parser.add_argument("--output-dir", type=Path, default=None,
                        help=f"run folder (default: {DEFAULT_RUNS}/<recipe name>); an earlier run there is replaced")
    parser.add_argument("--push-to-hub", metavar="ORG/NAME", default=None,
                        help="publish the run to this Hub repo once it has verified (refused otherwise)")
    add_runtime_arguments(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging and tracebacks")
    return parser


def main(argv: Optional[Sequence[str]] = None, prog: str = "python -m zoo.export") -> int:
    args = build_parser(prog).parse_intermixed_args(argv)
    setup_logging(args.verbose)
    return guarded(lambda: _export(args), args.verbose)


def _export(args: argparse.Namespace) -> int:
    overrides = list(args.overrides) + runtime_overrides(args)
    recipe = load_recipe(args.recipe, overrides)
    run_dir = args.output_dir if args.output_dir is not None else DEFAULT_RUNS / recipe.name
    try:
        with runner_from_arguments(args):
            report = run_pipeline(recipe, run_dir, overrides)
    except BaseException as exc:
        report = getattr(exc, "zoo_report", None)
        if report is not None:
            print_summary(report)
        raise
    print_summary(report)
    if args.push_to_hub:
        # publish_run refuses (non-zero exit) a run that did not verify, e.g. one made without a GPU.
        plan = publish_run(run_dir, args.push_to_hub)
        print(plan.describe())
    return 0


def print_summary(report: RunReport, out=None) -> None:
    """The stage table, where the run is, and what was skipped and how to do it later."""
    out = out or sys.stdout
    status = report.get("status", "?")
    print("", file=out)
    print(report.summary_table(), file=out)
    print("", file=out)
    print(f"run folder: {report.run_dir}  ({status})", file=out)
    skipped = report.get("skipped")
    if skipped and status == "done":
        print(f"skipped: {', '.join(skipped['stages'])}: they need a CUDA GPU and this machine has none. "
              f"To run them later on a GPU machine: {skipped['later']}", file=out)
    out.flush()


if __name__ == "__main__":
    sys.exit(main())
