"""The run report: every step records what it did (counts, times, reasons) into one report, kept in memory
while a run goes on and written as JSON + Markdown into the run folder (``zoo.contract.run_folder``).

Sections are plain dicts keyed by step name, so steps stay independent: ``report.record("lower", {...})``.
``stages`` keeps, in order, each step's status ("done", "skipped", "failed", "interrupted") and time, which the
final summary table prints. ``timed_stage`` is the one stage recorder every step runs under.

``report.json`` keeps everything; ``report.md`` is for people: its first lines say the status, what ran, what
was skipped and why, and the exact next command (``headline``), then compact tables, no JSON.
"""

from __future__ import annotations

import contextlib
import textwrap
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

from zoo.core.errors import NoGpuError, first_line, storage_error
from zoo.core.progress import say

FINISHED = ("done", "lowered", "verified")  # statuses of a run that ended without error


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

    def stage_names(self, status: str) -> List[str]:
        return [s["stage"] for s in self.stages if s["status"] == status]

    def headline(self) -> List[str]:
        """What a person reads first: the status, what ran, what was skipped and why, the next command."""
        status = self.get("status") or "?"
        stage = self.get("failed_stage")
        error = self.get("error") or {}
        placement = self.get("placement") or {}
        if status == "interrupted":
            title = error.get("message") or (f"interrupted during {stage}" if stage else "interrupted")
        elif status == "failed":
            title = (f"failed during {stage}" if stage else "failed") + f": {first_line(error.get('message') or '?')}"
        else:
            title = status
        if status in FINISHED and placement and not placement.get("placed", True):
            title += ", kept beside the earlier run: " + str(placement.get("reason", ""))
        lines = [f"**Status: {title}**", ""]
        ran = self.stage_names("done")
        seconds = sum(s.get("seconds") or 0.0 for s in self.stages)
        lines.append(f"- ran: {', '.join(ran) or 'nothing'}" + (f" ({seconds:.1f} s)" if ran else ""))
        skipped: Dict[str, List[str]] = {}
        for s in self.stages:
            if s["status"] == "skipped":
                skipped.setdefault(s.get("detail") or "no reason recorded", []).append(s["stage"])
        for why, names in skipped.items():
            lines.append(f"- skipped: {', '.join(names)}: {why}")
        if status not in FINISHED and error.get("hint"):
            lines.append(f"- what to do: {error['hint']}")
        nxt = self.get("next") or {}
        if nxt.get("command"):
            lines.append(f"- next: `{nxt['command']}`" + (f" ({nxt['why']})" if nxt.get("why") else ""))
        return lines

    def markdown(self) -> str:
        recipe = (self.data.get("recipe") or {}).get("name", "?")
        out = [f"# zoo run: {recipe}", ""] + self.headline() + ["", "## Stages", "", markdown_table(
            [["stage", "status", "time (s)", "detail"]]
            + [[s["stage"], s["status"], "" if s.get("seconds") is None else f"{s['seconds']:.1f}", s.get("detail", "")]
               for s in self.stages]), ""]
        for section, title, render in SECTIONS:
            value = self.data.get(section)
            if value:
                body = render(value)
                if body:
                    out += [f"## {title}", "", body, ""]
        out += ["Everything above, and more, is in report.json.", ""]
        return "\n".join(out)


# --- report.md sections: compact tables from the recorded data ---------------------------------------------


def _code_table(value: Any) -> str:
    """A step's own fixed-width table (lowering, audit, verification record one as ``table``)."""
    if isinstance(value, dict) and isinstance(value.get("table"), str):
        return "```text\n" + value["table"] + "\n```"
    return ""


def _rewrites_md(value: Any) -> str:
    rows = [["method", "rewrite", "nodes changed"]]
    for method, summaries in (value or {}).items():
        for summary in summaries or []:
            counts = summary.get("counts") or {}
            changed = ", ".join(f"{k} {v}" for k, v in counts.items() if v) or "none"
            rows.append([method, summary.get("rewrite", "?"), changed])
    return markdown_table(rows) if len(rows) > 1 else ""


