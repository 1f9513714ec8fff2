"""Lowering every method of a unit into one ``model.pte`` + ``aoti_cuda_blob.ptd`` in the run folder (``lower_to_pte``):
plan the constant tables, lower each method in a worker process of its own (side by side), assemble the parts,
extract each method's ``.so`` and weights to ``so/`` and record the runtime the artifact needs. How it runs, and
why, is in docs/ARCHITECTURE.md ("Lowering").
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

from torch.export import ExportedProgram

from zoo.contract.artifact import PTD_NAME, PTE_NAME, ensure_flatc, io_memory_planning
from zoo.contract.releases import features_for, lowering_requirement
from zoo.contract.run_folder import RunFolder, read_program
from zoo.core.errors import LoweringError
from zoo.core.progress import Progress
from zoo.core.progress import say as default_say
from zoo.export.lower import compile_settings
from zoo.export.lower.kept_parts import PartStore
from zoo.export.lower.constant_plan import (ConstantPlan, plan_constants, plans_decision, read_constants,
                                           sharing_groups, written_state)
from zoo.export.lower.method_lowering import CUDA_LOWERING, MethodLowering
from zoo.export.lower.outputs import (LoweringResult, clean_work_folder, program_files, weights_record,
                                      write_artifacts)
from zoo.export.lower.preflight import PreflightResult
from zoo.export.audit import undefined_aoti_symbols
from zoo.export.lower.target import NATIVE, TargetPlan, check_lowered, local_device, plan_target
from zoo.export.lower.workers import MethodJob, MethodPart, choose_workers, lower_in_process, lower_in_workers

# A worker holds its program, then Inductor's host copies of the weights blob and ExecuTorch's bytes of it, plus
# Inductor and Python themselves. Measured on an H200 box (docs/gpu-results.md): a real-size LingBot-VA lowering,
# four workers carrying 9.0, 9.0, 0.3 and 0.3 GiB, took 86 GiB of the machine's available memory at its lowest;
# four times the weights plus 2 GiB each is 82 GiB (three times was 64, too little to keep a second lowering out).
# Used to bound the default number of workers by the available memory, and claimed machine-wide by each worker
# before it starts (zoo.export.lower.admission).
WORKER_MEMORY_FACTOR = 4
WORKER_MEMORY_BASE = 2 << 30


def worker_memory_bytes(carried: int) -> int:
    """The memory a method's lowering is expected to take at its peak, for the weights its .so carries."""
    return WORKER_MEMORY_FACTOR * carried + WORKER_MEMORY_BASE


@dataclass
class ConstantTables:
    """Which constant table each method's ``.so`` carries (``constant_plan``)."""

    decision: Dict[str, Any]  # plans_decision's record: per group of methods, applied or not and why
    method_plan: Dict[str, ConstantPlan]  # the shared table of each method whose group got one
    carried: Dict[str, int]  # the bytes each method's .so carries: its group's table or its own reads


