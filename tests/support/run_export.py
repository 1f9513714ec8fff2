"""Shared by the runner tests: a tiny recipe's run folder, made by the export's own CPU steps."""

from __future__ import annotations

from pathlib import Path

from zoo.export import pipeline
from zoo.core.report import RunReport
from zoo.contract.run_folder import RunFolder


def export_run(recipe, run_dir: Path) -> Path:
    """The export's CPU steps into ``run_dir`` (the CPU check, the policy check and the kernel preflight are left
    to their own tests); returns the checkpoint folder."""
    run = RunFolder(run_dir)
    run.path.mkdir(parents=True, exist_ok=True)
    report = RunReport(run.path, recipe.to_dict())
    run.write_recipe(recipe)  # zoo.lower and zoo prompt read it
    with pipeline.source_environment(recipe, report):
        checkpoint = pipeline.pull_step(recipe, run, report)
        unit = pipeline.build_step(checkpoint, recipe, run, report)
        programs, _ = pipeline.export_step(unit, recipe, run, report)
        rewritten = pipeline.rewrite_step(programs, recipe, report)
    pipeline.save_step(rewritten, recipe, run, report)
    run.write_report(report)
    return checkpoint.path
