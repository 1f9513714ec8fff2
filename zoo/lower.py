"""``python -m zoo.lower RUN_DIR [KEY=VALUE ...]``: lower, audit and verify a saved run on this machine.

It needs no lerobot: everything comes from the run folder the export step wrote (recipe.yaml, io_spec.json,
rewritten.<method>.pt2 to lower, exported.<method>.pt2 as the eager reference, reference_fp32.<method>.pt2 for
bf16). Steps (``zoo.gpu_steps``), each recorded into the run's report.json / report.md:
  preflight  fallback kernels the programs need vs the target runtime (CPU; refuses before the compile)
  lower      model.pte + aoti_cuda_blob.ptd, so/<method>.so + weights blob + io.json (needs a GPU)
  audit      which ExecuTorch CUDA runtime releases can load each method's .so
  verify     the shipped artifact against eager at every seed and size (needs a GPU), on torch's AOTI runner
             and ExecuTorch's C++ runtime (--runtime; the runtime from --et-runner or $ZOO_ET_RUNNER)
Exit status: 0 verified; 2 the run cannot be lowered here (no GPU, refused kernels, a broken run folder);
3 the artifact does not match eager (or ExecuTorch's runtime failed to load or run it where the audit said it can).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from .errors import ZooError
from .pipeline import lower_run
from .progress import setup_logging
from .verify_backends import add_runtime_arguments, runner_from_arguments, runtime_overrides


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zoo.lower", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run folder written by `python -m zoo.export`")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, e.g. lowering.max_mm_configs=4")
    parser.add_argument("--no-verify", action="store_true", help="lower and audit only")
    parser.add_argument("--verify-only", action="store_true", help="audit and verify the artifact already there")
    add_runtime_arguments(parser)
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    try:
        with runner_from_arguments(args):
            report = lower_run(args.run_dir, list(args.overrides) + runtime_overrides(args),
                               verify=not args.no_verify, lower=not args.verify_only)
    except ZooError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(report.summary_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
