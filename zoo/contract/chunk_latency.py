"""Measured latency of a whole action chunk, per recipe: what the model card quotes for an artifact of that recipe.

Where the numbers come from: ``benchmarks/bench_chunk.py --record`` on a GPU, at the recipe's real size with
seeded weights (the latency of a chunk depends on the architecture and sizes, not on the weights' values), writes
one entry per policy it timed into ``zoo/data/chunk_latency.json``; the entries are committed with the evidence of
that run (docs/benchmarks.md). An artifact's card names the recipe's entry, its GPU and the command, or says that none was
measured.

An entry: ``gpu``, ``measured`` (date), ``command``, ``dtype``, ``actions_per_chunk``, ``weights`` (how they were
made), and per candidate (``runner``, ``executorch``, ``graphs``, ``pytorch``, ``eager``, ``compile``: those that
were timed) ``median_ms``, ``p10_ms``, ``p90_ms`` and ``actions_per_second``; ``floor_ms``, the chunk's hardware floor
(``zoo.bench.roofline``; None when not worked out); ``ratios`` (those of ``zoo.bench.chunk.TARGETS`` that were
measured, and LEVERS: what a lever buys, e.g. ``graphs/runner``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

from zoo.core import atomic

MEASURED_JSON = Path(__file__).resolve().parents[1] / "data" / "chunk_latency.json"
CANDIDATES = ("runner", "executorch", "graphs", "pytorch", "eager", "compile")


def read_measured(path: Optional[Path] = None) -> Dict[str, Dict[str, Any]]:
    """Every recipe's entry; an absent file is no entries."""
    path = path or MEASURED_JSON
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return dict(data.get("recipes") or {})


def measured_for(recipe: str, path: Optional[Path] = None) -> Optional[Dict[str, Any]]:
    return read_measured(path).get(recipe)


def entry_from_bench(record: Mapping[str, Any], *, gpu: str, command: str, measured: str,
                     weights: str) -> Dict[str, Any]:
    """The stored entry of one policy's timing record (``bench_chunk.py``'s ``policies[i]``)."""
    candidates: Dict[str, Any] = {}
    for name in CANDIDATES:
        stats = (record.get("candidates") or {}).get(name) or {}
        ms = stats.get("chunk_ms")
        if ms:
            candidates[name] = {"median_ms": round(ms["median"], 3), "p10_ms": round(ms["p10"], 3),
                                "p90_ms": round(ms["p90"], 3),
                                "actions_per_second": round(stats.get("actions_per_second") or 0.0, 1)}
    floor = ((((record.get("candidates") or {}).get("runner") or {}).get("roofline") or {}).get("chunk") or {}
             ).get("floor_ms")
    return {"gpu": gpu, "measured": measured, "command": command, "dtype": record.get("dtype"),
            "actions_per_chunk": record.get("actions_per_chunk"), "weights": weights, "candidates": candidates,
            "floor_ms": round(floor, 3) if floor else None,
            "ratios": {k: (round(v, 4) if v is not None else None) for k, v in (record.get("ratios") or {}).items()}}


def record_measured(entries: Mapping[str, Dict[str, Any]], path: Optional[Path] = None) -> Path:
    """Add or replace the entries of these recipes, atomically; the other recipes' entries stay."""
    path = path or MEASURED_JSON
    recipes = read_measured(path)
    recipes.update(entries)
    about = "zoo.contract.chunk_latency: measured by benchmarks/bench_chunk.py --record"
    return atomic.write_json(path, {"about": about, "recipes": dict(sorted(recipes.items()))})
