"""``python -m zoo.export RECIPE [key=value ...] [--output-dir DIR]``: run the export pipeline for a recipe.

On a machine without a CUDA device this exports, rewrites and checks the programs against eager on the CPU,
saves them with everything a deploy side needs, and says that lowering, audit and verification were skipped
and how to run them later (``python -m zoo lower RUN_DIR`` on a GPU machine).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from zoo.cli import common as cli
from zoo.core.errors import Interrupted, ZooError
from zoo.core.environ import zoo_command
from zoo.export.pipeline import run_pipeline
from zoo.core.progress import setup_logging
from zoo.export.publish.upload import publish_run
from zoo.contract.recipes import load_recipe
from zoo.export.verify_runtimes import add_runtime_arguments, runner_from_arguments, runtime_overrides

DEFAULT_RUNS = Path("runs")


def build_parser(prog: str = "python -m zoo.export") -> argparse.ArgumentParser:
    parser = cli.parser(
        prog, "Export a recipe's policy: pull, export, rewrite, check on the CPU, then lower, audit and verify "
              "on a CUDA GPU when there is one. An earlier run in the output folder is replaced only by an "
              "attempt that passed at least the stages it had passed; any other attempt is kept in "
              "RUN_DIR/attempts/ and the earlier run stays as it was.",
        [cli.EXIT_OK, cli.EXIT_ERROR, cli.EXIT_MISMATCH, cli.EXIT_KEPT_ASIDE, cli.EXIT_INTERRUPTED],
        {cli.EXIT_OK: "the run is in the output folder (done on a CPU machine, verified on a GPU machine)",
         cli.EXIT_MISMATCH: "the artifact does not compute what eager PyTorch computes, or ExecuTorch's runtime "
                            "failed to load or run it where the audit said it can"})
    parser.add_argument("recipe", help="recipe name (`python -m zoo list`) or path to a recipe YAML file")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="omegaconf dotted overrides, e.g. unit.dtype=bfloat16 verify.seeds=[0,1]")
    parser.add_argument("--output-dir", type=Path, default=None,
                        help=f"run folder (default: {DEFAULT_RUNS}/<recipe name>)")
    parser.add_argument("--force", action="store_true",
                        help="let this run replace an earlier run that had got further (e.g. a verified one) "
                             "once it finishes; a failed or interrupted run never replaces a good one")
    parser.add_argument("--push-to-hub", metavar="ORG/NAME", default=None,
                        help="publish the run to this Hub repo once it has verified (refused otherwise)")
    add_runtime_arguments(parser)
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="debug logging, tracebacks, and dependency warnings on the terminal too")
    return parser


def main(argv: Optional[Sequence[str]] = None, prog: str = "python -m zoo.export") -> int:
    args = build_parser(prog).parse_intermixed_args(argv)
    setup_logging(args.verbose)
    return cli.guarded(lambda: _export(args), args.verbose)


def _export(args: argparse.Namespace) -> int:
    overrides = list(args.overrides) + runtime_overrides(args)
    # Every key and value of the recipe is checked here, before anything is fabricated, downloaded or written.
    recipe = load_recipe(args.recipe, overrides)
    run_dir = args.output_dir if args.output_dir is not None else DEFAULT_RUNS / recipe.name
    command = zoo_command("zoo.export", [args.recipe, *args.overrides, "--output-dir",
                                         str(run_dir.expanduser().resolve())] + runtime_flags(args)
                          + (["--force"] if args.force else []))
    try:
        with runner_from_arguments(args):
            report = run_pipeline(recipe, run_dir, overrides, force=args.force, command=command,
                                  verbose=args.verbose)
    except BaseException as exc:
        report = exc.report if isinstance(exc, (ZooError, Interrupted)) else None
        if report is not None:
            print_summary(report, headline=False)
        raise
    print_summary(report)
    if not (report.get("placement") or {}).get("placed", True):
        return cli.EXIT_KEPT_ASIDE
    if args.push_to_hub:
        # publish_run refuses (non-zero exit) a run that did not verify, e.g. one made without a GPU.
        plan = publish_run(run_dir, args.push_to_hub)
        print(plan.describe())
    return cli.EXIT_OK


print_summary = cli.print_summary


def runtime_flags(args: argparse.Namespace) -> list:
    """``--runtime`` and ``--et-runner`` as given, for the command that runs this export again."""
    flags = ["--runtime", args.runtime] if args.runtime else []
    if args.et_runner:
        flags += ["--et-runner", str(Path(args.et_runner).expanduser().resolve())]
    return flags


if __name__ == "__main__":
    sys.exit(main())