def lower_to_pte(programs: Mapping[str, Union[ExportedProgram, Path]], run: Union[RunFolder, Path], recipe, *,
                 run_preflight: bool = True, workers: Optional[int] = None,
                 method_lowering: MethodLowering = CUDA_LOWERING, consume: bool = False,
                 say: Callable[[str], None] = default_say) -> LoweringResult:
    """Lower every method to one ``model.pte`` + ``aoti_cuda_blob.ptd`` in the run folder ``run`` (atomically),
    extract each method's .so and weights blob to its ``so/`` and record its delegate I/O order beside them.

    ``programs``: per method, the program or the ``.pt2`` file holding it (what workers load; a program given
    in memory is saved for them into the lowering's scratch folder and deleted after). ``workers``: how many
    methods lower at once (default: ``choose_workers``); 1 lowers them one after another in this process,
    where programs given in memory are copied first unless ``consume``. ``run_preflight``: the kernel preflight
    on each method's edge program, refusing before its compile (``KernelPreflightRefused``).
    ``method_lowering``: the function each method is lowered by (the CPU tests inject ExecuTorch's AOTI
    backend compiling for the CPU)."""
    gpu, target_plan = gpu_and_target(recipe, method_lowering)
    ensure_flatc()
    run = RunFolder(run)
    # Each finished method is kept beside the run with its stamp, so that a lowering that stops part way
    # resumes where it stopped (zoo.export.lower.kept_parts).
    store = PartStore.for_run(run, method_lowering.function, gpu)
    run.path.mkdir(parents=True, exist_ok=True)
    if not programs:
        raise LoweringError("no methods to lower", "the unit names its methods in unit.methods")
    start = time.perf_counter()
    stage_seconds: Dict[str, float] = {}
    run.pte.unlink(missing_ok=True)  # a model.pte left from an earlier run must not pair with new weights
    run.runtime_file.unlink(missing_ok=True)  # nor its runtime requirement
    work = Path(tempfile.mkdtemp(prefix=".lowering.tmp-", dir=run.path))
    failed = True
    try:
        mark = time.perf_counter()
        in_memory = {m: p if isinstance(p, ExportedProgram) else read_program(Path(p)) for m, p in programs.items()}
        tables = plan_tables(in_memory)
        stage_seconds["plan"] = round(time.perf_counter() - mark, 3)
        check_disk(run.path, tables)
        options = lowering_options(recipe, run_preflight, target_plan)
        parts, workers_record = lower_methods(programs, in_memory, tables, options, recipe, work, stage_seconds,
                                              workers=workers, target_plan=target_plan, store=store,
                                              method_lowering=method_lowering, consume=consume, say=say)
        del in_memory
        # Assembled: nothing of this run is left to resume, and the kept parts' disk is wanted back.
        methods_record, ptd_summary = write_artifacts(parts, run, stage_seconds, assembled_hook=store.remove)
        # What was asked, read back from the binary: every kernel carries SASS for the target.
        check_lowered(target_plan, {m: run.path / a.so for m, a in methods_record.items()})
        preflights = [PreflightResult.from_dict(p.record["preflight"]) for p in parts.values()
                      if p.record.get("preflight")]
        failed = False
    finally:
        clean_work_folder(work, keep_logs=failed)
    # Read back from the bytes written: what a runtime will find, whichever lowering function made them. The
    # features are the shims the .so files import (lowering.gemm=autotune may have chosen no cuBLAS GEMM at all).
    imported = {s for a in methods_record.values() for s in undefined_aoti_symbols(run.path / a.so)}
    requirement = lowering_requirement(compile_settings.executorch_version(), io_memory_planning(run.pte),
                                       [f.name for f in features_for(imported)])
    run.write_runtime_requirement(requirement.as_dict())
    return LoweringResult(
        out_dir=str(run.path), pte=PTE_NAME, ptd=PTD_NAME, pte_bytes=run.pte.stat().st_size,
        ptd_bytes=run.ptd.stat().st_size if run.ptd.exists() else 0, seconds=round(time.perf_counter() - start, 3),
        compile_seconds=stage_seconds["methods"], methods=methods_record,
        options=options_record(options, method_lowering), gpu=gpu,
        preflight=PreflightResult.merged(preflights).as_dict() if preflights else None,
        workers=workers_record, weights=weights_record(tables.decision, ptd_summary), stage_seconds=stage_seconds,
        runtime=requirement.as_dict())


def gpu_and_target(recipe, method_lowering: MethodLowering) -> Tuple[Dict[str, Any], Optional[TargetPlan]]:
    """The GPU this lowering runs on (``NoGpuError`` without one, where the method lowering needs it) and the plan
    for the recipe's target GPU, refused here when this machine cannot lower for it (zoo.export.lower.target)."""
    gpu = compile_settings.cuda_device_info() if method_lowering.needs_gpu else {
        "name": f"no GPU ({method_lowering.function})", "capability": None}
    target = recipe.lowering.target if method_lowering.needs_gpu else None
    plan = plan_target(target, local_device()) if target else None
    if plan is not None:
        gpu["target"] = {**plan.record(), "words": plan.words()}
    return gpu, plan


def plan_tables(programs: Mapping[str, ExportedProgram]) -> ConstantTables:
    """One constant table per group of methods that read mostly the same weights, applied where it costs little
    GPU memory (``constant_plan.plans_decision``)."""
    reads = {m: read_constants(p) for m, p in programs.items()}
    groups = sharing_groups(reads, state=written_state(programs))
    plans = [(group, plan_constants({m: programs[m] for m in group})) for group in groups]
    decision = plans_decision(plans)
    method_plan = {m: plan for (group, plan), record in zip(plans, decision["groups"]) if record["applied"]
                   for m in group}
    carried = {m: max(sum(reads[m].values()), method_plan[m].nbytes if m in method_plan else 0) for m in programs}
    return ConstantTables(decision=decision, method_plan=method_plan, carried=carried)


