#!/usr/bin/env python3
"""Real size, end to end, with seeded weights and no network: one recipe's methods built, exported, rewritten,
lowered side by side with one constant table, assembled, audited, verified, benched, and the artifact's sizes
set against the parameter bytes the methods use.

    python benchmarks/real_size.py --out OUT [--recipe lingbot-va] [--methods video_step,action_step]
    python benchmarks/real_size.py --out OUT --dry-run [...]    # the same path on lingbot-va-tiny, on the CPU

The stages, OUT's files and the dry run: benchmarks/README.md, "real_size.py".
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

from zoo import bench
from zoo.bench import seeded
from zoo.contract.recipes import load_recipe
from zoo.contract.run_folder import RunFolder
from zoo.core import atomic
from zoo.core.report import RunReport, format_table, record_failure
from zoo.export import pipeline
from zoo.export import stages as gpu_steps
from zoo.export.lower.method_lowering import CUDA_LOWERING, MethodLowering
from zoo.export.lower.workers import ENV_PROFILE_DIR, resolve_function


class Progress:
    """Timestamped lines in OUT/progress.log (and on stderr), one "start" and one "end" per stage."""

    def __init__(self, path: Path):
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def say(self, line: str) -> None:
        text = f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {line}"
        print(f"[real_size] {text}", file=sys.stderr, flush=True)
        with open(self.path, "a") as fh:
            fh.write(text + "\n")

    @contextlib.contextmanager
    def stage(self, name: str, seconds: Dict[str, float]) -> Iterator[None]:
        self.say(f"start {name}")
        start = time.perf_counter()
        try:
            yield
        except BaseException as exc:
            seconds[name] = round(time.perf_counter() - start, 3)
            self.say(f"end {name} FAILED after {seconds[name]:.1f} s: {bench.error_line(exc)}")
            raise
        seconds[name] = round(time.perf_counter() - start, 3)
        self.say(f"end {name} {seconds[name]:.1f} s")


def parameter_bytes(unit) -> int:
    """Every parameter and buffer of the unit's modules, a shared one once."""
    holder = torch.nn.ModuleList([m.module for m in unit.methods.values()])
    tensors = {id(t): t for t in [*holder.parameters(), *holder.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def worst_agreement(verified, method: str) -> Dict[str, Any]:
    rows = [r for r in verified.rows if r.method == method and r.rel_l2 is not None]
    if not rows:
        return {}
    worst = max(rows, key=lambda r: r.rel_l2)
    return {"worst_rel_l2": worst.rel_l2, "worst_rel_l2_output": worst.output,
            "min_cosine": min(r.cosine for r in rows if r.cosine is not None) if any(
                r.cosine is not None for r in rows) else None,
            "reference": worst.reference, "eager_rel_l2": worst.eager_rel_l2, "tolerance": worst.tolerance,
            "outputs": len(rows), "ok": all(r.ok for r in verified.rows if r.method == method)}


def cpu_runner_factory(spec: Optional[str]):
    """The runner verification runs the .so files in (``"module:name"``, importable from PYTHONPATH), for a
    lowering that compiles for the CPU; None: zoo's CUDA runner."""
    return resolve_function(spec) if spec else None


def run(args) -> int:
    """Every stage of one recipe at real size (or, with ``--dry-run``, its tiny recipe on the CPU) into OUT;
    OUT/summary.* after every stage. 0 when every stage passed, 1 when verification failed."""
    out = args.out.expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    progress = Progress(out / "progress.log")
    recipe_name, recipe, methods = selected_recipe(args)
    device = "cpu" if args.dry_run else bench.resolve_device(args.device)
    method_lowering = (MethodLowering(function=args.method_lowering, needs_gpu=False)
                       if args.method_lowering else CUDA_LOWERING)
    os.environ.setdefault(ENV_PROFILE_DIR, str(out / "profiles"))
    run_folder = RunFolder(out / "run")
    run_folder.path.mkdir(parents=True, exist_ok=True)
    report = RunReport(run_folder.path, recipe.to_dict())
    run_folder.write_recipe(recipe)
    seconds: Dict[str, float] = {}
    summary = new_summary(args, recipe_name, methods, device, run_folder, seconds)

    def flush() -> None:
        run_folder.write_report(report)
        atomic.write_json(out / "summary.json", summary)
        atomic.write_text(out / "summary.txt", summary_text(summary))

    progress.say(f"real size: {recipe_name} {','.join(methods)} on {device} -> {out}")
    try:
        unit, lowered = export_and_lower(args, recipe, methods, method_lowering, run_folder, report, progress,
                                         seconds, summary, flush)
        verify_stage(args, unit, recipe, run_folder, report, device, progress, seconds, summary)
        flush()
        if not args.no_bench:
            bench_stage(args, unit, recipe, run_folder, device, progress, seconds, summary, flush)
        with progress.stage("sizes", seconds):
            summary["sizes"] = sizes(run_folder, summary, lowered)
        summary["status"] = "done" if summary.get("verified", True) else "verification failed"
        # The run folder's own report says what its artifact is (report.md's headline read "Status: ?").
        report.record("status", "lowered" if args.no_verify else
                      "verified" if summary.get("verified") else "failed")
    except BaseException as exc:
        summary["status"] = "failed"
        summary["error"] = bench.error_line(exc)
        record_failure(report, exc)
        flush()
        raise
    finally:
        progress.say(f"finished: {summary['status']}")
        flush()
    print(summary_text(summary))
    return 0 if summary["status"] == "done" else 1


def selected_recipe(args):
    """(recipe name, recipe, methods): the recipe (its tiny one for ``--dry-run``) cut to ``--methods``."""
    recipe_name = f"{args.recipe}-tiny" if args.dry_run else args.recipe
    recipe = load_recipe(recipe_name)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else list(recipe.unit.methods)
    recipe.unit.methods = methods
    recipe.validate()
    return recipe_name, recipe, methods


def new_summary(args, recipe_name: str, methods: List[str], device: str, run_folder: RunFolder,
                seconds: Dict[str, float]) -> Dict[str, Any]:
    """OUT/summary.json before the first stage; ``seconds`` fills in as the stages end."""
    return {
        "recipe": recipe_name, "methods": methods, "device": device, "dry_run": args.dry_run,
        "command": "python benchmarks/real_size.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "environment": bench.environment(device), "run_folder": str(run_folder.path), "stage_seconds": seconds,
        "per_method": {m: {} for m in methods}, "status": "running"}


def export_and_lower(args, recipe, methods: List[str], method_lowering: MethodLowering, run_folder: RunFolder,
                     report: RunReport, progress: Progress, seconds: Dict[str, float], summary: Dict[str, Any],
                     flush: Callable[[], None]):
    """The build, export, rewrite, lower and audit stages; returns (the unit, the lowering's result)."""
    with progress.stage("build", seconds):
        spec = seeded.spec_for_recipe(recipe)
        # The family builds the methods the recipe names: only the selected ones (no real-size VAE when
        # only the DiT steps are asked for).
        with tempfile.TemporaryDirectory(prefix="zoo-real-size-build-") as work:
            unit = pipeline.build_step(None, recipe, run_folder, report, build=lambda: seeded.selected_methods(
                seeded.build_unit(spec, recipe, Path(work)), methods))
        summary["parameter_bytes"] = parameter_bytes(unit)
    flush()
    with progress.stage("export", seconds):
        programs, _ = pipeline.export_step(unit, recipe, run_folder, report, save=False, reference=False)
    flush()
    with progress.stage("rewrite", seconds):
        rewritten = pipeline.rewrite_step(programs, recipe, report)
        del programs
        gc.collect()
    flush()
    with progress.stage("lower", seconds):
        lowered = gpu_steps.lower_step(rewritten, run_folder, recipe, report, method_lowering=method_lowering,
                                       consume=True, say=progress.say, workers=args.workers)
        del rewritten
        gc.collect()
    record_lowering(summary, lowered)
    flush()
    with progress.stage("audit", seconds):
        audited = gpu_steps.audit_step(run_folder, recipe, report)
        summary["audit"] = {"loadable": audited.loadable_releases(), "caveats": audited.caveats,
                            "weights": audited.weights}
    flush()
    return unit, lowered


def record_lowering(summary: Dict[str, Any], lowered) -> None:
    """The lowering's wall time, workers and weights, and each method's compile, into the summary."""
    summary["lowering"] = {"seconds": lowered.seconds, "methods_wall_seconds": lowered.compile_seconds,
                           "stage_seconds": lowered.stage_seconds, "workers": lowered.workers,
                           "weights": lowered.weights}
    for m, art in lowered.methods.items():
        summary["per_method"][m].update(lower_seconds=art.seconds, lower_stages=art.stage_seconds,
                                        so_bytes=art.so_bytes, weights_bytes=art.weights_bytes,
                                        shares_weights_with=art.shares_weights_with)


def verify_stage(args, unit, recipe, run_folder: RunFolder, report: RunReport, device: str, progress: Progress,
                 seconds: Dict[str, float], summary: Dict[str, Any]) -> None:
    """zoo's verification with the references built where they run (``gpu_steps.verify_unit_step``): the
    unit's modules moved to ``device`` and a float32 copy made there (~20 GB at real size, on the GPU)."""
    if args.no_verify:
        report.stage("verify", "skipped", None, "--no-verify")
        return
    with progress.stage("verify", seconds):
        try:
            verified = gpu_steps.verify_unit_step(run_folder, recipe, report, unit, device=device,
                                                  runtimes=["aoti"] if args.dry_run else None,
                                                  runner_factory=cpu_runner_factory(args.runner_factory))
            summary["verified"] = True
        except Exception as exc:
            verified = getattr(exc, "result", None)
            summary["verified"] = False
            summary["verify_error"] = bench.error_line(exc)
            if verified is None:
                raise
        summary["verification"] = {"seconds": round(verified.seconds, 3), "rows": len(verified.rows),
                                   "ok": verified.ok,
                                   "runtimes": {name: outcome.get("status") for name, outcome in verified.runtimes.items()}}
        for m in unit.methods:
            summary["per_method"][m]["verify"] = worst_agreement(verified, m)


def bench_stage(args, unit, recipe, run_folder: RunFolder, device: str, progress: Progress,
                seconds: Dict[str, float], summary: Dict[str, Any], flush: Callable[[], None]) -> None:
    """Eager, torch.compile and the artifact on the same inputs (``zoo.bench``), one method after another."""
    io_spec = run_folder.read_io_spec()
    cases = bench.size_cases(io_spec, {})
    dynamic = True if recipe.dynamic else None
    for m in unit.methods:
        with progress.stage(f"bench {m}", seconds):
            cands = seeded.unit_candidates(unit, m, run_folder.path, device,
                                                    not args.no_compile and device != "cpu", dynamic)
            if device == "cpu":  # the artifact's .so is the CPU probe's: the CUDA runner cannot load it
                cands = [c for c in cands if c.name == "eager"]
            results = bench.bench_method(m, unit.methods[m].inputs, cases, cands, args.warmup, args.runs, device,
                                         args.input_sets)
        summary["per_method"][m]["bench"] = [bench_row(r) for r in results]
        flush()


def bench_row(result: Dict[str, Any]) -> Dict[str, Any]:
    def median_ms(name: str) -> Optional[float]:
        stats = (result["candidates"].get(name) or {}).get("stats")
        return stats["median"] if stats else None  # zoo.bench records milliseconds

    def peak(name: str) -> Optional[int]:
        return (result["candidates"].get(name) or {}).get("peak_bytes")

    errors = {n: c.get("error") or c.get("skipped") for n, c in result["candidates"].items()
              if c.get("error") or c.get("skipped")}
    return {"sizes": result["sizes"], "median_ms": {n: median_ms(n) for n in ("eager", "compile", "artifact")},
            "peak_bytes": {n: peak(n) for n in ("eager", "compile", "artifact")}, "ratios": result.get("ratios"),
            "agreement": result.get("agreement"), "not_timed": errors}


def sizes(run_folder: RunFolder, summary: Dict[str, Any], lowered) -> Dict[str, Any]:
    """The artifact's files against the bytes of the constants the methods read (the plan's union)."""
    plan = (lowered.weights or {}).get("plan") or {}
    used = plan.get("bytes")
    ptd = run_folder.ptd.stat().st_size if run_folder.ptd.exists() else 0
    so_files = {p.name: p.stat().st_size for p in sorted(run_folder.so_dir.glob("*")) if p.is_file()}
    return {"pte_bytes": run_folder.pte.stat().st_size, "ptd_bytes": ptd, "so_dir": so_files,
            "constants_read_bytes": used, "constants_read_per_method_bytes": plan.get("read_bytes"),
            "parameter_bytes": summary.get("parameter_bytes"),
            "ptd_over_constants_read": round(ptd / used, 4) if used else None,
            "weights_stored_once": (lowered.weights or {}).get("stored_once")}


def _fmt(value: Any, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


def summary_text(s: Dict[str, Any]) -> str:
    """The per-method table, in plain text."""
    lines = [f"{s['recipe']} {','.join(s['methods'])} on {s['device']}: {s['status']}"
             + (f" ({s['error']})" if s.get("error") else "")]
    lines.append("stages: " + ", ".join(f"{k} {v:.1f} s" for k, v in s["stage_seconds"].items()))
    low = s.get("lowering")
    if low:
        lines.append(f"lowering: {low['seconds']:.1f} s wall, methods {low['methods_wall_seconds']:.1f} s "
                     f"({low['workers'].get('count')} at once: {low['workers'].get('why')}); "
                     + ", ".join(f"{k} {v:.1f} s" for k, v in low["stage_seconds"].items()))
    rows = [["method", "lower s", "worst rel L2", "min cosine", "eager ms", "compile ms", "artifact ms",
             "art/eager", "art/compile", "peak MiB eager/compile/art", ".so MiB", "weights MiB"]]
    for m, p in s["per_method"].items():
        v = p.get("verify") or {}
        b = (p.get("bench") or [{}])[0]
        ms, peak, ratios = b.get("median_ms") or {}, b.get("peak_bytes") or {}, b.get("ratios") or {}
        rows.append([m, _fmt(p.get("lower_seconds"), ".1f"), _fmt(v.get("worst_rel_l2")), _fmt(v.get("min_cosine"), ".6f"),
                     _fmt(ms.get("eager"), ".2f"), _fmt(ms.get("compile"), ".2f"), _fmt(ms.get("artifact"), ".2f"),
                     _fmt(ratios.get("artifact/eager"), ".2f"), _fmt(ratios.get("artifact/compile"), ".2f"),
                     "/".join(_fmt(peak.get(n) / 2**20 if peak.get(n) else None, ".0f")
                              for n in ("eager", "compile", "artifact")),
                     _fmt(p.get("so_bytes", 0) / 2**20 if p.get("so_bytes") else None, ".1f"),
                     _fmt(p.get("weights_bytes", 0) / 2**20 if p.get("weights_bytes") else None, ".1f")
                     + (f" (= {p['shares_weights_with']})" if p.get("shares_weights_with") else "")])
    lines.append(format_table(rows))
    z = s.get("sizes")
    if z:
        lines.append(f"sizes: model.pte {z['pte_bytes'] / 2**20:.1f} MiB, .ptd {z['ptd_bytes'] / 2**20:.1f} MiB, "
                     f"constants the methods read {_fmt((z['constants_read_bytes'] or 0) / 2**20, '.1f')} MiB, "
                     f".ptd / constants read = {_fmt(z['ptd_over_constants_read'], '.3f')} (target <= 1.05), "
                     f"weights stored once: {z['weights_stored_once']}; all parameters and buffers "
                     f"{_fmt((z['parameter_bytes'] or 0) / 2**20, '.1f')} MiB")
    if s.get("verification"):
        lines.append(f"verification: {s['verification']['rows']} outputs, ok={s['verification']['ok']}, "
                     f"{s['verification']['seconds']:.1f} s; runtimes: "
                     + ", ".join(f"{name} {status}" for name, status in s['verification']['runtimes'].items()))
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benchmarks/real_size.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output folder (progress.log, summary.*, run/)")
    p.add_argument("--recipe", default="lingbot-va", help="recipe name (default lingbot-va)")
    p.add_argument("--methods", default=None, help="comma-separated methods (default: the recipe's)")
    p.add_argument("--workers", type=int, default=None,
                   help="methods lowered at once (default: one per method as cores and memory allow)")
    p.add_argument("--device", default=None, help="cuda (default where present)")
    p.add_argument("--runs", type=int, default=20, help="timed calls per candidate (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first (default 3)")
    p.add_argument("--input-sets", type=int, default=None, help="input sets to rotate through (default: auto)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile candidate")
    p.add_argument("--no-verify", action="store_true", help="skip zoo's verification")
    p.add_argument("--no-bench", action="store_true", help="skip the bench")
    p.add_argument("--dry-run", action="store_true",
                   help="the tiny recipe (<recipe>-tiny) on the CPU (checks this script)")
    p.add_argument("--method-lowering", default=None, metavar="MODULE:FUNCTION",
                   help="lower each method with this zoo.export.lower.workers function instead of the CUDA lowering "
                        "(one that compiles for the CPU lets a dry run go on to assembly, audit and verification)")
    p.add_argument("--runner-factory", default=None, metavar="MODULE:NAME",
                   help="the zoo.export.verify runner factory for such a lowering's .so files (both are imported "
                        "from PYTHONPATH)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    bench.check_counts(args.runs, args.warmup, args.input_sets)
    return run(args)


if __name__ == "__main__":
    from zoo.cli.common import guarded

    sys.exit(guarded(main))
