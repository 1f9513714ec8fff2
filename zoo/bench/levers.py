"""The lever table: each lever's before and after, from chunk-bench runs made side by side on one GPU.

A lever is a recipe override (``lowering.kv_pool=buffer``, a rewrite added). Its run and the baseline's are
lowered and timed by ``benchmarks/bench_chunk.py`` into folders of their own, with the same seed, chunks and
weights; this module reads their ``chunk_latency.json`` (and ``policy_check.json`` when the check ran) and puts
each lever's numbers beside the baseline's: per runner candidate, the chunk and every method's median call, and
whether verification and the policy check held (a lever is kept only if they do).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from zoo.bench.chunk import CHECK_JSON_NAME, JSON_NAME

CANDIDATES = ("runner", "executorch")


@dataclass(frozen=True)
class Variant:
    """One chunk-bench output folder under a name (the first variant of a table is the baseline)."""

    name: str
    results: Dict[str, Any]
    checks: Dict[str, Any]

    @classmethod
    def read(cls, name: str, folder: Path) -> "Variant":
        path = folder / JSON_NAME
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: run benchmarks/bench_chunk.py --out {folder} "
                                    "(--only lower, then --only bench) for this variant first")
        check_path = folder / CHECK_JSON_NAME
        checks = json.loads(check_path.read_text()) if check_path.is_file() else {"policies": []}
        return cls(name, json.loads(path.read_text()), checks)

    def policy(self, policy: str) -> Dict[str, Any]:
        return next((r for r in self.results["policies"] if r.get("policy") == policy), {})

    def check(self, policy: str) -> Optional[Dict[str, Any]]:
        entry = next((r for r in self.checks["policies"] if r.get("policy") == policy), {})
        return entry.get("policy_check")


def chunk_ms(record: Dict[str, Any], candidate: str) -> Optional[float]:
    return (((record.get("candidates") or {}).get(candidate) or {}).get("chunk_ms") or {}).get("median")


def _methods(record: Dict[str, Any], candidate: str) -> List[Dict[str, Any]]:
    """The rows of the candidate's call-by-call episode, one per method (``chunk_runners.roofline``)."""
    return (((record.get("candidates") or {}).get(candidate) or {}).get("roofline") or {}).get("methods", [])


def method_ms(record: Dict[str, Any], candidate: str) -> Dict[str, float]:
    """Each method's median call (ms) from the candidate's call-by-call episode."""
    return {m["method"]: m["median_ms"] for m in _methods(record, candidate) if m.get("median_ms") is not None}


def method_floor(record: Dict[str, Any]) -> Dict[str, float]:
    """Each method's floor (ms); every runner candidate makes the same calls, so the runner's serves."""
    return {m["method"]: m["floor_ms"] for m in _methods(record, "runner") if m.get("floor_ms")}


def _ms(value: Optional[float]) -> str:
    return f"{value:.3f}" if value is not None else "-"


def _ratio(after: Optional[float], before: Optional[float]) -> str:
    return f"{after / before:.3f}x" if after is not None and before else "-"


def lever_rows(variants: Sequence[Variant], policy: str) -> List[List[str]]:
    """One row per runner candidate and what it times (the chunk, then each method): the baseline's median, then
    each lever's median and its ratio to the baseline's (below 1: the lever is faster)."""
    base, levers = variants[0], variants[1:]
    head = ["candidate", "what", f"{base.name} ms"]
    for lever in levers:
        head += [f"{lever.name} ms", f"{lever.name}/{base.name}"]
    rows = [head + ["floor ms"]]
    before = base.policy(policy)
    floors = method_floor(before)
    for candidate in CANDIDATES:
        if chunk_ms(before, candidate) is None:
            continue
        whats = [("chunk", lambda r: chunk_ms(r, candidate))]
        whats += [(m, (lambda r, m=m: method_ms(r, candidate).get(m))) for m in method_ms(before, candidate)]
        for what, value in whats:
            row = [candidate, what, _ms(value(before))]
            for lever in levers:
                after = value(lever.policy(policy))
                row += [_ms(after), _ratio(after, value(before))]
            rows.append(row + [_ms(floors.get(what))])
    return rows


def verdict_rows(variants: Sequence[Variant], policy: str) -> List[List[str]]:
    """Per variant: whether it lowered and was timed, its artifact's size (a quantized lever's point), and its
    policy check (the pooled rule's numbers)."""
    rows = [["variant", "bench", ".ptd MiB", "runner vs LeRobot eager rel L2", "policy check", "pooled rel L2",
             "bound"]]
    for v in variants:
        record = v.policy(policy)
        rel = ((record.get("candidates") or {}).get("runner") or {}).get("vs_eager_rel_l2")
        ptd = record.get("ptd_bytes")
        check = v.check(policy) or {}
        pooled = ((check.get("result") or {}).get("pooled")) or {}
        rows.append([v.name, record.get("status", "missing"), f"{ptd / 2**20:.1f}" if ptd else "-",
                     f"{rel:.2e}" if rel is not None else "-", check.get("status", "not run"),
                     f"{pooled['rel_l2']:.3e}" if pooled else "-", f"{pooled['bound']:.3e}" if pooled else "-"])
    return rows


def policies_of(variants: Sequence[Variant]) -> List[str]:
    """The policies every variant timed."""
    names = [r.get("policy") for r in variants[0].results["policies"]]
    return [p for p in names if all(v.policy(p) for v in variants)]