def _cpu_check_md(value: Any) -> str:
    """One row per output: its worst case over every seed and size."""
    worst: Dict[str, Dict[str, Any]] = {}
    for case in value.get("cases") or []:
        for c in case.get("comparisons") or []:
            row = worst.setdefault(c["name"], {"cases": 0, "rel_l2": None, "max_abs": None, "cosine": None,
                                               "failed": 0})
            row["cases"] += 1
            row["failed"] += 0 if c.get("ok") else 1
            for key, pick in (("rel_l2", max), ("max_abs", max), ("cosine", min)):
                if c.get(key) is not None:
                    row[key] = c[key] if row[key] is None else pick(row[key], c[key])
    rows = [["output", "cases", "worst rel L2", "worst max|diff|", "lowest cosine", "result"]]
    for name, r in worst.items():
        rows.append([name, r["cases"], _num(r["rel_l2"]), _num(r["max_abs"]), _num(r["cosine"], ".6f"),
                     "ok" if not r["failed"] else f"FAILED in {r['failed']} case(s)"])
    head = f"{value.get('compared', '?')} comparisons, {value.get('failed', '?')} failed; rule: {value.get('rule', '?')}"
    return head + "\n\n" + markdown_table(rows)


def _preflight_md(value: Any) -> str:
    needs = value.get("needs") or []
    head = f"{value.get('nodes', '?')} ops checked against runtime {value.get('runtime', '?')}"
    if not needs:
        return head + ": no fallback kernel needed."
    rows = [["method", "op", "kernel", "status"]]
    rows += [[n.get("method"), n.get("op"), n.get("kernel"), ("REFUSED: " if n.get("refused") else "ok: ") + str(n.get("why", ""))]
             for n in needs]
    return head + "\n\n" + markdown_table(rows)


def _num(value: Any, fmt: str = ".3e") -> str:
    return "-" if value is None else format(value, fmt)


def _policy_check_md(value: Any) -> str:
    """The check's own chunk table, on the CPU and on the GPU; a skip's reason is already in the stage table."""
    return "\n\n".join(_code_table(part) for part in (value or {}).values() if _code_table(part))


def _quantization_md(value: Any) -> str:
    """What was quantized, and what it costs against the unquantized unit, per output."""
    applied, cost = value.get("applied") or {}, value.get("cost") or {}
    sizes = applied.get("weight_bytes") or {}
    lines = [f"{applied.get('words', '?')} (torchao {applied.get('torchao', '?')}): {applied.get('quantized', '?')} "
             f"linear layer(s) quantized; weights {sizes.get('before', 0):,} -> {sizes.get('after', 0):,} bytes"]
    lines += [f"- kept: `{k['module']}` ({k['why']})" for k in (applied.get("kept") or [])[:12]]
    if cost.get("rows"):
        bound = cost.get("bound") or {}
        limits = ", ".join(f"{k} {v:g}" for k, v in bound.items() if v is not None) or "none"
        rows = [["output", "cases", "rel L2", "lowest cosine", "max|diff|", "unquantized low precision rel L2",
                 "result"]]
        rows += [[r["name"], r["cases"], _num(r["rel_l2"]), _num(r["cosine"], ".6f"), _num(r["max_abs"]),
                  _num(r.get("unquantized_low_rel_l2")), "ok" if r["ok"] else f"FAILED: {r['why']}"]
                 for r in cost["rows"]]
        lines += ["", f"Cost against {cost.get('against', '?')} (bound: {limits}); {cost.get('note', '')}.", "",
                  markdown_table(rows)]
    return "\n".join(lines)


