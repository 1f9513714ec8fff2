"""The whole line, on one in-memory run report, every step under the one stage recorder
(``zoo.report.timed_stage``):

    recipe -> pull -> build unit -> export -> rewrite -> CPU check -> save -> policy check (CPU steps, here)
           -> preflight -> lower -> audit -> verify -> policy check on the GPU -> manifest (GPU steps, zoo.gpu_steps)

``run_pipeline`` is ``python -m zoo.export``. Everything is written into a staging folder next to the run folder
(``.<name>.partial-<pid>``) and moved into place at the end, so a run folder never holds a half-written run:
after a success it holds the whole run, after a failure (or Ctrl-C) only ``report.json``/``report.md`` (naming
the failed stage and the error) and the resolved ``recipe.yaml``. Either way it replaces what the folder held
before. The GPU steps read the saved rewritten programs back from the folder, exactly as
``python -m zoo.lower RUN_DIR`` does on a GPU machine later; without a CUDA device they are recorded as
skipped, with how to run them.

``lower_run`` is ``python -m zoo.lower RUN_DIR``: the GPU steps on a saved run folder, continuing its report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch.export import ExportedProgram

from . import exporting, gpu_steps, hub, policies, rewrites, tiny_hub
from .cpu_check import cpu_check, summary_detail
from .errors import LoweringError, NoGpuError, RewriteDeclined, ZooError
from .policies.base import ExportUnit
from .policy_check import not_applicable, policy_check_step, record_skip
from .progress import say
from .report import RunReport, record_failure, timed_stage
from .rewrites.result import source_line
from .run_folder import KEPT_ON_FAILURE, RECIPE_YAML, RunFolder

NO_GPU_DETAIL = "needs a CUDA GPU; this machine has none"


# --------------------------------------------------------------------------------------------------------
# The whole run


def run_pipeline(recipe, run_dir: Path, overrides: Sequence[str] = ()) -> RunReport:
    """Run every step for ``recipe`` into ``run_dir``. Returns the report; a failure is recorded in the run
    folder's report and re-raised (a ``ZooError`` the CLI prints, or ``KeyboardInterrupt``)."""
    run = RunFolder(run_dir).prepare()
    staging = run.new_staging()
    report = RunReport(staging.path, recipe.to_dict())
    report.record("status", "running")
    report.record("overrides", list(overrides))  # the manifest names them beside the resolved recipe
    try:
        staging.write_recipe(recipe)
        with source_environment(recipe, report):
            checkpoint = pull_step(recipe, staging, report)
            unit = build_step(checkpoint, recipe, staging, report)
            programs, reference = export_step(unit, recipe, staging, report)
            rewritten = rewrite_step(programs, recipe, report)
            cpu_check_step(unit, rewritten, recipe, report, reference)
            # The later steps work from the saved files: free the eager unit and the in-memory programs first.
            del programs, reference, unit
            save_step(rewritten, recipe, staging, report)
            del rewritten
            # The runner over the saved programs against LeRobot's own policy (its Hub repos still in reach).
            policy_check_step(staging, recipe, report, where="cpu", checkpoint=checkpoint.path)
        del checkpoint
        gpu_half(staging, recipe, report, shown=run)
    except BaseException as exc:
        record_failure(report, exc)
        _finish(staging, run, report, keep=KEPT_ON_FAILURE)
        exc.zoo_report = report  # type: ignore[attr-defined]  # the CLI prints its table
        raise
    if report.get("status") == "running":  # the GPU steps say "verified" when they ran
        report.record("status", "done")
    _finish(staging, run, report, keep=None)
    return report


def gpu_half(run: RunFolder, recipe, report: RunReport, shown: Optional[RunFolder] = None) -> None:
    """Preflight, lower, audit and verify the programs just saved in ``run``, on the same report.

    Without a CUDA device the kernel preflight still runs (it needs none, and it tells now whether lowering
    would fail), and the other three are recorded as skipped with how to run them later. ``shown`` is the
    folder to name in messages when ``run`` is a staging folder.
    """
    shown = shown or run
    if torch.cuda.is_available():
        say(f"lowering, auditing and verifying on {torch.cuda.get_device_name()} ...")
    # The report so far goes to disk first: the GPU steps run for minutes, and a process killed outright
    # (out of memory, a crash in native code) would otherwise leave nothing saying how far the run got.
    run.write_report(report)
    try:
        gpu_steps.run_gpu_steps(run, recipe, report)
    except NoGpuError:
        # On a machine without a GPU that is the expected end of the run: the three GPU stages are skipped.
        for stage in gpu_steps.GPU_STAGES:
            report.stage(stage, "skipped", detail=NO_GPU_DETAIL)
        record_skip(report, "gpu", not_applicable(recipe) or NO_GPU_DETAIL)
        report.record("skipped", {"stages": list(gpu_steps.GPU_STAGES), "reason": "no CUDA device",
                                  "later": f"python -m zoo.lower {shown.path}"})


