"""The result every zoo rewrite returns."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, Optional

from torch.export import ExportedProgram

log = logging.getLogger("zoo.rewrites")


@dataclass
class RewriteResult:
    """What a rewrite did to a program.

    ``program`` is the rewritten program, or the very object that was passed in when nothing changed or
    the rewrite declined. ``declined`` is None, or a reason naming the op and its source line; a declined
    rewrite leaves the program exactly as it was (graph, placeholder values, constants). ``counts`` maps an
    op name (e.g. ``"aten.mul.Tensor"``) to how many nodes of it were rewritten.
    """

    name: str
    program: ExportedProgram
    changed: bool = False
    declined: Optional[str] = None
    counts: Dict[str, int] = field(default_factory=dict)
    notes: list = field(default_factory=list)  # kept nodes and why (warning level), facts worth reporting

    @classmethod
    def unchanged(cls, name: str, program: ExportedProgram) -> "RewriteResult":
        return cls(name=name, program=program)

    @classmethod
    def decline(cls, name: str, program: ExportedProgram, reason: str) -> "RewriteResult":
        log.warning("%s declined: %s", name, reason)
        return cls(name=name, program=program, declined=reason)

    @classmethod
    def rewritten(cls, name: str, program: ExportedProgram, counts: Counter, notes=None) -> "RewriteResult":
        counts = {k: v for k, v in sorted(counts.items()) if v}
        return cls(name=name, program=program, changed=bool(counts), counts=counts, notes=list(notes or []))

    def summary(self) -> dict:
        """A JSON-ready record for the run report."""
        return {
            "rewrite": self.name,
            "changed": self.changed,
            "declined": self.declined,
            "counts": dict(self.counts),
            "notes": list(self.notes),
        }


def source_line(node) -> str:
    """Where a node came from in user code, for decline messages: 'file:line in fn: code' or the node name."""
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
    # torch's stack_trace ends with the innermost 'File "...", line N, in fn' followed by the code line.
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("File "):
            code = lines[i + 1] if i + 1 < len(lines) else ""
            return f"{lines[i]}: {code}".strip()
    return f"node {node.name}"
