"""An attempt at writing a run folder (``python -m zoo.export``, ``python -m zoo lower``): staged beside the run,
put in place only when it got at least as far as the run there, else kept in ``attempts/`` with the run unchanged
(docs/ARCHITECTURE.md, "The run folder").
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from zoo.contract.run_folder import (ATTEMPTS_DIR, KEPT_ON_FAILURE, LOGGED_COMMANDS, MANIFEST_JSON, NOT_GOOD,
                                     PUBLISH_DIR, REPORT_JSON, REPORT_MD, RunFolder)
from zoo.core import atomic
from zoo.core.errors import StorageError, ZooError, storage_error
from zoo.core.progress import say
from zoo.core.report import RunReport, passed_stages




@dataclass
class Placement:
    """Where an attempt's files ended up, and why there."""

    placed: bool  # the attempt is the run folder now
    folder: Path  # the run folder, or attempts/<time>-<status>/ beside it
    run: Path  # the run folder
    earlier: Optional[str]  # the status of the run that was there (None: no run was there)
    reason: str = ""  # why the attempt was kept beside the run (or why --force replaced it)
    write_error: str = ""  # the attempt's report could not be written (disk full, ...): nothing was kept

    def describe(self, outcome: str) -> str:
        """One or two lines for the terminal: what became of the earlier run and where this attempt is."""
        if self.write_error:
            kept = (f"the earlier run in {self.run} is unchanged ({self.earlier})" if self.earlier
                    else f"nothing was written to {self.run}")
            return f"{kept}; this attempt's report could not be written: {self.write_error}"
        if self.placed:
            if self.reason:
                return f"{self.reason}; {self.run} holds this attempt now"
            return f"report: {self.folder / REPORT_MD}"
        return (f"the earlier run in {self.run} is unchanged ({self.earlier}): {self.reason}\n"
                f"this attempt ({outcome}) is kept in {self.folder} (report: {self.folder / REPORT_MD})")

    def as_dict(self) -> Dict[str, Any]:
        return {"placed": self.placed, "folder": str(self.folder), "earlier": self.earlier, "reason": self.reason}


