"""The straight line: recipe -> pull -> build unit -> export -> rewrite -> CPU check -> save -> lower -> audit
-> verify. Each step is one function call that records what it did into the run report.

Everything is written into a staging folder next to the run folder (``.<name>.partial-<pid>``) and moved
into place at the end, so a run folder never holds a half-written run: after a success it holds the whole
run, after a failure (or Ctrl-C) only ``report.json``/``report.md`` (naming the failed stage and the error)
and the resolved ``recipe.yaml``. Either way it replaces what the folder held before.

The GPU steps (``gpu_steps``) read the saved rewritten programs back from the folder, exactly as
``python -m zoo.lower RUN_DIR`` does on a GPU machine later; without a CUDA device they are recorded as
skipped, with how to run them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.export import ExportedProgram

from . import atomic, exporting, hub, rewrites
from .cpu_check import cpu_check, summary_detail
from .errors import ExportError, NoGpuError, RewriteDeclined, ZooError
from .policies.base import ExportUnit
from .progress import say
from .report import REPORT_JSON, REPORT_MD, RunReport

GPU_STAGES = ("lower", "audit", "verify")
# What a failed run leaves in its folder: the report saying why, and the recipe to reproduce it.
KEPT_ON_FAILURE = (REPORT_JSON, REPORT_MD, "recipe.yaml")
PROCESSORS_DIR = "processors"


def program_file(kind: str, method: str) -> str:
    """``exported``, ``reference_fp32`` or ``rewritten`` program file of a method."""
    return f"{kind}.{method}.pt2"


NO_GPU_DETAIL = "needs a CUDA GPU; this machine has none"


# --------------------------------------------------------------------------------------------------------
# The whole run


def run_pipeline(recipe, run_dir: Path, overrides: Sequence[str] = ()) -> RunReport:
    """Run every step for ``recipe`` into ``run_dir``. Returns the report; a failure is recorded in the run
    folder's report and re-raised (a ``ZooError`` the CLI prints, or ``KeyboardInterrupt``)."""
    run_dir = prepare_run_dir(Path(run_dir))
    staging = run_dir.parent / f".{run_dir.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    report = RunReport(staging, recipe.to_dict())
    report.record("status", "running")
    report.record("overrides", list(overrides))  # the manifest names them beside the resolved recipe
    try:
        atomic.write_text(staging / "recipe.yaml", recipe.to_yaml())
        with source_environment(recipe, report):
            checkpoint = pull_step(recipe, staging, report)
            unit = build_step(checkpoint, recipe, staging, report)
            programs, reference = export_step(unit, recipe, staging, report)
            rewritten = rewrite_step(programs, recipe, report)
            cpu_check_step(unit, rewritten, recipe, report, reference)
        # The GPU steps work from the saved files: free the eager unit and the in-memory programs first.
        del programs, reference, unit, checkpoint
        save_step(rewritten, recipe, staging, report)
        gpu_steps(staging, recipe, report, shown_dir=run_dir)
    except BaseException as exc:
        _record_failure(report, exc)
        _finish(staging, run_dir, report, keep=KEPT_ON_FAILURE)
        exc.zoo_report = report  # type: ignore[attr-defined]  # the CLI prints its table
        raise
    if report.get("status") == "running":  # the GPU steps say "verified" when they ran
        report.record("status", "done")
    _finish(staging, run_dir, report, keep=None)
    return report


def prepare_run_dir(run_dir: Path) -> Path:
    """The run folder may be new, empty, or an earlier zoo run (it gets replaced); anything else is refused
    so that a mistyped --output-dir never deletes someone's files."""
    run_dir = run_dir.expanduser().resolve()
    if run_dir.exists():
        if not run_dir.is_dir():
            raise ZooError(f"output folder {run_dir} exists and is a file", "choose another --output-dir")
        if any(run_dir.iterdir()) and not (run_dir / REPORT_JSON).is_file():
            raise ZooError(f"output folder {run_dir} is not empty and holds no zoo run (no {REPORT_JSON})",
                           "choose a new or empty folder with --output-dir; zoo replaces only its own runs")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(run_dir)
    return run_dir


@contextlib.contextmanager
def source_environment(recipe, report: RunReport) -> Iterator[None]:
    """For tiny recipes: fabricate the checkpoint into zoo's tiny Hub cache and serve it offline while the
    policy is pulled, built and run. Real recipes use the user's cache and HF_HUB_OFFLINE as they are."""
    if not recipe.source.fabricate or recipe.source.local_dir:
        yield
        return
    from . import tiny_hub

    with contextlib.ExitStack() as stack:
        with timed_stage(report, "fabricate", "fabricate tiny checkpoint") as facts:
            cache = stack.enter_context(tiny_hub.fabricated_hub(recipe))
            facts["detail"] = f"seeded random weights (seed {recipe.source.seed}) in {cache}"
        yield


