"""Shared by the runner tests: a tiny recipe's run folder, made by the export's own CPU steps."""

from __future__ import annotations

from pathlib import Path

from zoo import atomic, pipeline
from zoo.report import RunReport


def export_run(recipe, run_dir: Path) -> Path:
    """The export's CPU steps into ``run_dir`` (the kernel preflight and the CPU check are left to the pipeline
    tests; ``zoo.lower.lower_run`` runs the preflight before lowering); returns the checkpoint folder."""
    report = RunReport(run_dir, recipe.to_dict())
    atomic.write_text(Path(run_dir) / "recipe.yaml", recipe.to_yaml())  # zoo.lower reads it
    with pipeline.source_environment(recipe, report):
        checkpoint = pipeline.pull_step(recipe, run_dir, report)
        unit = pipeline.build_step(checkpoint, recipe, run_dir, report)
        programs, _ = pipeline.export_step(unit, recipe, run_dir, report)
        rewritten = pipeline.rewrite_step(programs, recipe, report)
    pipeline.save_step(rewritten, recipe, run_dir, report)
    return checkpoint.path
