"""``python -m zoo lower RUN_DIR [KEY=VALUE ...]``: lower, audit and verify a saved run on this machine.

It needs no lerobot: everything comes from the run folder the export wrote. The steps are ``zoo.export.stages``'s
(preflight, lower, audit, verify); the new artifact is staged beside the run and put in place only once it passed
at least the stages the run had passed (README, "Lower, audit and verify on a GPU").
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

from zoo.cli import common as cli
from zoo.core.errors import Interrupted, ZooError
from zoo.export.pipeline import lower_run
from zoo.core.progress import setup_logging
from zoo.export.verify_runtimes import add_runtime_arguments, runner_from_arguments, runtime_overrides
from zoo.contract.gpu_targets import GPUS


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = cli.parser(
        "python -m zoo lower", __doc__.split("\n")[0].split(": ", 1)[1],
        [cli.EXIT_OK, cli.EXIT_ERROR, cli.EXIT_MISMATCH, cli.EXIT_KEPT_ASIDE, cli.EXIT_INTERRUPTED],
        {cli.EXIT_OK: "the run holds the new artifact: verified (lowered and audited with --no-verify)",
         cli.EXIT_ERROR: "the run cannot be lowered here (no GPU, refused kernels, a damaged or missing file in "
                         "the run folder, no zoo_runner for --runtime executorch, disk full): the message says "
                         "which; the run is unchanged",
         cli.EXIT_MISMATCH: "the artifact does not compute what eager PyTorch computes, or ExecuTorch's runtime "
                            "failed to load or run it where the audit said it can"})
    parser.add_argument("run_dir", type=Path, help="a run folder written by `python -m zoo.export`")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, e.g. lowering.max_mm_configs=4")
    parser.add_argument("--target", metavar="GPU", choices=list(GPUS),
                        help="the GPU the artifact is for (default: this one): " + ", ".join(GPUS) + ". A GPU "
                             "older than this one and below compute capability 9.0 (a100, a10g, l4 on an H200) is "
                             "lowered here as its SASS + PTX and verified here through the driver's JIT; a Jetson "
                             "(orin, thor) is lowered on the Jetson itself (README, 'GPU targets and Jetson')")
    parser.add_argument("--no-verify", action="store_true", help="lower and audit only")
    parser.add_argument("--verify-only", action="store_true", help="audit and verify the artifact already there")
    add_runtime_arguments(parser)
    parser.add_argument("--force", action="store_true",
                        help="put the attempt in place even when the run had passed stages it did not (e.g. "
                             "--no-verify over a verified run); a failed attempt never replaces a good run")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="debug logging, tracebacks, and dependency warnings on the terminal too")
    args = parser.parse_args(argv)
    setup_logging(args.verbose)

    def command() -> int:
        try:
            with runner_from_arguments(args):
                target = [f"lowering.target={args.target}"] if args.target else []
                report = lower_run(args.run_dir, list(args.overrides) + runtime_overrides(args) + target,
                                   verify=not args.no_verify, lower=not args.verify_only, force=args.force,
                                   verbose=args.verbose)
        except BaseException as exc:
            failed = getattr(exc, "report", None) if isinstance(exc, (ZooError, Interrupted)) else None
            if failed is not None:  # the stage table of the attempt, then the error (cli.guarded)
                cli.print_summary(failed, headline=False)
            raise
        cli.print_summary(report)
        placement = report.get("placement") or {}
        if not placement.get("placed", True):
            return cli.EXIT_KEPT_ASIDE
        return cli.EXIT_OK

    return cli.guarded(command, args.verbose)


if __name__ == "__main__":
    sys.exit(main())