# --------------------------------------------------------------------------------------------------------
# The steps


def pull_step(recipe, run_dir: Path, report: RunReport) -> hub.Checkpoint:
    with timed_stage(report, "pull", f"pull {recipe.source.local_dir or recipe.source.repo_id}") as facts:
        checkpoint = hub.pull(recipe)
        source = checkpoint.as_dict()
        report.record("source", source)
        atomic.write_json(run_dir / "source.json", source)
        facts["detail"] = (f"local folder {checkpoint.path}" if checkpoint.local_dir else
                           f"{checkpoint.repo_id}@{checkpoint.revision} = {checkpoint.commit or '?'}")
    return checkpoint


def build_step(checkpoint: hub.Checkpoint, recipe, run_dir: Path, report: RunReport) -> ExportUnit:
    """Build the unit with the family module, then write what the deploy side needs besides the .pte."""
    from .policies import load_family

    with timed_stage(report, "build", f"build {recipe.family} export unit") as facts:
        family = load_family(recipe.family)
        unit = family.build_unit(checkpoint.path, recipe)
        exporting.check_methods(unit, recipe)
        atomic.write_json(run_dir / "io_spec.json", io_spec(unit, recipe))
        atomic.write_json(run_dir / "host_settings.json", unit.host_settings)
        copied = copy_host_files(unit.host_files, run_dir / PROCESSORS_DIR)
        # One container over all methods' modules counts a parameter they share once.
        params = sum(p.numel() for p in torch.nn.ModuleList([m.module for m in unit.methods.values()]).parameters())
        report.record("unit", {"family": unit.family, "methods": list(unit.methods), "parameters": params,
                               "host_files": copied})
        facts["detail"] = f"{len(unit.methods)} method(s), {params:,} parameters, {len(copied)} host file(s)"
    return unit


def export_step(unit: ExportUnit, recipe, run_dir: Path,
                report: RunReport) -> Tuple[Dict[str, ExportedProgram], Optional[ExportUnit]]:
    """Export every method (and, for bf16 units, a float32 copy to judge against); save both as .pt2."""
    sizes = exporting.example_sizes(recipe)
    record: Dict[str, Any] = {"example_sizes": sizes, "methods": {}}
    programs: Dict[str, ExportedProgram] = {}
    reference: Optional[ExportUnit] = None
    with timed_stage(report, "export", f"torch.export {', '.join(recipe.unit.methods)}") as facts:
        for name in recipe.unit.methods:
            start = time.perf_counter()
            programs[name] = exporting.export_method(unit.methods[name], recipe, sizes)
            save_program(programs[name], run_dir / program_file("exported", name))
            record["methods"][name] = {"nodes": _count_nodes(programs[name]),
                                       "seconds": round(time.perf_counter() - start, 3)}
            say(f"  exported {name}: {record['methods'][name]['nodes']} nodes")
        if recipe.unit.dtype == "bfloat16":
            reference = exporting.float32_copy(unit)
            for name in recipe.unit.methods:
                ep = exporting.export_method(reference.methods[name], recipe, sizes)
                save_program(ep, run_dir / program_file("reference_fp32", name))
            record["reference_fp32"] = list(recipe.unit.methods)
        report.record("export", record)
        facts["detail"] = ", ".join(f"{m}: {r['nodes']} nodes" for m, r in record["methods"].items())
    return programs, reference


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


def save_step(programs: Dict[str, ExportedProgram], recipe, run_dir: Path, report: RunReport) -> None:
    with timed_stage(report, "save", "save rewritten programs") as facts:
        files = []
        for name, ep in programs.items():
            path = run_dir / program_file("rewritten", name)
            save_program(ep, path)
            files.append(path.name)
        facts["detail"] = ", ".join(files)


