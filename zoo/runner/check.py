"""The policy check's comparison: the runner against any ``reset()``/``select_action(batch)`` reference over the same
observations, one episode each from the same RNG state. float32 is judged chunk by chunk (relative L2). bf16 is
judged by zoo's bf16 rule against a float32 episode, pooled over every action of the episodes: a chunk of one or
a few actions measures rounding noise, not the artifact; each chunk still needs a finite result and the rule's
cosine, and its own numbers stay in the table. ``ProcessedPolicy`` wraps a LeRobot policy and its processors
without importing lerobot (docs/host-loops.md, "The policy check").
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from zoo.core.errors import RunnerError
from zoo.core.numerics import compare, judge, judge_low_precision, low_precision_bound
from zoo.core.report import format_table

Batch = Dict[str, Any]


@dataclass
class ChunkTolerance:
    """What a chunk is judged by (the recipe's ``policy_check.tolerance`` has these fields too)."""

    float32: float = 1e-5  # relative L2 per chunk; under the bf16 rule, the least a bound can be
    bf16_factor: float = 1.25
    bf16_min_cosine: float = 0.99


class ProcessedPolicy:
    """A LeRobot policy as its control loop drives it: ``postprocessor(policy.select_action(preprocessor(obs)))``."""

    def __init__(self, policy: Any, preprocessor: Callable, postprocessor: Callable):
        self.policy, self.preprocessor, self.postprocessor = policy, preprocessor, postprocessor

    def reset(self) -> None:
        self.policy.reset()

    @torch.no_grad()
    def select_action(self, batch: Batch) -> torch.Tensor:
        return self.postprocessor(self.policy.select_action(self.preprocessor(batch)))


@dataclass
class ChunkRow:
    chunk: int
    steps: int
    shape: List[int]
    max_abs: float
    rel_l2: float
    cosine: float
    bound: float  # the relative L2 this chunk was held to
    ok: bool
    why: str = ""
    eager_rel_l2: Optional[float] = None  # bf16 rule: the reference's own bf16 episode against float32
    seed: Optional[int] = None  # the episode's, when a result holds several


@dataclass
class Pooled:
    """The bf16 rule over many actions at once, kept as sums (float64) so that episodes add up: the runner's
    actions ``got``, the float32 reference ``ref`` and the reference's own low-precision actions ``low``."""

    actions: int
    diff_sq: float  # sum |got - ref|^2
    low_sq: float  # sum |low - ref|^2
    ref_sq: float  # sum |ref|^2
    got_sq: float  # sum |got|^2
    dot: float  # sum got . ref
    tolerance: ChunkTolerance

    @classmethod
    def of(cls, got: torch.Tensor, ref: torch.Tensor, low: torch.Tensor, tolerance: ChunkTolerance) -> "Pooled":
        g, r, lo = (t.detach().to("cpu", torch.float64).flatten() for t in (got, ref, low))
        return cls(int(got.shape[0]), float(((g - r) ** 2).sum()), float(((lo - r) ** 2).sum()), float((r * r).sum()),
                   float((g * g).sum()), float((g * r).sum()), tolerance)

    def __add__(self, other: "Pooled") -> "Pooled":
        sums = [getattr(self, k) + getattr(other, k) for k in ("actions", "diff_sq", "low_sq", "ref_sq", "got_sq",
                                                                 "dot")]
        return Pooled(*sums, self.tolerance)

    @property
    def rel_l2(self) -> float:
        return math.sqrt(self.diff_sq / self.ref_sq) if self.ref_sq > 0 else math.inf

    @property
    def reference_rel_l2(self) -> float:
        return math.sqrt(self.low_sq / self.ref_sq) if self.ref_sq > 0 else math.inf

    @property
    def cosine(self) -> float:
        norm = math.sqrt(self.got_sq * self.ref_sq)
        return self.dot / norm if norm > 0 else (1.0 if self.got_sq == self.ref_sq == 0 else 0.0)

    @property
    def bound(self) -> float:
        return low_precision_bound(self.reference_rel_l2, self.tolerance)

    @property
    def ok(self) -> bool:
        values = (self.rel_l2, self.reference_rel_l2, self.cosine)
        return (all(math.isfinite(v) for v in values) and self.rel_l2 <= self.bound
                and self.cosine >= self.tolerance.bf16_min_cosine)

    def line(self) -> str:
        verdict = "ok" if self.ok else "FAIL"
        tol = self.tolerance
        return (f"all {self.actions} actions (the rule): rel L2 {self.rel_l2:.3e}, LeRobot bf16 "
                f"{self.reference_rel_l2:.3e}, bound {self.bound:.3e} ({tol.bf16_factor} x, at least "
                f"{tol.float32:.0e}), cosine {self.cosine:.6f} (at least {tol.bf16_min_cosine}): {verdict}")


@dataclass
class PolicyCheckResult:
    rows: List[ChunkRow]
    backend: str
    device: str
    seed: int
    rule: str  # "float32" or "bf16"
    notes: List[str] = field(default_factory=list)
    pooled: Optional[Pooled] = None  # the bf16 rule's verdict; None under the float32 rule
    # A quantized unit: what quantization costs the policy's actions, LeRobot's policy quantized as the unit against
    # its unquantized float32 policy (zoo.export.quant_cost.policy_cost: "passed", "rows", "table", ...). It fails
    # the check only past the recipe's unit.quantize.bound.
    quantization_cost: Optional[Dict[str, Any]] = None

    @property
    def ok(self) -> bool:
        return (bool(self.rows) and all(r.ok for r in self.rows) and (self.pooled is None or self.pooled.ok)
                and (self.quantization_cost is None or bool(self.quantization_cost.get("passed"))))

    def failures(self) -> List[ChunkRow]:
        return [r for r in self.rows if not r.ok]

    def verdict(self) -> str:
        """What failed, in a few words (for the stage's line and the error's first line)."""
        failed = self.failures()
        parts = [f"{len(failed)} of {len(self.rows)} action chunks out of tolerance"] if failed else []
        if self.pooled is not None and not self.pooled.ok:
            parts.append(f"all {self.pooled.actions} actions at rel L2 {self.pooled.rel_l2:.3e} against a bound of "
                         f"{self.pooled.bound:.3e} (cosine {self.pooled.cosine:.6f})")
        if self.quantization_cost is not None and not self.quantization_cost.get("passed"):
            parts.append("quantization moves LeRobot's actions more than unit.quantize.bound allows")
        return "; ".join(parts) or "passed"

    @classmethod
    def merged(cls, results: Sequence["PolicyCheckResult"]) -> "PolicyCheckResult":
        """Several episodes' results as one: every chunk row (with its episode's seed), the bf16 rule's sums added."""
        first = results[0]
        if len(results) == 1:
            return first
        rows = [dataclasses.replace(r, seed=res.seed) for res in results for r in res.rows]
        pooled = None if first.pooled is None else sum((res.pooled for res in results[1:]), first.pooled)
        notes = [f"{len(results)} episodes, seeds {', '.join(str(res.seed) for res in results)}"]
        return cls(rows, first.backend, first.device, first.seed, first.rule,
                   notes + [n for res in results for n in res.notes], pooled)

    def as_dict(self) -> Dict[str, Any]:
        pooled = None if self.pooled is None else {**asdict(self.pooled), "rel_l2": self.pooled.rel_l2,
                                                    "reference_rel_l2": self.pooled.reference_rel_l2,
                                                    "cosine": self.pooled.cosine, "bound": self.pooled.bound,
                                                    "ok": self.pooled.ok}
        return {"passed": self.ok, "backend": self.backend, "device": self.device, "seed": self.seed,
                "rule": self.rule, "chunks": len(self.rows), "rows": [asdict(r) for r in self.rows],
                "pooled": pooled, "notes": list(self.notes), "quantization_cost": self.quantization_cost,
                "table": self.table()}

    def table(self) -> str:
        bf16 = self.rule == "bf16"
        seeds = any(r.seed is not None for r in self.rows)
        rows = [(["seed"] if seeds else []) + ["chunk", "actions", "max|diff|", "rel L2", "cosine"]
                + (["LeRobot bf16 rel L2"] if bf16 else []) + ["bound", "result"]]
        for r in self.rows:
            result = "ok" if r.ok else f"FAIL: {r.why}"
            if r.ok and bf16 and r.rel_l2 > r.bound:  # judged over all actions below, not chunk by chunk
                result = "over its own bound (read only)"
            rows.append(([r.seed] if seeds else []) + [r.chunk, r.steps, f"{r.max_abs:.3e}", f"{r.rel_l2:.3e}",
                                                       f"{r.cosine:.6f}"]
                        + ([_num(r.eager_rel_l2)] if bf16 else [])
                        + [f"{r.bound:.1e}", result])
        against = "LeRobot float32 (bf16 rule)" if bf16 else "LeRobot"
        quantized = "" if self.quantization_cost is None else " (LeRobot's policy quantized as the unit)"
        pooled = "" if self.pooled is None else "\n" + self.pooled.line()
        cost = "" if self.quantization_cost is None else "\n" + self.quantization_cost["table"]
        which = "seeds " + ", ".join(str(x) for x in dict.fromkeys(r.seed for r in self.rows)) if seeds \
            else f"seed {self.seed}"
        return (f"policy check: runner ({self.backend}, {self.device}) against {against} select_action{quantized}, "
                f"{which}\n" + format_table(rows) + pooled + cost)


def _why_chunk_fails(c, bound: float, tolerance: ChunkTolerance) -> str:
    """Why a chunk fails on its own under the bf16 rule ("" when it does not)."""
    if not math.isfinite(bound):
        return c.why  # the reference's own low-precision chunk is unusable
    if not math.isfinite(c.rel_l2):
        return "non-finite actions"
    if c.cosine < tolerance.bf16_min_cosine:
        return f"cosine {c.cosine:.6f} < {tolerance.bf16_min_cosine}"
    return ""


def _num(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.3e}"


def _copy(batch: Batch) -> Batch:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def run_episode(policy: Any, observations: Sequence[Batch], seed: int) -> List[torch.Tensor]:
    """``reset()``, then one ``select_action`` per observation, from ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    policy.reset()
    return [policy.select_action(_copy(obs)).detach().to("cpu", torch.float32) for obs in observations]


def runner_episode(runner: Any, observations: Sequence[Batch], seed: int) -> Tuple[List[torch.Tensor], List[int]]:
    """The runner's episode: its actions and, per action, the chunk it came from."""
    torch.manual_seed(seed)
    runner.reset()
    got, chunk_ids = [], []
    for obs in observations:
        got.append(runner.select_action(_copy(obs)).detach().to("cpu", torch.float32))
        chunk_ids.append(runner.chunks_predicted)
    return got, chunk_ids


def policy_check(runner: Any, reference: Any, observations: Sequence[Batch], *, seed: int = 0,
                 tolerance: Optional[ChunkTolerance] = None, min_chunks: int = 3) -> PolicyCheckResult:
    """Run both episodes (float32) and compare them chunk by chunk (the runner's chunks)."""
    expected = run_episode(reference, observations, seed)
    return compare_episode(runner, expected, observations, seed=seed, tolerance=tolerance, min_chunks=min_chunks)


def compare_episode(runner: Any, expected: Sequence[torch.Tensor], observations: Sequence[Batch], *, seed: int = 0,
                    tolerance: Optional[ChunkTolerance] = None, min_chunks: int = 3,
                    reference_low: Optional[Sequence[torch.Tensor]] = None) -> PolicyCheckResult:
    """The runner's episode against the reference's actions (``run_episode``), chunk by chunk.

    Without ``reference_low``: float32, ``expected`` is the reference. With it: the bf16 rule, ``expected`` is
    the float32 reference episode and ``reference_low`` the reference's own episode in the runner's dtype."""
    tolerance = tolerance or ChunkTolerance()
    for name, actions in (("reference", expected), ("low-precision reference", reference_low)):
        if actions is not None and len(actions) != len(observations):
            raise RunnerError(f"{len(actions)} {name} actions for {len(observations)} observations",
                              "run the reference over the same observations")
    got, chunk_ids = runner_episode(runner, observations, seed)
    chunks: Dict[int, List[int]] = {}
    for step, chunk in enumerate(chunk_ids):
        chunks.setdefault(chunk, []).append(step)
    full = [c for c, steps in chunks.items() if len(steps) > 1 or c < max(chunks)]
    if len(full) < min_chunks:
        raise RunnerError(f"the observation sequence covers {len(full)} action chunk(s); the policy check needs "
                          f"{min_chunks}", "pass more observations (policy_check.chunks in the recipe)")
    rows = []
    for chunk, steps in sorted(chunks.items()):
        mine = torch.stack([got[i] for i in steps])
        want = torch.stack([expected[i] for i in steps])
        if reference_low is None:
            c = judge(compare(f"chunk {chunk}", mine, want), tolerance.float32)
            rows.append(ChunkRow(chunk, len(steps), list(c.shape), c.max_abs, c.rel_l2, c.cosine, tolerance.float32,
                                 c.ok, c.why))
        else:
            low = torch.stack([reference_low[i] for i in steps])
            c, bound, eager = judge_low_precision(f"chunk {chunk}", mine, low, want, tolerance)
            # A chunk's own ratio is for reading (the rule is pooled below); what fails a chunk on its own is a
            # non-finite result, an unusable reference or a cosine under the rule's.
            why = _why_chunk_fails(c, bound, tolerance)
            rows.append(ChunkRow(chunk, len(steps), list(c.shape), c.max_abs, c.rel_l2, c.cosine, bound, not why,
                                 why, eager.rel_l2 if math.isfinite(eager.rel_l2) else None))
    pooled = None
    if reference_low is not None:
        pooled = Pooled.of(torch.stack(got), torch.stack(list(expected)), torch.stack(list(reference_low)), tolerance)
    return PolicyCheckResult(rows, backend=runner.backend.name, device=str(runner.device), seed=seed,
                             rule="float32" if reference_low is None else "bf16", pooled=pooled)
