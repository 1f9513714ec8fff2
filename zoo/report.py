"""The run report: every step records what it did (counts, times, reasons) into one JSON + Markdown pair.

Sections are plain dicts keyed by step name, so steps stay independent: ``report.record("lower", {...})``.
``stages`` keeps, in order, each step's status ("done", "skipped", "failed") and time, which the final
summary table prints.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from . import atomic

REPORT_JSON = "report.json"
REPORT_MD = "report.md"


class RunReport:
    def __init__(self, run_dir: Path, recipe: Optional[dict] = None):
        self.run_dir = Path(run_dir)
        self.data: Dict[str, Any] = {"recipe": recipe, "stages": [], "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}

    @classmethod
    def load(cls, run_dir: Path) -> "RunReport":
        report = cls(run_dir)
        path = Path(run_dir) / REPORT_JSON
        if path.exists():
            report.data = json.loads(path.read_text())
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

    def write(self) -> None:
        atomic.write_json(self.run_dir / REPORT_JSON, self.data)
        atomic.write_text(self.run_dir / REPORT_MD, self.markdown())

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
                               ("lowering", "Lowering"), ("audit", "Runtime audit"), ("verification", "Verification")):
            value = self.data.get(section)
            if value:
                out += [f"## {title}", ""]
                if isinstance(value, dict) and isinstance(value.get("table"), str):  # a step's own text table
                    out += ["```", value["table"], "```", ""]
                out += ["```json", json.dumps(value, indent=2, default=str), "```", ""]
        return "\n".join(out)


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
