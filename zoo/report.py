"""The run report: every step records what it did (counts, times, reasons) into one report, kept in memory
while a run goes on and written as JSON + Markdown into the run folder (``zoo.run_folder``).

Sections are plain dicts keyed by step name, so steps stay independent: ``report.record("lower", {...})``.
``stages`` keeps, in order, each step's status ("done", "skipped", "failed", "interrupted") and time, which the
final summary table prints. ``timed_stage`` is the one stage recorder every step runs under.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

from .errors import NoGpuError, first_line
from .progress import say


class RunReport:
    def __init__(self, run_dir: Path, recipe: Optional[dict] = None):
        self.run_dir = Path(run_dir)
        self.data: Dict[str, Any] = {"recipe": recipe, "stages": [], "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}

    @classmethod
    def from_data(cls, run_dir: Path, data: Dict[str, Any]) -> "RunReport":
        """A report continued from what a run folder holds (``RunFolder.read_report``)."""
        report = cls(run_dir)
        report.data = data
        return report

    @property
    def stages(self) -> List[Dict[str, Any]]:
        return self.data["stages"]

    def stage(self, name: str, status: str, seconds: Optional[float] = None, detail: str = "") -> None:
        """Record a stage outcome; a later record of the same stage replaces the earlier one."""
        self.data["stages"] = [s for s in self.stages if s["stage"] != name]
        self.stages.append({"stage": name, "status": status, "seconds": seconds, "detail": detail})

    def record(self, section: str, value: Any) -> None:
        self.data[section] = value

    def get(self, section: str, default: Any = None) -> Any:
        return self.data.get(section, default)

    # --- rendering -------------------------------------------------------------------------------------

    def summary_table(self) -> str:
        rows = [["stage", "status", "time", "detail"]]
        for s in self.stages:
            t = "" if s.get("seconds") is None else f"{s['seconds']:.1f} s"
            rows.append([s["stage"], s["status"], t, s.get("detail", "")])
        return format_table(rows)

    def markdown(self) -> str:
        recipe = (self.data.get("recipe") or {}).get("name", "?")
        out = [f"# zoo run: {recipe}", "", "## Stages", "", markdown_table(
            [["stage", "status", "time (s)", "detail"]]
            + [[s["stage"], s["status"], "" if s.get("seconds") is None else f"{s['seconds']:.1f}", s.get("detail", "")]
               for s in self.stages]), ""]
        for section, title in (("rewrites", "Rewrites"), ("cpu_check", "CPU check against eager"),
                               ("lowering", "Lowering"), ("audit", "Runtime audit"), ("verification", "Verification"),
                               ("policy_check", "Policy check against LeRobot's select_action")):
            value = self.data.get(section)
            if value:
                out += [f"## {title}", ""]
                if isinstance(value, dict) and isinstance(value.get("table"), str):  # a step's own text table
                    out += ["```", value["table"], "```", ""]
                for part in (value.values() if isinstance(value, dict) else ()):  # tables one level down
                    if isinstance(part, dict) and isinstance(part.get("table"), str):
                        out += ["```", part["table"], "```", ""]
                out += ["```json", json.dumps(value, indent=2, default=str), "```", ""]
        return "\n".join(out)


# --- the stage recorder ------------------------------------------------------------------------------------


@contextlib.contextmanager
def timed_stage(report: RunReport, name: str, label: str) -> Iterator[Dict[str, Any]]:
    """Announce, time and record one stage of a run; every step of the pipeline runs under it.

    The step puts its one-line outcome in ``facts["detail"]``. A failure is recorded as this stage's and
    re-raised, with ``facts["failure"]`` as its detail when the step set one, else the error's first line.
    A ``NoGpuError`` (the stage needs a CUDA device this machine lacks) records the stage as skipped.
    """
    say(f"{label} ...")
    facts: Dict[str, Any] = {}
    start = time.perf_counter()
    try:
        yield facts
    except NoGpuError as exc:
        report.stage(name, "skipped", None, exc.message)
        say(f"{label} skipped: {exc.message}")
        raise
    except BaseException as exc:
        seconds = round(time.perf_counter() - start, 3)
        interrupted = isinstance(exc, KeyboardInterrupt)
        status = "interrupted" if interrupted else "failed"
        detail = "interrupted (Ctrl-C)" if interrupted else (facts.get("failure") or first_line(exc, limit=160))
        report.stage(name, status, seconds, detail)
        report.record("failed_stage", name)
        say(f"{label} {status} after {seconds:.1f} s")
        raise
    seconds = round(time.perf_counter() - start, 3)
    report.stage(name, "done", seconds, str(facts.get("detail", "")))
    say(f"{label} done in {seconds:.1f} s")


def record_failure(report: RunReport, exc: BaseException) -> None:
    """Mark the run failed (or interrupted) and record the error with the stage it happened in."""
    interrupted = isinstance(exc, KeyboardInterrupt)
    report.record("status", "interrupted" if interrupted else "failed")
    if report.get("failed_stage") is None:  # the error came from outside a stage, or a stage recorded by hand
        failed = [s["stage"] for s in report.stages if s["status"] == "failed"]
        report.record("failed_stage", failed[-1] if failed else None)
    report.record("error", {"type": type(exc).__name__, "message": getattr(exc, "message", str(exc)),
                            "hint": getattr(exc, "hint", None), "stage": report.get("failed_stage")})


# --- rendering helpers ---------------------------------------------------------------------------------------


def format_table(rows: List[List[Any]]) -> str:
    """A fixed-width text table; the first row is the header."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows: List[List[Any]]) -> str:
    cells = [[str(c).replace("|", "\\|") for c in row] for row in rows]
    lines = ["| " + " | ".join(cells[0]) + " |", "|" + "|".join("---" for _ in cells[0]) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in cells[1:]]
    return "\n".join(lines)