class Attempt:
    """One attempt at writing a run folder (``python -m zoo.export``, ``python -m zoo lower``).

    ``begin`` stages it beside the folder; ``seed`` fills the staging with hard links to the run's files first
    (lowering works on a saved run) except the entries the attempt makes anew. ``finish`` decides where it goes:
    into the folder's place when the folder holds no good run, or when the attempt finished and passed at least
    every stage the run there had passed (``force`` waives that for a finished attempt); anywhere else the
    attempt goes to ``attempts/<time>-<status>/`` (a failed one keeping only ``KEPT_ON_FAILURE``), and the run
    folder is not touched. New stages get this for free: only the report's stage records are compared.
    """

    def __init__(self, run: RunFolder, staging: RunFolder, earlier: Optional[Dict[str, Any]], force: bool,
                 keep_on_failure: Optional[Sequence[str]], seeded: bool = False, rebuilt: Sequence[str] = ()):
        self.run, self.staging, self.earlier, self.force = run, staging, earlier, force
        self.keep_on_failure = keep_on_failure
        self.seeded, self.rebuilt = seeded, tuple(rebuilt)

    @classmethod
    def begin(cls, run_dir: Union[str, Path, RunFolder], *, force: bool = False, seed: bool = False,
              rebuilt: Sequence[str] = (), keep_on_failure: Optional[Sequence[str]] = KEPT_ON_FAILURE) -> "Attempt":
        """Stage an attempt at ``run_dir``. ``seed``: start from links to the saved run's files, except
        ``rebuilt`` (and what every attempt writes anew: report, manifest, publish/, attempts/, logs).
        ``keep_on_failure``: what a failed attempt keeps when it is put in place (None: all it has)."""
        run = RunFolder(run_dir).prepare(existing=seed)
        earlier = None
        if run.is_run():
            try:
                earlier = run.read_report().data
            except ZooError:  # a run whose report cannot be read is still protected: any failure goes aside
                earlier = {"status": "unreadable report", "stages": []}
        staging = run.new_staging()
        if seed:
            try:
                run.link_into(staging, sorted(set(_FRESH) | set(rebuilt)))
            except BaseException:
                shutil.rmtree(staging.path, ignore_errors=True)
                raise
        return cls(run, staging, earlier, force, keep_on_failure, seeded=seed, rebuilt=rebuilt)

    def relabel(self, text: Optional[str]) -> Optional[str]:
        """``text`` naming the run folder where it named the staging folder (a message the user reads after the
        staging folder is gone; lowering's staged files are links to the run's own)."""
        return text.replace(str(self.staging.path), str(self.run.path)) if text else text

    def relabel_error(self, exc: BaseException) -> None:
        if isinstance(exc, ZooError):
            exc.message, exc.hint = self.relabel(exc.message), self.relabel(exc.hint)
            exc.args = (exc.message,)

    def decide(self, report: RunReport, failed: bool) -> Placement:
        """Where the attempt goes (nothing is moved yet)."""
        earlier_status = None if self.earlier is None else self.earlier.get("status")
        status = report.get("status") or ("failed" if failed else "done")
        if self.earlier is None or earlier_status in NOT_GOOD:
            return Placement(True, self.run.path, self.run.path, earlier_status)
        aside = self.run.new_attempt_folder(status)
        if failed:
            stage = report.get("failed_stage")
            return Placement(False, aside, self.run.path, earlier_status,
                             f"this attempt {status}{f' during {stage}' if stage else ''}")
        missing = missing_stages(self.earlier, report.data)
        if not missing:
            return Placement(True, self.run.path, self.run.path, earlier_status)
        if self.force:
            return Placement(True, self.run.path, self.run.path, earlier_status,
                             f"--force: replaced a run that had passed {', '.join(missing)}")
        why = "; ".join(_stage_words(s) for s in report.stages if s["stage"] in missing)
        return Placement(False, aside, self.run.path, earlier_status,
                         f"it had passed {', '.join(missing)}, which this attempt did not ({why}); "
                         f"to replace it anyway, run the command again with --force")

    def finish(self, report: RunReport, failed: bool,
               on_decided: Optional[Callable[[Placement], None]] = None) -> Placement:
        """Write the report and put the attempt where ``decide`` says (``on_decided`` may record more in the
        report first, e.g. the next command). Ctrl-C cannot cut this in half. If the report cannot be written
        (disk full), nothing of the attempt is kept and the run folder is untouched."""
        with atomic.interrupts_deferred() as signals:
            placement = self._finish(report, failed, on_decided)
        if signals:
            say("Ctrl-C arrived while the attempt was being put away; that was finished first")
        return placement

    def _finish(self, report: RunReport, failed: bool, on_decided) -> Placement:
        placement = self.decide(report, failed)
        if failed and (not placement.placed or self.keep_on_failure is not None):
            self.staging.keep_only(self.keep_on_failure or KEPT_ON_FAILURE)
        elif failed and self.seeded:
            # A failed attempt on a saved run keeps the run's own files: what it had started to rebuild goes.
            for name in self.rebuilt:
                path = self.staging.path / name
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
            self.run.link_into(self.staging, [p.name for p in self.staging.path.iterdir()] + list(_FRESH))
        error = report.get("error")
        if error:
            error.update(message=self.relabel(error.get("message")), hint=self.relabel(error.get("hint")))
        for stage in report.stages:
            stage["detail"] = self.relabel(stage.get("detail"))
        report.record("run_dir", str(placement.folder))
        report.record("placement", placement.as_dict())
        report.record("finished", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        if on_decided is not None:
            on_decided(placement)
        try:
            self.staging.write_report(report)
            if placement.placed:
                self.run.replace_with(self.staging)
            else:
                placement.folder.parent.mkdir(parents=True, exist_ok=True)
                os.replace(self.staging.path, placement.folder)
        except (StorageError, OSError) as exc:
            refused = exc if isinstance(exc, StorageError) else storage_error(exc)
            if refused is None:
                raise
            shutil.rmtree(self.staging.path, ignore_errors=True)
            placement.write_error = self.relabel(refused.message) or refused.message
            return placement
        report.run_dir = placement.folder
        return placement

    def abandon(self) -> None:
        """Remove the staging folder (the attempt was refused before it wrote anything worth keeping)."""
        shutil.rmtree(self.staging.path, ignore_errors=True)


# What an attempt on a saved run writes anew, never taking the run's copy: its report, the manifest of what it
# verified, what publish staged from the old artifact, the attempts kept beside the run, the commands' logs.
_FRESH = (REPORT_JSON, REPORT_MD, MANIFEST_JSON, PUBLISH_DIR, ATTEMPTS_DIR) + tuple(f"{c}.log" for c in LOGGED_COMMANDS)


def missing_stages(earlier: Dict[str, Any], attempt: Dict[str, Any]) -> List[str]:
    """The stages the earlier run passed that the attempt ran (or recorded as skipped) without passing, in the
    earlier run's order. A stage the attempt has no record of is not part of its line (a local checkpoint
    needs no fabrication) and is not held against it."""
    recorded = {s["stage"]: s["status"] for s in attempt.get("stages", [])}
    return [stage for stage in passed_stages(earlier) if stage in recorded and recorded[stage] != "done"]


def _stage_words(stage: Dict[str, Any]) -> str:
    detail = stage.get("detail")
    return f"{stage['stage']} {stage['status']}" + (f" ({detail})" if detail else "")
