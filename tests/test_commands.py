"""The command lines as a person meets them: every command's --help documents its exit codes,
`zoo doctor RUN` takes run folders as positional arguments and says why it exits 1, `zoo list` wraps its notes
instead of cutting them, and report.md opens with the status, what ran, what was skipped and why, and the
next command, in compact tables with no JSON."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import zoo.__main__ as zoo_main
from zoo.cli import doctor
from zoo.contract.recipes import load_recipe, recipe_names
from zoo.core.report import RunReport
from zoo.contract.run_folder import RunFolder

COMMANDS = ["export", "lower", "audit", "publish", "bench", "bundle", "doctor", "prompt", "act"]


@pytest.mark.parametrize("command", COMMANDS + ["list", None])
def test_every_command_documents_its_exit_codes(command, capsys):
    argv = ([command] if command else []) + ["--help"]
    with pytest.raises(SystemExit) as done:
        zoo_main.main(argv)
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "exit status:" in out
    codes = re.findall(r"^  (\d+)\s", out.split("exit status:")[1], re.M)
    assert "0" in codes and "2" in codes, out
    if command in ("export", "lower"):  # the commands that write a run folder
        assert {"3", "4", "130"} <= set(codes) and "attempts/" in out
        # verification's runtimes: exit 3 covers the ExecuTorch runtime failing where the audit said it can
        assert "--runtime" in out and "--et-runner" in out and "ExecuTorch's runtime" in out


def finished_cpu_run(folder: Path, name: str = "toy") -> Path:
    run = RunFolder(folder / name)
    run.path.mkdir(parents=True)
    report = RunReport(run.path, {"name": name})
    for stage in ("pull", "build", "export", "rewrite", "cpu_check", "save", "preflight"):
        report.stage(stage, "done", 1.0, "")
    for stage in ("lower", "audit", "verify"):
        report.stage(stage, "skipped", None, "needs a CUDA GPU; this machine has none")
    report.record("status", "done")
    run.write_report(report)
    return run.path


def test_doctor_takes_run_folders_as_arguments_and_a_cpu_run_is_healthy(tmp_path, capsys):
    run = finished_cpu_run(tmp_path)
    assert doctor.main([str(run)]) == 0
    out, err = capsys.readouterr()
    assert re.search(r"verification\s+skipped\s+needs a CUDA GPU", out) and not err
    assert doctor.main(["--runs", str(run)]) == 0  # the old spelling still works
    assert doctor.main(["--require-verified", str(run)]) == 1
    assert "not verified (verification skipped" in capsys.readouterr().err


def test_doctor_says_why_it_exits_1(tmp_path, capsys):
    good = finished_cpu_run(tmp_path, "good")
    failed = finished_cpu_run(tmp_path, "failed")
    data = json.loads((failed / "report.json").read_text())
    data.update(status="failed", failed_stage="export", error={"message": "torch.export failed: boom"})
    (failed / "report.json").write_text(json.dumps(data))
    attempt = good / "attempts" / "20990101-000000-interrupted"
    attempt.mkdir(parents=True)
    (attempt / "report.json").write_text(json.dumps({"status": "interrupted", "failed_stage": "pull",
                                                     "stages": [], "error": {"message": "interrupted during pull"}}))
    (tmp_path / "none").mkdir()  # a folder, but no run in it
    assert doctor.main([str(good), str(failed), str(tmp_path / "none")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert f"problem: {failed}: failed during export: torch.export failed: boom" in err
    assert any(line.startswith(f"problem: {good}: its latest attempt ({attempt}) interrupted during pull")
               for line in err)
    assert any(line.startswith(f"problem: {tmp_path / 'none'}: no report.json") for line in err)


def test_doctor_refuses_a_run_folder_that_does_not_exist(tmp_path, capsys):
    assert doctor.main([str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert f"no such run folder: {tmp_path / 'nope'}" in err and "what to do" in err


def test_list_wraps_notes_instead_of_cutting_them(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "150")
    assert zoo_main.main(["list"]) == 0
    out = capsys.readouterr().out
    assert all(len(line) <= 150 for line in out.splitlines()), out
    text = " ".join(out.split())
    for name in recipe_names():
        notes = load_recipe(name).summary()["notes"]
        assert "..." not in notes
        for word in notes.split():  # every word of every note is printed, in order
            assert word in text


def report_of(status: str, **sections) -> RunReport:
    report = RunReport(Path("/runs/toy"), {"name": "toy"})
    report.stage("pull", "done", 1.25, "zoo-test/toy@main")
    report.stage("export", "done", 2.0, "forward: 34 nodes")
    report.record("status", status)
    for key, value in sections.items():
        report.record(key, value)
    return report


def test_report_md_of_a_finished_cpu_run_starts_with_status_skipped_and_next():
    report = report_of("done", next={"command": "python -m zoo lower /runs/toy", "why": "on a GPU machine"},
                       cpu_check={"compared": 2, "failed": 0, "rule": "float32: rel L2 vs eager <= 1e-05",
                                  "cases": [{"seed": 0, "sizes": {}, "comparisons": [
                                      {"name": "forward.y", "rel_l2": 2e-7, "max_abs": 1e-6, "cosine": 1.0,
                                       "ok": True}]}, {"seed": 1, "sizes": {}, "comparisons": [
                                          {"name": "forward.y", "rel_l2": 3e-7, "max_abs": 2e-6, "cosine": 0.999,
                                           "ok": True}]}]})
    report.stage("lower", "skipped", None, "needs a CUDA GPU; this machine has none")
    report.stage("verify", "skipped", None, "needs a CUDA GPU; this machine has none")
    lines = report.markdown().splitlines()
    assert lines[:7] == ["# zoo run: toy", "", "**Status: done**", "",
                         "- ran: pull, export (3.2 s)",
                         "- skipped: lower, verify: needs a CUDA GPU; this machine has none",
                         "- next: `python -m zoo lower /runs/toy` (on a GPU machine)"]
    md = "\n".join(lines)
    assert "| forward.y | 2 | 3.000e-07 | 2.000e-06 | 0.999000 | ok |" in md  # the worst case of each output
    assert "{" not in md and "```json" not in md  # no JSON dump: report.json keeps everything


def test_report_md_of_a_failed_and_of_an_interrupted_run():
    failed = report_of("failed", failed_stage="cpu_check",
                       error={"message": "CPU check: the rewritten program differs\nsecond line",
                              "hint": "see the table", "stage": "cpu_check"},
                       next={"command": "python -m zoo.export toy", "why": "once the error above is fixed"})
    head = failed.headline()
    assert head[0] == "**Status: failed during cpu_check: CPU check: the rewritten program differs**"
    assert "- what to do: see the table" in head and head[-1].startswith("- next: `python -m zoo.export toy`")
    interrupted = report_of("interrupted", failed_stage="export",
                            error={"message": "interrupted during export (Ctrl-C)"})
    assert interrupted.headline()[0] == "**Status: interrupted during export (Ctrl-C)**"