def lower_run(run_dir: Union[RunFolder, Path], overrides: Sequence[str] = (), *, verify: bool = True,
              lower: bool = True, runner_factory=None) -> RunReport:
    """Preflight, lower, audit and verify a saved run folder, continuing the report it holds; every outcome is
    written to that report before returning or raising."""
    run = RunFolder(run_dir)
    if not run.recipe_file.exists():
        raise LoweringError(f"{run.path} is not a zoo run folder (no {RECIPE_YAML})",
                            "pass the folder `python -m zoo.export RECIPE` wrote")
    recipe = run.load_recipe(overrides)
    report = run.read_report()
    if report.get("recipe") is None:
        report.record("recipe", recipe.to_dict())
    for stale in ("failed_stage", "error"):  # the report describes this attempt, not an earlier one's failure
        report.data.pop(stale, None)
    try:
        gpu_steps.run_gpu_steps(run, recipe, report, lower=lower, verify=verify, runner_factory=runner_factory)
    except BaseException as exc:
        record_failure(report, exc)
        raise
    finally:
        run.write_report(report)
    return report


@contextlib.contextmanager
def source_environment(recipe, report: RunReport) -> Iterator[None]:
    """For tiny recipes: fabricate the checkpoint into zoo's tiny Hub cache and serve it offline while the
    policy is pulled, built and run. Real recipes use the user's cache and HF_HUB_OFFLINE as they are."""
    if not recipe.source.fabricate or recipe.source.local_dir:
        yield
        return
    with contextlib.ExitStack() as stack:
        with timed_stage(report, "fabricate", "fabricate tiny checkpoint") as facts:
            cache = stack.enter_context(tiny_hub.fabricated_hub(recipe))
            facts["detail"] = f"seeded random weights (seed {recipe.source.seed}) in {cache}"
        yield


# --------------------------------------------------------------------------------------------------------
# The CPU steps


def pull_step(recipe, run: RunFolder, report: RunReport) -> hub.Checkpoint:
    with timed_stage(report, "pull", f"pull {recipe.source.local_dir or recipe.source.repo_id}") as facts:
        checkpoint = hub.pull(recipe)
        source = checkpoint.as_dict()
        report.record("source", source)
        run.write_source(source)
        facts["detail"] = (f"local folder {checkpoint.path}" if checkpoint.local_dir else
                           f"{checkpoint.repo_id}@{checkpoint.revision} = {checkpoint.commit or '?'}")
    return checkpoint


def build_step(checkpoint: Optional[hub.Checkpoint], recipe, run: RunFolder, report: RunReport,
               build=None) -> ExportUnit:
    """Build the unit with the family module (or with ``build()``, for units built another way), then write
    what the deploy side needs besides the .pte."""
    with timed_stage(report, "build", f"build {recipe.family} export unit") as facts:
        if build is None:
            unit = policies.load_family(recipe.family).build_unit(checkpoint.path, recipe)
        else:
            unit = build()
        exporting.check_methods(unit, recipe)
        run.write_io_spec(io_spec(unit, recipe))
        run.write_host_settings(unit.host_settings)
        copied = run.copy_host_files(unit.host_files)
        # One container over all methods' modules counts a parameter they share once.
        params = sum(p.numel() for p in torch.nn.ModuleList([m.module for m in unit.methods.values()]).parameters())
        report.record("unit", {"family": unit.family, "methods": list(unit.methods), "parameters": params,
                               "host_files": copied})
        facts["detail"] = f"{len(unit.methods)} method(s), {params:,} parameters, {len(copied)} host file(s)"
    return unit


def export_step(unit: ExportUnit, recipe, run: RunFolder, report: RunReport, *, save: bool = True,
                reference: bool = True) -> Tuple[Dict[str, ExportedProgram], Optional[ExportUnit]]:
    """Export every method (and, for bf16 units unless ``reference`` is False, a float32 copy to judge against);
    save both as .pt2 unless ``save`` is False."""
    sizes = exporting.example_sizes(recipe)
    record: Dict[str, Any] = {"example_sizes": sizes, "methods": {}}
    programs: Dict[str, ExportedProgram] = {}
    reference_unit: Optional[ExportUnit] = None
    with timed_stage(report, "export", f"torch.export {', '.join(recipe.unit.methods)}") as facts:
        for name in recipe.unit.methods:
            start = time.perf_counter()
            programs[name] = exporting.export_method(unit.methods[name], recipe, sizes)
            if save:
                run.save_program(programs[name], "exported", name)
            record["methods"][name] = {"nodes": _count_nodes(programs[name]),
                                       "seconds": round(time.perf_counter() - start, 3)}
            say(f"  exported {name}: {record['methods'][name]['nodes']} nodes")
        if reference and recipe.unit.dtype == "bfloat16":
            reference_unit = exporting.float32_copy(unit)
            for name in recipe.unit.methods:
                ep = exporting.export_method(reference_unit.methods[name], recipe, sizes)
                if save:
                    run.save_program(ep, "reference_fp32", name)
            record["reference_fp32"] = list(recipe.unit.methods)
        report.record("export", record)
        facts["detail"] = ", ".join(f"{m}: {r['nodes']} nodes" for m, r in record["methods"].items())
    return programs, reference_unit