# (section, title, renderer): the order of report.md after the stage table.
SECTIONS = (
    ("quantization", "Quantization", _quantization_md),
    ("rewrites", "Rewrites", _rewrites_md),
    ("cpu_check", "CPU check against eager", _cpu_check_md),
    ("preflight", "Kernel preflight", _preflight_md),
    ("lowering", "Lowering", _code_table),
    ("audit", "Runtime audit", _code_table),
    ("verification", "Verification", _code_table),
    ("policy_check", "Policy check against LeRobot's select_action", _policy_check_md),
)


def passed_stages(data: Dict[str, Any]) -> List[str]:
    """The stages a report records as done, in its order."""
    return [s["stage"] for s in data.get("stages", []) if s.get("status") == "done"]


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
        # A write the machine refused (disk full, read-only) is the user's to fix, not a bug: say it plainly.
        refused = storage_error(exc)
        seconds = round(time.perf_counter() - start, 3)
        interrupted = isinstance(exc, KeyboardInterrupt)
        status = "interrupted" if interrupted else "failed"
        detail = (interrupted_detail(exc) if interrupted else
                  facts.get("failure") or first_line(refused or exc, limit=160))
        report.stage(name, status, seconds, detail)
        report.record("failed_stage", name)
        say(f"{label} {status} after {seconds:.1f} s")
        if refused is not None:
            raise refused from exc
        raise
    seconds = round(time.perf_counter() - start, 3)
    report.stage(name, "done", seconds, str(facts.get("detail", "")))
    say(f"{label} done in {seconds:.1f} s")


def interrupted_detail(exc: BaseException) -> str:
    """How a run was interrupted: Ctrl-C, or the signal that stood for it (SIGTERM, see zoo.cli)."""
    return str(exc) if str(exc) else "Ctrl-C"


def record_failure(report: RunReport, exc: BaseException) -> None:
    """Mark the run failed (or interrupted) and record the error with the stage it happened in."""
    interrupted = isinstance(exc, KeyboardInterrupt)
    report.record("status", "interrupted" if interrupted else "failed")
    if report.get("failed_stage") is None:  # the error came from outside a stage, or a stage recorded by hand
        failed = [s["stage"] for s in report.stages if s["status"] in ("failed", "interrupted")]
        report.record("failed_stage", failed[-1] if failed else None)
    stage = report.get("failed_stage")
    if interrupted:
        message = (f"interrupted during {stage}" if stage else "interrupted") + f" ({interrupted_detail(exc)})"
    else:
        message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    report.record("error", {"type": type(exc).__name__, "message": message,
                            "hint": getattr(exc, "hint", None), "stage": stage})


# --- rendering helpers ---------------------------------------------------------------------------------------


def format_table(rows: List[List[Any]], wrap: Optional[Dict[int, int]] = None) -> str:
    """A fixed-width text table; the first row is the header. ``wrap`` {column: width} wraps that column's
    cells at word boundaries onto as many lines as they need (nothing is cut)."""
    cells = [[str(c) for c in row] for row in rows]
    # Each row becomes one or more lines: a wrapped cell continues below, the other cells stay blank there.
    lines_of_rows: List[List[List[str]]] = [[cells[0]]]
    for row in cells[1:]:
        columns = [textwrap.wrap(c, (wrap or {})[i], break_long_words=False, break_on_hyphens=False) or [""]
                   if i in (wrap or {}) else [c] for i, c in enumerate(row)]
        height = max(len(col) for col in columns)
        lines_of_rows.append([[col[k] if k < len(col) else "" for col in columns] for k in range(height)])
    flat = [line for row in lines_of_rows for line in row]
    widths = [max(len(r[i]) for r in flat) for i in range(len(cells[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in flat]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows: List[List[Any]]) -> str:
    cells = [[str(c).replace("|", "\\|") for c in row] for row in rows]
    lines = ["| " + " | ".join(cells[0]) + " |", "|" + "|".join("---" for _ in cells[0]) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in cells[1:]]
    return "\n".join(lines)