def gpu_steps(run_dir: Path, recipe, report: RunReport, shown_dir: Optional[Path] = None) -> None:
    """Preflight, lower, audit and verify the saved rewritten programs of ``run_dir``.

    They are ``zoo.lower.lower_run``, the very steps ``python -m zoo.lower RUN_DIR`` runs on a saved run (it reads
    the run folder's recipe.yaml, which is ``recipe`` resolved), so a run lowered now and one lowered later
    on another machine go through one implementation. Without a CUDA device the kernel preflight still runs
    (it needs none, and it tells now whether lowering would fail), and the other three are skipped.
    ``shown_dir`` is the folder to name in messages when ``run_dir`` is a staging folder.
    """
    shown = shown_dir or run_dir
    lower = _import("zoo.lower", "lowering")
    if torch.cuda.is_available():
        say(f"lowering, auditing and verifying on {torch.cuda.get_device_name()} ...")
    report.write()  # lower_run continues the report the folder holds
    try:
        lower.lower_run(run_dir)
    except NoGpuError:
        # lower_run recorded the preflight and marked the run failed for want of a GPU: on this machine that is
        # the expected end of the run, so the three GPU stages are recorded as skipped instead.
        report.data = RunReport.load(run_dir).data
        report.data.pop("error", None)
        report.record("status", "running")  # run_pipeline marks the finished CPU run done
        for stage in GPU_STAGES:
            report.stage(stage, "skipped", detail=NO_GPU_DETAIL)
        report.record("skipped", {"stages": list(GPU_STAGES), "reason": "no CUDA device",
                                  "later": f"python -m zoo.lower {shown}"})
        return
    except BaseException:
        report.data = RunReport.load(run_dir).data  # lower_run wrote what failed
        raise
    report.data = RunReport.load(run_dir).data


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
    from .rewrites.result import source_line

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


def copy_host_files(files, dest: Path) -> List[str]:
    """Copy the unit's host files (normalisation processors, tokenizer files) flat into ``dest``."""
    copied = []
    for src in files:
        src = Path(src)
        if not src.exists():
            raise ExportError(f"the unit lists host file {src}, which does not exist",
                              "the family must list only files present in the checkpoint")
        dest.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dest / src.name, dirs_exist_ok=True)
        else:
            shutil.copy2(src, dest / src.name)
        copied.append(src.name)
    return copied


def save_program(ep: ExportedProgram, path: Path) -> None:
    with atomic.atomic_path(path) as tmp:
        with open(tmp, "wb") as fh:
            torch.export.save(ep, fh)


@contextlib.contextmanager
def timed_stage(report: RunReport, name: str, label: str) -> Iterator[Dict[str, Any]]:
    """Announce, time and record one stage; a failure is recorded as this stage's and re-raised."""
    say(f"{label} ...")
    facts: Dict[str, Any] = {}
    start = time.perf_counter()
    try:
        yield facts
    except BaseException as exc:
        seconds = round(time.perf_counter() - start, 3)
        status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
        report.stage(name, status, seconds, _one_line(exc))
        report.record("failed_stage", name)
        say(f"{label} {status} after {seconds:.1f} s")
        raise
    seconds = round(time.perf_counter() - start, 3)
    report.stage(name, "done", seconds, str(facts.get("detail", "")))
    say(f"{label} done in {seconds:.1f} s")


def _record_failure(report: RunReport, exc: BaseException) -> None:
    interrupted = isinstance(exc, KeyboardInterrupt)
    report.record("status", "interrupted" if interrupted else "failed")
    if report.get("failed_stage") is None:  # a step that records its own stages (zoo.lower) failed
        failed = [s["stage"] for s in report.stages if s["status"] == "failed"]
        report.record("failed_stage", failed[-1] if failed else None)
    report.record("error", {"type": type(exc).__name__, "message": getattr(exc, "message", str(exc)),
                            "hint": getattr(exc, "hint", None), "stage": report.get("failed_stage")})


def _finish(staging: Path, run_dir: Path, report: RunReport, keep: Optional[Tuple[str, ...]]) -> None:
    """Write the report into the staging folder, drop all but ``keep`` (on failure), move it into place."""
    report.record("run_dir", str(run_dir))
    report.record("finished", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    if keep is not None:
        for path in staging.iterdir():
            if path.name not in keep:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
    report.write()
    old = None
    if run_dir.exists():
        old = run_dir.with_name(f".{run_dir.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(run_dir, old)
    os.replace(staging, run_dir)
    report.run_dir = run_dir
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _remove_stale_staging(run_dir: Path) -> None:
    """Staging folders of runs that were killed (their process is gone) are removed."""
    for path in run_dir.parent.glob(f".{run_dir.name}.partial-*"):
        pid = path.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _import(module: str, what: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ZooError(f"the {what} step needs {module}, which cannot be imported: {exc}",
                       "update zoo; `python -m zoo.lower RUN_DIR` can run the GPU steps later") from exc


def _as_record(result: Any) -> Any:
    """A step result as JSON-ready report data: its summary(), a dataclass as a dict, or the value itself
    (how zoo.lower records lowering and audit results; tests build run folders with it)."""
    import dataclasses

    if hasattr(result, "summary") and callable(result.summary):
        return result.summary()
    if dataclasses.is_dataclass(result) and not isinstance(result, type):
        return dataclasses.asdict(result)
    return result


def _count_nodes(ep: ExportedProgram) -> int:
    return sum(1 for n in ep.graph.nodes if n.op == "call_function")


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted (Ctrl-C)"
    text = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    line = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return line if len(line) <= 160 else line[:157] + "..."
