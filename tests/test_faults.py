"""Fault injection (issue 15), in CI: for each stage of the pipeline, SIGINT, SIGKILL and a full disk; damaged
model.pte / .ptd / .so / programs given to lower, audit, verify and publish; a truncated model.safetensors at
pull. Every case must give a clear message with no traceback and its documented exit code, and leave the earlier
good run byte for byte as it was (sha256 of every file). The cases and the wrapper that injects them are in
tests/support/faults.py; ``tools/fault_table.py`` prints the table, and the session ends with it.

The default run (``pytest -q``) takes one case per command and kind of fault (``faults.DEFAULT``); the whole
matrix runs with ``pytest -m e2e``.
"""

from __future__ import annotations

import json
import shutil

import pytest

from zoo.contract.run_folder import RunFolder
from zoo.core.atomic import remove_dead_leftovers
from zoo.policies.toy import unit as toy

from support import faults as fi
from support.environment import TEST_RECIPES

CASES = fi.all_cases()
PARAMS = [pytest.param(case, id=case.id, marks=() if fi.is_default(case) else pytest.mark.e2e) for case in CASES]


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return fi.forked_good_run(tmp_path_factory.mktemp("good"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The toy recipe's checkpoint as a local folder (the pull case truncates a copy of its weights)."""
    from zoo.contract.recipes import load_recipe

    recipe = load_recipe("toy-rope", recipes_dir=TEST_RECIPES)
    return toy.fabricate_checkpoint(recipe, tmp_path_factory.mktemp("ckpt"))[recipe.source.repo_id]


@pytest.mark.parametrize("case", PARAMS)
def test_fault(case, good, checkpoint, tmp_path, record_property):
    run = fi.copy_run(good, tmp_path / "runs")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint, ckpt)
    outcome = fi.run_case(case, run, ckpt, tmp_path / "logs")
    # The row of the table the session prints at its end (support/fault_report.py).
    record_property("fault_row", (CASES.index(case), outcome.row()))
    shown = f"\n--- stdout\n{outcome.stdout[-3000:]}\n--- stderr\n{outcome.stderr[-3000:]}"

    assert outcome.exit_code == case.exit_code, shown
    assert "Traceback" not in outcome.stdout + outcome.stderr, shown
    for words in case.words:
        assert words in outcome.stderr, shown
    if case.intact:
        assert outcome.intact, f"changed: {outcome.changed}{shown}"
    else:  # the attempt passed every stage the run had passed: it is the run now, verified
        assert RunFolder(run).status() == "verified", shown

    if case.fault == "SIGKILL":
        # A killed process leaves its staging folder; the next attempt (or publish) removes it, run untouched.
        before = fi.hashes(run)
        RunFolder(run).prepare(existing=True)
        remove_dead_leftovers(RunFolder(run).publish_dir)
        assert not [p for p in run.parent.iterdir() if p.name.startswith(f".{run.name}.")]
        assert not [p for p in run.iterdir() if p.name.startswith(".")]
        assert fi.hashes(run) == before
        return
    assert not outcome.leftovers, outcome.leftovers

    if case.fault == "SIGINT" and case.command in ("export", "lower"):
        # The interrupted attempt's report is kept beside the run, and the message says where.
        assert outcome.attempt is not None and outcome.attempt in outcome.stderr, shown
        data = json.loads((RunFolder(outcome.attempt).report_json).read_text())
        assert data["status"] == "interrupted" and data["failed_stage"] == case.recorded_stage
        assert f"interrupted during {case.recorded_stage}" in RunFolder(outcome.attempt).report_md.read_text()
    if case.fault == "ENOSPC" and case.command in ("export", "lower"):
        # The disk stays full: the attempt's report cannot be written either, and the message says so.
        assert "this attempt's report could not be written" in outcome.stderr, shown


def test_the_cases_cover_every_stage_and_fault():
    """The table covers every stage of both commands with all three faults, and every damaged file kind."""
    cases = fi.all_cases()
    for command, stages in (("export", fi.EXPORT_STAGES), ("lower", fi.LOWER_STAGES), ("publish", ("publish",))):
        for stage in stages:
            assert {c.fault for c in cases if c.command == command and c.stage == stage} == {
                "SIGINT", "SIGKILL", "ENOSPC"}
    damaged = {(c.command, c.fault.split(" ", 1)[1]) for c in cases if not c.stage}
    for command in ("verify", "audit", "publish"):
        for name in ("model.pte", "aoti_cuda_blob.ptd", "so/forward.so"):
            assert (command, name) in damaged or (command == "audit" and name == "so/forward.so")
    assert ("export", "model.safetensors") in damaged and ("audit-so", "so/forward.so") in damaged


def test_the_default_run_takes_one_case_per_command_and_kind_of_fault():
    """Every (command, kind of fault) of the matrix has exactly one case in the default run, and each entry of
    faults.DEFAULT names a case of the matrix."""
    cases = fi.all_cases()
    kinds = {fi.kind_of(c) for c in cases}
    chosen = [fi.kind_of(c) for c in cases if fi.is_default(c)]
    assert sorted(chosen) == sorted(kinds) == sorted(fi.DEFAULT)
    assert {"SIGINT", "SIGKILL", "ENOSPC", "truncated", "corrupt"} == {kind for _, kind in kinds}