def disk_needed(tables: ConstantTables) -> int:
    """Bytes a lowering writes at its peak: every method's part (each holds the weights its .so carries) next to
    the assembled .ptd (one table per group once), and later the .ptd next to each method's extracted weights,
    which is as much."""
    parts = sum(tables.carried.values())
    ptd = sum({id(plan): plan.nbytes for plan in tables.method_plan.values()}.values()) + sum(
        b for m, b in tables.carried.items() if m not in tables.method_plan)
    return parts + ptd


def check_disk(folder: Path, tables: ConstantTables, margin: float = 1.1) -> None:
    """Refuse before any compile when the run's disk cannot hold what the lowering will write (minutes in, a full
    disk would lose the lowering)."""
    need = int(disk_needed(tables) * margin)
    free = shutil.disk_usage(folder).free
    if free < need:
        raise LoweringError(f"lowering needs about {need / 1e9:.1f} GB free on the disk of {folder} (each method's "
                            f"part, then the .ptd and each method's extracted weights), and {free / 1e9:.1f} GB are",
                            "free disk space there (or lower into a run folder on a larger disk), then lower again")


def lowering_options(recipe, run_preflight: bool, target_plan: Optional[TargetPlan]) -> Dict[str, Any]:
    """The options every method's lowering gets (JSON: they travel to the workers)."""
    lowering = recipe.lowering
    return {"triton_kernel_mode": lowering.triton_kernel_mode, "max_mm_configs": lowering.max_mm_configs,
            "gemm": lowering.gemm, "runtime": lowering.runtime, "preflight": run_preflight,
            "target": target_plan.record() if target_plan is not None else None}


def lower_methods(programs: Mapping[str, Union[ExportedProgram, Path]], in_memory: Dict[str, ExportedProgram],
                  tables: ConstantTables, options: Dict[str, Any], recipe, work: Path, stage_seconds: Dict[str, float],
                  *, workers: Optional[int], target_plan: Optional[TargetPlan], store: PartStore,
                  method_lowering: MethodLowering, consume: bool, say: Callable[[str], None]
                  ) -> Tuple[Dict[str, MethodPart], Dict[str, Any]]:
    """Every method lowered, side by side in workers or one after another here (``choose_workers``); returns the
    parts and the report's ``workers`` record. ``in_memory`` is emptied: the parent holds no program after."""
    methods = list(programs)
    # Largest first: the workers start in this order, so the longest lowerings never wait behind small ones,
    # and the memory bound counts them.
    start_order = sorted(methods, key=lambda m: -tables.carried[m])
    count, why = choose_workers(len(methods), requested=workers, configured=recipe.lowering.workers,
                                per_worker_bytes=[worker_memory_bytes(tables.carried[m]) for m in start_order])
    method_options = {m: {**options, "constant_plan": tables.method_plan[m].as_dict()
                          if m in tables.method_plan else None} for m in methods}
    memory = {m: worker_memory_bytes(tables.carried[m]) for m in methods}
    say(f"lowering {', '.join(methods)}: {count} at once ({why}); constant plan: {tables.decision['why']}")
    # Another GPU's compile settings go to worker processes only: a fresh process has no cache of this GPU's
    # properties that Inductor or Triton filled before (zoo.export.lower.target).
    in_process = count == 1 and (target_plan is None or target_plan.mode == NATIVE)
    if in_process:
        parts, reused = lower_here(programs, in_memory, method_options, method_lowering, work, stage_seconds,
                                   store=store, consume=consume, say=say, memory=memory)
    else:
        in_memory.clear()  # the parent's copies go before the workers load theirs
        parts, reused = lower_side_by_side(programs, start_order, method_options, method_lowering, work,
                                           stage_seconds, store=store, count=count, say=say, memory=memory)
    return parts, {"count": count, "why": why, "in_process": in_process, "reused": reused}


