"""The GPU half of the line, one step each: kernel preflight, lower, audit, verify, and the manifest of a
verified run. Each runs under the one stage recorder (``zoo.report.timed_stage``) and records what it did into
the run report it is handed; ``zoo.pipeline`` strings them together for ``python -m zoo.export`` (right after
the CPU half, in the same process and on the same report) and for ``python -m zoo.lower RUN_DIR`` (on a saved
run folder, later or on another machine). None of them needs lerobot: everything comes from the run folder.

  preflight  fallback kernels the programs need vs the target runtime (CPU; refuses before the compile)
  lower      model.pte + aoti_cuda_blob.ptd, so/<method>.so + weights blob + io.json (needs a GPU)
  audit      which ExecuTorch CUDA runtime releases can load each method's .so
  verify     the .so files against eager at every seed and size (needs a GPU)
  policy check  the artifact runner against LeRobot's own select_action over a chunk sequence (zoo.policy_check;
             needs lerobot, skipped with the reason where it is missing)
A step that needs a GPU the machine lacks is recorded as skipped (``NoGpuError``), and so are the GPU stages
after it.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

from torch.export import ExportedProgram

from . import audit, lowering, preflight
from .artifact import PTD_NAME, PTE_NAME
from .errors import LoweringError, NoGpuError, VerificationFailed, ZooError, first_line
from .manifest import write_manifest
from .policy_check import policy_check_step
from .report import RunReport, timed_stage
from .run_folder import RunFolder
from .verify import RunnerFactory, VerificationResult, verify_artifact

GPU_STAGES = ("lower", "audit", "verify")


def run_gpu_steps(run: RunFolder, recipe, report: RunReport, *, lower: bool = True, verify: bool = True,
                  runner_factory: Optional[RunnerFactory] = None) -> None:
    """Preflight and lower the run folder's rewritten programs (unless ``lower`` is False: the artifact already
    there), audit the artifact and verify it (unless ``verify`` is False). A verified run gets its manifest.
    Failures are recorded as their stage's and raised; recording the run as failed is the caller's."""
    if lower:
        try:
            programs = saved_programs(run, recipe.unit.methods)
        except ZooError as exc:  # a missing or damaged program: the preflight, which reads them first, failed
            report.stage("preflight", "failed", None, first_line(exc, limit=160))
            report.record("failed_stage", "preflight")
            raise
        preflight_step(programs, recipe, report)
        try:
            lower_step(programs, run, recipe, report)
        except NoGpuError as exc:
            for stage in GPU_STAGES[1:]:  # audit and verify have no artifact to work on
                report.stage(stage, "skipped", None, exc.message)
            raise
        del programs
    audit_step(run, recipe, report)
    if verify:
        verify_step(run, recipe, report, runner_factory=runner_factory)
        # The artifact driven as the policy drives its model, against LeRobot's own select_action on the GPU.
        policy_check_step(run, recipe, report, where="gpu")
    else:  # recorded, so that an unverified artifact never counts as one that passed verification
        report.stage("verify", "skipped", None, "not asked for (--no-verify)")
    report.record("status", "verified" if verify else "lowered")
    if verify:
        # Only a verified artifact gets a manifest, and publishing refuses a run without one.
        write_manifest(run, report)


def saved_programs(run: RunFolder, methods: Sequence[str], kind: str = "rewritten") -> Dict[str, ExportedProgram]:
    """The programs the export step saved in the run folder, one per method."""
    programs = {}
    for method in methods:
        path = run.program(kind, method)
        if not path.exists():
            raise LoweringError(f"{path} is missing: nothing to lower for method {method!r}",
                                "export the recipe first (`python -m zoo.export RECIPE`); it saves the programs")
        programs[method] = run.load_program(kind, method)
    return programs


def preflight_step(programs: Dict[str, ExportedProgram], recipe, report: RunReport) -> preflight.PreflightResult:
    target = recipe.lowering.runtime
    with timed_stage(report, "preflight", f"kernel preflight against ExecuTorch CUDA runtime {target}") as facts:
        try:
            result = preflight.require_kernels(programs, target,
                                               triton_kernel_mode=recipe.lowering.triton_kernel_mode)
        except LoweringError:
            facts["failure"] = "kernels the target runtime cannot run"
            raise
        report.record("preflight", result.as_dict())
        facts["detail"] = f"{result.nodes} ops, {len(result.needs)} fallback kernels"
    return result


def lower_step(programs: Dict[str, ExportedProgram], run: RunFolder, recipe,
               report: RunReport) -> lowering.LoweringResult:
    with timed_stage(report, "lower", f"lower to {PTE_NAME} + {PTD_NAME} (ExecuTorch CUDA backend)") as facts:
        lowered = lowering.lower_to_pte(programs, run, recipe, run_preflight=False)
        report.record("lowering", lowered.summary())
        facts["detail"] = f"{PTE_NAME} {lowered.pte_bytes} B, {PTD_NAME} {lowered.ptd_bytes} B"
    print(lowered.table())
    return lowered


def audit_step(run: RunFolder, recipe, report: RunReport) -> audit.AuditResult:
    with timed_stage(report, "audit", "audit the compiled .so against ExecuTorch CUDA runtime releases") as facts:
        audited = audit.audit_artifact(run.path)
        report.record("audit", audited.summary())
        target = recipe.lowering.runtime
        loads = audited.loadable(target) if target in audited.releases else False
        facts["detail"] = (f"loadable on {', '.join(audited.loadable_releases()) or 'no release'}"
                           + ("" if loads else f"; NOT on the target runtime {target}"))
    print(audited.table())
    return audited


def verify_step(run: RunFolder, recipe, report: RunReport, *,
                runner_factory: Optional[RunnerFactory] = None) -> VerificationResult:
    with timed_stage(report, "verify", "verify the shipped .so files against eager on the GPU") as facts:
        try:
            verified = verify_artifact(run, recipe, runner_factory=runner_factory)
        except VerificationFailed as exc:
            result = getattr(exc, "result", None)
            if result is not None:
                report.record("verification", result.summary())
                print(result.table())
            facts["failure"] = (f"{len(result.failures())} outputs out of tolerance" if result is not None
                                else exc.message)
            raise
        report.record("verification", verified.summary())
        facts["detail"] = f"{len(verified.rows)} outputs within tolerance"
    print(verified.table())
    return verified
