"""The whole line on one run report: ``run_pipeline`` (``python -m zoo.export``: pull, build, export, rewrite, CPU
check, save, policy check, then the GPU steps of ``zoo.export.stages``) and ``lower_run`` (``python -m zoo lower
RUN_DIR``: the GPU steps on a saved run). Each is one ``zoo.contract.attempt.Attempt``, staged beside the run and put in place
only when it got at least as far (docs/ARCHITECTURE.md, "The run folder").
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch.export import ExportedProgram

from zoo.export import trace as exporting
from zoo.export import stages as gpu_steps
from zoo.export import pull as hub
from zoo import policies
from zoo import rewrites
from zoo.export import tiny_hub
from zoo.export.cpu_check import cpu_check, summary_detail
from zoo.export import quantize as quantizing
from zoo.export.quant_cost import quantization_cost
from zoo.core.environ import zoo_command
from zoo.core.errors import (Interrupted, LoweringError, NoGpuError, RewriteDeclined, StorageError, VerificationFailed,
                             ZooError, storage_error)
from zoo.policies.base import ExportUnit
from zoo.export.policy_check import not_applicable, policy_check_step, record_skip
from zoo.core.progress import held_back, run_log, say
from zoo.core.report import FINISHED, RunReport, record_failure, timed_stage
from zoo.rewrites.result import source_line
from zoo.contract.io_spec import DynamicDim, IoSpec
from zoo.contract.attempt import Attempt, Placement
from zoo.contract.run_folder import ARTIFACT_OUTPUTS, RECIPE_YAML, RunFolder
from zoo.export.verify_runtimes import choose_runtimes

NO_GPU_DETAIL = "needs a CUDA GPU; this machine has none"

# What a new lowering (or verification) of a saved run makes stale in its report.
GPU_SECTIONS = ("preflight", "lowering", "audit", "verification", "skipped")
REDONE_BY_LOWER = ("preflight", "lower", "audit", "verify")
REDONE_BY_VERIFY = ("audit", "verify")
ATTEMPT_SECTIONS = ("status", "failed_stage", "error", "next", "placement", "finished", "run_dir")


# --------------------------------------------------------------------------------------------------------
# The whole run


def run_pipeline(recipe, run_dir: Path, overrides: Sequence[str] = (), *, force: bool = False,
                 command: Optional[str] = None, verbose: bool = False) -> RunReport:
    """Run every step for ``recipe`` as one attempt at ``run_dir``. Returns the report (its ``placement``
    section says whether the attempt is the run folder now). A failure is recorded in the attempt's report and
    re-raised (a ``ZooError`` the CLI prints, or ``Interrupted``) with its ``report`` and ``placement`` set."""
    # Refused before anything is fabricated, downloaded or written: a recipe the family cannot build, and a
    # verification runtime the recipe names but this machine cannot run.
    with held_back(verbose):  # importing the family imports lerobot and diffusers, which log as they load
        policies.check_recipe(recipe)
    quantizing.refuse_blocked(recipe)
    choose_runtimes(recipe.verify.runtimes)
    attempt = Attempt.begin(run_dir, force=force)
    run, staging = attempt.run, attempt.staging
    command = command or zoo_command("zoo.export", [recipe.name, *overrides, "--output-dir", str(run.path)])
    report = RunReport(staging.path, recipe.to_dict())
    report.record("status", "running")
    report.record("overrides", list(overrides))  # the manifest names them beside the resolved recipe
    report.record("command", command)
    failure: Optional[BaseException] = None
    log = None
    try:
        with run_log(staging.log_file("export"), verbose) as log:
            staging.write_recipe(recipe)
            with source_environment(recipe, report):
                checkpoint = pull_step(recipe, staging, report)
                unit = build_step(checkpoint, recipe, staging, report)
                baselines = quantize_step(unit, recipe, report)
                programs, reference = export_step(unit, recipe, staging, report)
                rewritten = rewrite_step(programs, recipe, report)
                cpu_check_step(unit, rewritten, recipe, report, reference)
                quantization_cost_step(unit, baselines, recipe, report)
                # The later steps work from the saved files: free the eager unit and the in-memory programs first.
                del programs, reference, unit, baselines
                save_step(rewritten, recipe, staging, report)
                del rewritten
                # The runner over the saved programs against LeRobot's own policy (its Hub repos still in reach).
                policy_check_step(staging, recipe, report, where="cpu", checkpoint=checkpoint.path)
            del checkpoint
            gpu_half(staging, recipe, report, shown=run)
    except BaseException as exc:
        record_failure(report, exc)
        failure = exc
    if failure is None and report.get("status") == "running":  # the GPU steps say "verified" when they ran
        report.record("status", "done")
    return _finish(attempt, report, failure, command, log)


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
                                  "later": zoo_command("zoo", ["lower", str(shown.path)])})


def lower_run(run_dir: Union[RunFolder, Path], overrides: Sequence[str] = (), *, verify: bool = True,
              lower: bool = True, runner_factory=None, force: bool = False, command: Optional[str] = None,
              verbose: bool = False) -> RunReport:
    """Preflight, lower, audit and verify a saved run folder as one attempt, continuing the report it holds.

    The attempt is staged beside the run with hard links to the run's files (no copy of the programs), except
    what it makes anew (the artifact, unless ``lower`` is False). It replaces the run only when it passed at
    least the stages the run had passed; otherwise (or when it fails) it goes to ``attempts/``. Raises like
    ``run_pipeline``."""
    folder = RunFolder(run_dir)
    if not folder.recipe_file.exists():
        raise LoweringError(f"{folder.path} is not a zoo run folder (no {RECIPE_YAML})",
                            "pass the folder `python -m zoo.export RECIPE` wrote")
    recipe = folder.load_recipe(overrides)  # a bad override is refused before anything is written
    report = folder.read_report()  # the report this attempt continues (a damaged one is refused here)
    if verify:  # a verification runtime this machine cannot run is refused before anything is written
        choose_runtimes(recipe.verify.runtimes)
    attempt = Attempt.begin(folder, force=force, seed=True, rebuilt=ARTIFACT_OUTPUTS if lower else (),
                            keep_on_failure=None)
    run, staging = attempt.run, attempt.staging
    options = [*overrides] + ([] if verify else ["--no-verify"]) + ([] if lower else ["--verify-only"])
    command = command or zoo_command("zoo", ["lower", str(run.path), *options])
    report.run_dir = staging.path
    if report.get("recipe") is None:
        report.record("recipe", recipe.to_dict())
    _forget_what_is_redone(report, REDONE_BY_LOWER if lower else REDONE_BY_VERIFY)
    report.record("command", command)
    failure: Optional[BaseException] = None
    log = None
    try:
        with run_log(staging.log_file("lower"), verbose) as log:
            if overrides:
                staging.write_recipe(recipe)  # the folder records the recipe its artifact was made with
                report.record("overrides", list(report.get("overrides") or []) + list(overrides))
            gpu_steps.run_gpu_steps(staging, recipe, report, lower=lower, verify=verify,
                                    runner_factory=runner_factory)
    except BaseException as exc:
        record_failure(report, exc)
        failure = exc
    return _finish(attempt, report, failure, command, log)


def _forget_what_is_redone(report: RunReport, stages: Sequence[str]) -> None:
    """The report describes this attempt: stages it runs again, and their sections, are dropped first."""
    report.data["stages"] = [s for s in report.stages if s["stage"] not in stages]
    sections = ATTEMPT_SECTIONS + (GPU_SECTIONS if "lower" in stages else ("audit", "verification"))
    for section in sections:
        report.data.pop(section, None)


def _finish(attempt: Attempt, report: RunReport, failure: Optional[BaseException], command: str,
            log) -> RunReport:
    """Put the attempt where it belongs, tell the user where its dependency output went, and raise the failure
    (or a report that could not be written) with the report and placement attached."""

    def record_next(placement: Placement) -> None:
        report.record("next", next_step(report, placement, command))

    if failure is not None:
        attempt.relabel_error(failure)

    placement = attempt.finish(report, failed=failure is not None, on_decided=record_next)
    if log is not None and log.captured and not placement.write_error:
        say(f"{log.captured} line(s) of dependency output (warnings, library logs) are in "
            f"{placement.folder / log.path.name}")
    if failure is None and placement.write_error:
        failure = StorageError(placement.write_error, "free disk space and run the command again")
    if failure is not None:
        raise _with_attempt(failure, report, placement)
    return report


def _with_attempt(failure: BaseException, report: RunReport, placement: Placement) -> BaseException:
    """The failure to raise, carrying the attempt's report and placement in declared fields (the CLI prints the
    stage table and where the attempt went): a ``ZooError`` itself, Ctrl-C as ``Interrupted``, a storage
    ``OSError`` as the ``StorageError`` it stands for. Anything else is a bug in zoo and keeps its traceback."""
    if isinstance(failure, KeyboardInterrupt):
        interrupted = Interrupted(report, placement)
        interrupted.__cause__ = failure
        return interrupted
    if not isinstance(failure, ZooError):
        refused = storage_error(failure)
        if refused is None:
            return failure
        refused.__cause__ = failure
        failure = refused
    failure.report, failure.placement = report, placement
    return failure


def next_step(report: RunReport, placement: Placement, command: str) -> Dict[str, str]:
    """The exact command a person runs next, and why."""
    status = report.get("status")
    run = str(placement.folder)
    if status == "interrupted":
        return {"command": command, "why": "to run it again"}
    if status not in FINISHED:
        return {"command": command, "why": "once the error above is fixed"}
    if not placement.placed:
        forced = command if " --force" in command else f"{command} --force"
        return {"command": forced, "why": f"to replace the earlier run with this attempt (kept in {run})"}
    skipped = report.get("skipped")
    if status == "done" and skipped:
        return {"command": zoo_command("zoo", ["lower", run]), "why": "on a machine with an NVIDIA GPU: "
                                                                    + ", ".join(skipped["stages"])}
    if status == "lowered":
        return {"command": zoo_command("zoo", ["lower", run, "--verify-only"]), "why": "to verify the artifact"}
    if status == "verified":
        repo = ((report.get("recipe") or {}).get("publish") or {}).get("repo_id")
        args = [run] + ([] if repo else ["--repo-id", "ORG/NAME"]) + ["--dry-run"]
        return {"command": zoo_command("zoo", ["publish", *args]),
                "why": "stages the upload and shows the commit; without --dry-run it publishes"}
    return {}


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


def quantize_step(unit: ExportUnit, recipe, report: RunReport) -> Optional[quantizing.Baselines]:
    """The recipe's ``unit.quantize`` applied to the unit in place, after unquantized copies of it are kept
    to measure the cost against; None (and no stage) for a recipe that does not quantize."""
    if not recipe.unit.quantize.enabled:
        return None
    with timed_stage(report, "quantize", f"quantize linear layers ({recipe.unit.quantize.words()})") as facts:
        baselines = quantizing.unquantized_copies(unit, recipe)
        record = quantizing.quantize_unit(unit, recipe)
        report.record("quantization", {"applied": record})
        sizes = record["weight_bytes"]
        facts["detail"] = (f"{record['quantized']} linear layer(s) quantized, {len(record['kept'])} kept; weights "
                           f"{sizes['before']:,} -> {sizes['after']:,} bytes ({sizes['after'] / sizes['before']:.2f}x)")
    return baselines


def quantization_cost_step(unit: ExportUnit, baselines: Optional[quantizing.Baselines], recipe,
                           report: RunReport, device: str = "cpu") -> None:
    """The quantized unit, eager, against its unquantized copies: what quantization costs (the rule's
    second half; the CPU check just judged the first). ``device``: where the three run (the real-size chunk
    bench measures on the GPU)."""
    if baselines is None:
        return
    section = dict(report.get("quantization") or {})
    with timed_stage(report, "quantization_cost", "measure what quantization costs against the unquantized unit") \
            as facts:
        try:
            section["cost"] = quantization_cost(unit, baselines, recipe, device=device)
        except VerificationFailed as exc:
            section["cost"] = exc.result
            report.record("quantization", section)
            raise
        report.record("quantization", section)
        worst = max(section["cost"]["rows"], key=lambda r: r["rel_l2"], default=None)
        facts["detail"] = (f"worst rel L2 {worst['rel_l2']:.2e} ({worst['name']}) vs float32 unquantized"
                           if worst else "no outputs") + "; seeded weights, not a task-success figure"


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
        except VerificationFailed as exc:
            report.record("cpu_check", exc.result)
            raise
        except ZooError:
            report.record("cpu_check", None)
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


def io_spec(unit: ExportUnit, recipe) -> IoSpec:
    """What a deploy side (and zoo.lower/verify without lerobot) needs to feed each method."""
    return IoSpec(dtype=recipe.unit.dtype, methods=unit.io_spec(),
                  dynamic={d: DynamicDim(min=int(r.min), max=int(r.max)) for d, r in recipe.dynamic.items()},
                  example_sizes=exporting.example_sizes(recipe))


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