def rewrite_step(programs: Dict[str, ExportedProgram], recipe, report: RunReport) -> Dict[str, ExportedProgram]:
    with timed_stage(report, "rewrite", f"rewrite ({', '.join(recipe.rewrites) or 'none'})") as facts:
        out, record = {}, {}
        for name, ep in programs.items():
            out[name], record[name] = apply_rewrites(ep, recipe, name)
        report.record("rewrites", record)
        changed = sum(sum(s["counts"].values()) for summaries in record.values() for s in summaries)
        facts["detail"] = f"{changed} node(s) rewritten, no complex values left"
    return out


def cpu_check_step(unit: ExportUnit, programs: Dict[str, ExportedProgram], recipe, report: RunReport,
                   reference: Optional[ExportUnit] = None) -> Dict[str, Any]:
    with timed_stage(report, "cpu_check", "check rewritten programs against eager on the CPU") as facts:
        try:
            result = cpu_check(unit, programs, recipe, reference)
        except ZooError as exc:
            report.record("cpu_check", getattr(exc, "result", None))
            raise
        report.record("cpu_check", result)
        facts["detail"] = summary_detail(result)
    return result


def save_step(programs: Dict[str, ExportedProgram], recipe, run: RunFolder, report: RunReport) -> None:
    with timed_stage(report, "save", "save rewritten programs") as facts:
        files = [run.save_program(ep, "rewritten", name).name for name, ep in programs.items()]
        facts["detail"] = ", ".join(files)


# --------------------------------------------------------------------------------------------------------
# Helpers


def apply_rewrites(ep: ExportedProgram, recipe, method: str) -> Tuple[ExportedProgram, List[Dict[str, Any]]]:
    """The recipe's rewrites, in zoo.rewrites.DEFAULT_ORDER; every one is required, so a decline is an error."""
    summaries = []
    for name, rewrite in rewrites.rewrites_for(recipe):
        result = rewrite(ep)
        if result.declined:
            raise RewriteDeclined(f"rewrite {name} declined method {method!r}: {result.declined}",
                                  "the op above is one the rewrite does not handle; see report.md")
        summaries.append(result.summary())
        ep = result.program
    leftover = complex_leftovers(ep)
    if leftover:
        raise RewriteDeclined(
            f"method {method!r} still has complex values after rewrites {list(recipe.rewrites)}: "
            + "; ".join(leftover[:3]) + (f"; and {len(leftover) - 3} more" if len(leftover) > 3 else ""),
            "ExecuTorch's CUDA backend cannot lower complex values: add replace_complex_with_real to the "
            "recipe's rewrites")
    return ep, summaries


def complex_leftovers(ep: ExportedProgram) -> List[str]:
    """Complex tensors anywhere in a program: graph values (including sub-graphs of higher-order ops),
    parameters, buffers and lifted constants."""
    found = []
    for gm in ep.graph_module.modules():
        graph = getattr(gm, "graph", None)
        if graph is None:
            continue
        for node in graph.nodes:
            vals = node.meta.get("val")
            vals = vals if isinstance(vals, (list, tuple)) else [vals]
            if any(isinstance(v, torch.Tensor) and v.is_complex() for v in vals):
                found.append(f"{node.op} {node.name} ({node.target}) from {source_line(node)}")
    for name, t in list(ep.state_dict.items()) + list(ep.constants.items()):
        if isinstance(t, torch.Tensor) and t.is_complex():
            found.append(f"constant {name} ({t.dtype})")
    return found


def io_spec(unit: ExportUnit, recipe) -> Dict[str, Any]:
    """What a deploy side (and zoo.lower/verify without lerobot) needs to feed each method."""
    return {
        "dtype": recipe.unit.dtype,
        "methods": unit.io_spec(),
        "dynamic": {d: {"min": int(r.min), "max": int(r.max)} for d, r in recipe.dynamic.items()},
        "example_sizes": exporting.example_sizes(recipe),
    }


def _finish(staging: RunFolder, run: RunFolder, report: RunReport, keep: Optional[Tuple[str, ...]]) -> None:
    """Write the report into the staging folder, drop all but ``keep`` (on failure), move it into place."""
    report.record("run_dir", str(run.path))
    report.record("finished", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    if keep is not None:
        staging.keep_only(keep)
    staging.write_report(report)
    run.replace_with(staging)
    report.run_dir = run.path


def _as_record(result: Any) -> Any:
    """A step result as JSON-ready report data: its summary(), a dataclass as a dict, or the value itself
    (tests build run folders with it)."""
    if hasattr(result, "summary") and callable(result.summary):
        return result.summary()
    if dataclasses.is_dataclass(result) and not isinstance(result, type):
        return dataclasses.asdict(result)
    return result


def _count_nodes(ep: ExportedProgram) -> int:
    return sum(1 for n in ep.graph.nodes if n.op == "call_function")
