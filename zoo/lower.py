"""``python -m zoo.lower RUN_DIR [KEY=VALUE ...]``: lower, audit and verify a saved run on this machine.

It needs no lerobot: everything comes from the run folder the export step wrote (recipe.yaml, io_spec.json,
rewritten.<method>.pt2 to lower, exported.<method>.pt2 as the eager reference, reference_fp32.<method>.pt2 for
bf16). Steps, each recorded into the run's report.json / report.md:
  preflight  fallback kernels the programs need vs the target runtime (CPU; refuses before the compile)
  lower      model.pte + aoti_cuda_blob.ptd, so/<method>.so + weights blob + io.json (needs a GPU)
  audit      which ExecuTorch CUDA runtime releases can load each method's .so
  verify     the .so files against eager at every seed and size (needs a GPU)
Exit status: 0 verified; 2 the run cannot be lowered here (no GPU, refused kernels, a broken run folder);
3 the artifact does not match eager.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Dict, Optional, Sequence

import torch
from torch.export import ExportedProgram

from .errors import LoweringError, NoGpuError, VerificationFailed, ZooError
from .progress import say, setup_logging
from .report import RunReport


def load_programs(run_dir: Path, methods: Sequence[str], kind: str = "rewritten") -> Dict[str, ExportedProgram]:
    programs = {}
    for method in methods:
        path = Path(run_dir) / f"{kind}.{method}.pt2"
        if not path.exists():
            raise LoweringError(f"{path} is missing: nothing to lower for method {method!r}",
                                "export the recipe first (`python -m zoo.export RECIPE`); it saves the programs")
        programs[method] = torch.export.load(str(path))
    return programs


def load_run_recipe(run_dir: Path, overrides: Sequence[str] = ()):
    """The resolved recipe a run folder holds (``recipe.yaml``), with ``overrides`` applied."""
    from .recipes import load_recipe

    path = Path(run_dir) / "recipe.yaml"
    if not path.exists():
        raise LoweringError(f"{path} is missing", "export the recipe again (`python -m zoo.export RECIPE`)")
    return load_recipe(str(path), overrides, check_name=False)


def _record(report: RunReport, stage: str, status: str, start: float, detail: str = "") -> None:
    report.stage(stage, status, round(time.perf_counter() - start, 3), detail)
    say(f"{stage}: {status}{' - ' + detail if detail else ''}")


def lower_run(run_dir: Path, overrides: Sequence[str] = (), *, verify: bool = True, lower: bool = True,
              runner_factory=None) -> RunReport:
    """Preflight, lower, audit and verify ``run_dir``; every outcome is written to its report before returning
    or raising."""
    from . import audit as audit_mod
    from . import lowering, preflight
    from . import verify as verify_mod
    run_dir = Path(run_dir)
    if not (run_dir / "recipe.yaml").exists():
        raise LoweringError(f"{run_dir} is not a zoo run folder (no recipe.yaml)",
                            "pass the folder `python -m zoo.export RECIPE` wrote")
    recipe = load_run_recipe(run_dir, overrides)
    report = RunReport.load(run_dir)
    if report.get("recipe") is None:
        report.record("recipe", recipe.to_dict())
    try:
        if lower:
            programs = load_programs(run_dir, recipe.unit.methods)
            start = time.perf_counter()
            try:
                result = preflight.require_kernels(programs, recipe.lowering.runtime,
                                                   triton_kernel_mode=recipe.lowering.triton_kernel_mode)
            except LoweringError:
                _record(report, "preflight", "failed", start, "kernels the target runtime cannot run")
                raise
            report.record("preflight", result.as_dict())
            _record(report, "preflight", "done", start, f"{result.nodes} ops, {len(result.needs)} fallback kernels")

            start = time.perf_counter()
            try:
                lowered = lowering.lower_to_pte(programs, run_dir, recipe, run_preflight=False)
            except NoGpuError as exc:
                for stage in ("lower", "audit", "verify"):
                    report.stage(stage, "skipped", None, exc.message)
                raise
            except BaseException as exc:
                _record(report, "lower", "failed", start, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                raise
            report.record("lowering", lowered.summary())
            _record(report, "lower", "done", start,
                    f"model.pte {lowered.pte_bytes} B, {lowering.PTD_NAME} {lowered.ptd_bytes} B")
            print(lowered.table())

        start = time.perf_counter()
        audited = audit_mod.audit_artifact(run_dir)
        report.record("audit", audited.summary())
        target = recipe.lowering.runtime
        loads = audited.loadable(target) if target in audited.releases else False
        _record(report, "audit", "done", start,
                f"loadable on {', '.join(audited.loadable_releases()) or 'no release'}"
                + ("" if loads else f"; NOT on the target runtime {target}"))
        print(audited.table())

        if verify:
            start = time.perf_counter()
            try:
                verified = verify_mod.verify_artifact(run_dir, recipe, runner_factory=runner_factory)
            except VerificationFailed as exc:
                result = getattr(exc, "result", None)
                if result is not None:
                    report.record("verification", result.summary())
                    print(result.table())
                detail = f"{len(result.failures())} outputs out of tolerance" if result is not None else exc.message
                _record(report, "verify", "failed", start, detail)
                raise
            except NoGpuError as exc:
                report.stage("verify", "skipped", None, exc.message)
                raise
            report.record("verification", verified.summary())
            _record(report, "verify", "done", start, f"{len(verified.rows)} outputs within tolerance")
            print(verified.table())
        report.record("status", "verified" if verify else "lowered")
        if verify:
            # Only a verified artifact gets a manifest, and publishing refuses a run without one.
            from .manifest import write_manifest

            report.write()
            write_manifest(run_dir, report)
    except BaseException as exc:
        report.record("status", "failed")
        report.record("error", {"type": type(exc).__name__, "message": getattr(exc, "message", str(exc)),
                                "hint": getattr(exc, "hint", None)})
        raise
    finally:
        report.write()
    return report


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zoo.lower", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run folder written by `python -m zoo.export`")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, e.g. lowering.max_mm_configs=4")
    parser.add_argument("--no-verify", action="store_true", help="lower and audit only")
    parser.add_argument("--verify-only", action="store_true", help="audit and verify the artifact already there")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    try:
        report = lower_run(args.run_dir, args.overrides, verify=not args.no_verify, lower=not args.verify_only)
    except ZooError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(report.summary_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
