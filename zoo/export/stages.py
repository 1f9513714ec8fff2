"""The GPU half of the line, one step each under the stage recorder: kernel preflight, lower, audit, verify, the
GPU policy check and the manifest of a verified run. ``zoo.export.pipeline`` strings them together; none needs
lerobot but the policy check, and a step that needs a GPU the machine lacks is recorded as skipped with the GPU
steps after it (README, "Lower, audit and verify on a GPU").
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Union

import torch
from torch.export import ExportedProgram

from zoo.export import audit
from zoo.export import trace as exporting
from zoo.export.lower import compile_settings, lowering
from zoo.export.lower.outputs import LoweringResult
from zoo.export.lower import preflight
from zoo.contract.artifact import PTD_NAME, PTE_NAME
from zoo.core.errors import KernelPreflightRefused, LoweringError, NoGpuError, VerificationFailed, ZooError, first_line
from zoo.export.publish.manifest import write_manifest
from zoo.policies.base import ExportUnit
from zoo.export.policy_check import policy_check_step
from zoo.export.lower.preflight import PreflightResult
from zoo.core.report import RunReport, timed_stage
from zoo.contract.releases import lowering_features, row_name
from zoo.contract.run_folder import RunFolder
from zoo.export.verify import VerificationResult, verify_artifact
from zoo.runtimes.aoti import RunnerFactory
from zoo.export.verify_runtimes import RuntimeChoice, choose_runtimes

GPU_STAGES = ("lower", "audit", "verify")


def run_gpu_steps(run: RunFolder, recipe, report: RunReport, *, lower: bool = True, verify: bool = True,
                  runner_factory: Optional[RunnerFactory] = None) -> None:
    """Preflight and lower the run folder's rewritten programs (unless ``lower`` is False: the artifact already
    there), audit the artifact and verify it (unless ``verify`` is False). A verified run gets its manifest.
    Failures are recorded as their stage's and raised; recording the run as failed is the caller's."""
    runtimes = choose_runtimes(recipe.verify.runtimes) if verify else None
    if lower:
        files = read_or_fail_preflight(report, lambda: program_files(run, recipe.unit.methods))
        try:
            compile_settings.cuda_device_info()
        except NoGpuError as exc:
            # Nothing lowers here: the kernel preflight still tells now whether the lowering would be refused.
            programs = read_or_fail_preflight(report, lambda: saved_programs(run, recipe.unit.methods))
            preflight_step(programs, recipe, report)
            for stage in GPU_STAGES:
                report.stage(stage, "skipped", None, exc.message)
            raise
        lower_step(files, run, recipe, report)
    audited = audit_step(run, recipe, report)
    if verify:
        verify_step(run, recipe, report, runner_factory=runner_factory, runtimes=runtimes, audited=audited)
        # The artifact driven as the policy drives its model, against LeRobot's own select_action on the GPU.
        policy_check_step(run, recipe, report, where="gpu")
    else:  # recorded, so that an unverified artifact never counts as one that passed verification
        report.stage("verify", "skipped", None, "not asked for (--no-verify)")
    report.record("status", "verified" if verify else "lowered")
    if verify:
        # Only a verified artifact gets a manifest, and publishing refuses a run without one.
        write_manifest(run, report)


def read_or_fail_preflight(report: RunReport, read: Callable[[], Any]) -> Any:
    """``read()`` the saved programs; a missing or damaged one fails the preflight, the first stage to read
    them (recorded, then raised)."""
    try:
        return read()
    except ZooError as exc:
        report.stage("preflight", "failed", None, first_line(exc, limit=160))
        report.record("failed_stage", "preflight")
        raise


def program_files(run: RunFolder, methods: Sequence[str], kind: str = "rewritten") -> Dict[str, Path]:
    """The files of the programs the export step saved in the run folder, one per method."""
    files = {}
    for method in methods:
        path = run.program(kind, method)
        if not path.exists():
            raise LoweringError(f"{path} is missing: nothing to lower for method {method!r}",
                                "export the recipe first (`python -m zoo.export RECIPE`); it saves the programs")
        files[method] = path
    return files


def saved_programs(run: RunFolder, methods: Sequence[str], kind: str = "rewritten") -> Dict[str, ExportedProgram]:
    """The programs the export step saved in the run folder, one per method."""
    return {method: run.load_program(kind, method) for method in program_files(run, methods, kind)}


def preflight_step(programs: Dict[str, ExportedProgram], recipe, report: RunReport) -> preflight.PreflightResult:
    target = recipe.lowering.runtime
    with timed_stage(report, "preflight", f"kernel preflight against ExecuTorch CUDA runtime {target}") as facts:
        try:
            result = preflight.require_kernels(programs, target,
                                               triton_kernel_mode=recipe.lowering.triton_kernel_mode,
                                               gemm=recipe.lowering.gemm)
        except LoweringError:
            facts["failure"] = "kernels the target runtime cannot run"
            raise
        report.record("preflight", result.as_dict())
        facts["detail"] = f"{result.nodes} ops, {len(result.needs)} fallback kernels"
    return result


def lower_step(programs: Mapping[str, Union[ExportedProgram, Path]], run: RunFolder, recipe, report: RunReport, *,
               preflight: bool = True, **options: Any) -> LoweringResult:
    """Lower every method (``programs``: each a program or its saved file; ``options`` go to
    ``lowering.lower_to_pte``). With ``preflight``, the kernel preflight runs inside each method's lowering,
    on its edge program, and is recorded as its own stage; a refusal fails that stage and nothing compiles."""
    try:
        # The start line says the kernel preflight runs here too: on a GPU machine it has no stage start of its own.
        label = f"lower to {PTE_NAME} + {PTD_NAME} (ExecuTorch CUDA backend" + (
            "; kernel preflight first, on each method's edge program)" if preflight else ")")
        with timed_stage(report, "lower", label) as facts:
            lowered = lowering.lower_to_pte(programs, run, recipe, run_preflight=preflight, **options)
            if lowered.preflight is not None:
                result = PreflightResult.from_dict(lowered.preflight)
                report.record("preflight", lowered.preflight)
                # Recorded before "lower" (which timed_stage records as it closes), as the line runs.
                report.stage("preflight", "done", round(result.seconds, 3),
                             f"{result.nodes} ops, {len(result.needs)} fallback kernels (on the lowering's edge "
                             "programs)")
            report.record("lowering", lowered.summary())
            facts["detail"] = (f"{PTE_NAME} {lowered.pte_bytes} B, {PTD_NAME} {lowered.ptd_bytes} B, "
                               f"{lowered.workers['count']} at once"
                               + (f", reused {', '.join(lowered.workers['reused'])} from an earlier lowering"
                                  if lowered.workers.get("reused") else ""))
    except KernelPreflightRefused as exc:
        # Refused by the preflight, before any compile: that stage failed, and the lowering never compiled.
        report.stage("preflight", "failed", None, first_line(exc, limit=160))
        report.stage("lower", "skipped", None, "the kernel preflight refused the program before compiling")
        report.record("failed_stage", "preflight")
        raise
    print(lowered.table())
    return lowered


def audit_step(run: RunFolder, recipe, report: RunReport) -> audit.AuditResult:
    with timed_stage(report, "audit", "audit the compiled .so against ExecuTorch CUDA runtime releases") as facts:
        # The executorch that wrote the .pte decides what later runtimes make of it (audit.release_caveats).
        lowered_with = ((report.get("lowering") or {}).get("options") or {}).get("executorch")
        audited = audit.audit_artifact(run.path, lowered_with=lowered_with)
        report.record("audit", audited.summary())
        target = row_name(recipe.lowering.runtime, lowering_features(recipe.lowering))
        loads = audited.loadable(target) if target in audited.releases else False
        facts["detail"] = (f"loadable on {', '.join(audited.loadable_releases()) or 'no release'}"
                           + ("" if loads else f"; NOT on the target runtime {target}"))
    print(audited.table())
    return audited


def verify_step(run: RunFolder, recipe, report: RunReport, *,
                runner_factory: Optional[RunnerFactory] = None, **options: Any) -> VerificationResult:
    """zoo's verification of the run's artifact, recorded as the "verify" stage (``options`` go to
    ``verify.verify_artifact``: the device, the runtimes, the audit, references already in memory)."""
    audited = options.get("audited")
    with timed_stage(report, "verify", "verify the shipped artifact against eager on the GPU") as facts:
        try:
            verified = verify_artifact(run, recipe, runner_factory=runner_factory, **options)
        except VerificationFailed as exc:
            result = exc.result
            if result is not None:
                report.record("verification", result.summary())
                record_tested(result, audited, report)
                print(result.table())
            facts["failure"] = (_failure_detail(result) if result is not None else exc.message)
            raise
        report.record("verification", verified.summary())
        record_tested(verified, audited, report)
        facts["detail"] = f"{len(verified.rows)} outputs within tolerance; {verified.worst_text()}"
    print(verified.table())
    return verified


def verify_unit_step(run: RunFolder, recipe, report: RunReport, unit: ExportUnit, *, device: str,
                     runner_factory: Optional[RunnerFactory] = None, **options: Any) -> VerificationResult:
    """``verify_step`` with the references taken from the unit still in memory and built where they run: its
    modules moved to ``device`` and, for a bf16 unit, the bf16 rule's float32 copy made there
    (``exporting.float32_copy``; ~20 GB at real size, so no host copy of it and no program read from disk).
    For the real-size runs, whose ~10 GB programs are never saved. The modules go back to the CPU afterwards,
    and the float32 copy is dropped, whatever the outcome."""
    holder = torch.nn.ModuleList([m.module for m in unit.methods.values()])
    holder.to(device)
    reference = exporting.float32_copy(unit) if recipe.unit.dtype == "bfloat16" else None
    references = {"exported": {name: m.module for name, m in unit.methods.items()}}
    if reference is not None:
        references["reference_fp32"] = {name: m.module for name, m in reference.methods.items()}
    try:
        return verify_step(run, recipe, report, runner_factory=runner_factory, device=device,
                           references=references, **options)
    finally:
        del references, reference
        holder.to("cpu")
        gc.collect()
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()


def _failure_detail(result: VerificationResult) -> str:
    parts = [f"{len(result.failures())} outputs out of tolerance"] if result.failures() else []
    parts += [f"{name} FAILED: {outcome.get('why', '')}" for name, outcome in result.failed_runtimes().items()]
    return "; ".join(parts) or "nothing was compared"


def record_tested(result: VerificationResult, audited: Optional[audit.AuditResult], report: RunReport) -> None:
    """The audit's table marks the release the ExecuTorch runtime was built from as tested by running (ok, or
    FAILED and why); a prediction that running contradicted becomes a finding of the audit."""
    agreement = result.runtimes.get("executorch", {}).get("audit")
    if audited is None or not agreement:
        return
    audit.mark_tested(audited, agreement)
    report.record("audit", audited.summary())
    print(f"runtime audit, release {agreement['release']}: {agreement['tested']}"
          + ("" if agreement.get("agrees") is not False else f"\nFINDING: {agreement['verdict']}"))