def lower_here(programs: Mapping[str, Union[ExportedProgram, Path]], in_memory: Dict[str, ExportedProgram],
               method_options: Mapping[str, Dict[str, Any]], method_lowering: MethodLowering, work: Path,
               stage_seconds: Dict[str, float], *, store: PartStore, consume: bool, say: Callable[[str], None],
               memory: Mapping[str, int]) -> Tuple[Dict[str, MethodPart], List[str]]:
    """The methods lowered one after another in this process. Programs read from files are ours to consume;
    the caller's are copied unless handed over (``to_edge_transform_and_lower`` changes the program it lowers).
    ``in_memory`` is emptied: each program is held by its job alone. ``memory``: each method's estimate, claimed
    machine-wide while it lowers."""
    mark = time.perf_counter()
    # Only a program read from a file has a stamp: hashing one given in memory would mean saving it first.
    kept = store.stamped({m: Path(p) for m, p in programs.items() if not isinstance(p, ExportedProgram)},
                         method_options)
    reused = kept.reuse(list(programs), work / "methods", say)
    jobs = [MethodJob(m, in_memory[m] if consume or not isinstance(programs[m], ExportedProgram)
                      else copy.deepcopy(in_memory[m]), method_options[m], memory_bytes=memory[m])
            for m in programs if m not in reused]
    in_memory.clear()
    lowered: Dict[str, MethodPart] = {}
    if jobs:
        with Progress("lower", len(jobs), unit="method") as bar:
            lowered = lower_in_process(jobs, method_lowering.function, work / "methods",
                                       pythonpath=method_lowering.pythonpath, say=say, bar=bar, on_part=kept.keep,
                                       run=work.parent)
    del jobs
    stage_seconds["methods"] = round(time.perf_counter() - mark, 3)
    return {m: reused[m] if m in reused else lowered[m] for m in programs}, list(reused)


def lower_side_by_side(programs: Mapping[str, Union[ExportedProgram, Path]], start_order: List[str],
                       method_options: Mapping[str, Dict[str, Any]], method_lowering: MethodLowering, work: Path,
                       stage_seconds: Dict[str, float], *, store: PartStore, count: int,
                       say: Callable[[str], None], memory: Mapping[str, int]
                       ) -> Tuple[Dict[str, MethodPart], List[str]]:
    """The methods lowered in worker processes, ``count`` at once, started in ``start_order``; programs given in
    memory are saved for the workers first and deleted after. ``memory``: each method's estimate, claimed
    machine-wide before its worker starts, so another lowering on the machine is waited for."""
    files, saved = program_files(programs, work / "programs", stage_seconds)
    mark = time.perf_counter()
    kept = store.stamped(files, method_options)
    reused = kept.reuse(start_order, work / "methods", say)
    stage_seconds["stamp"] = round(time.perf_counter() - mark, 3)
    mark = time.perf_counter()  # "methods" is the workers' time alone: the save and the stamps have their own
    jobs = [MethodJob(m, files[m], method_options[m], memory_bytes=memory[m]) for m in start_order if m not in reused]
    env = {"PYTHONPATH": os.pathsep.join(method_lowering.pythonpath)} if method_lowering.pythonpath else None
    started: Dict[str, MethodPart] = {}
    if jobs:
        with Progress("lower", len(jobs), unit="method") as bar:
            started = lower_in_workers(jobs, method_lowering.function, work / "methods", max_workers=count,
                                       env=env, say=say, bar=bar, on_part=kept.keep, run=work.parent)
    # The .pte lists the methods in the unit's order, reused or not.
    parts = {m: reused[m] if m in reused else started[m] for m in programs}
    for path in saved:  # disk: at real size each is ~10 GB, and the workers are done with them
        path.unlink()
    stage_seconds["methods"] = round(time.perf_counter() - mark, 3)
    return parts, [m for m in programs if m in reused]


def options_record(options: Dict[str, Any], method_lowering: MethodLowering) -> Dict[str, Any]:
    """The lowering's options as the run report keeps them: what the methods got, and the settings they ran under."""
    return {**options,
            "inductor_cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(compile_settings.inductor_cache_dir()),
            "prune_choices_based_on_shared_mem": True, "executorch": compile_settings.executorch_version(),
            "triton_ptxas": compile_settings.lowering_ptxas(), "method_lowering": method_lowering.function}
