"""The policy check's comparison: the runner against any ``reset()``/``select_action(batch)`` reference over the same
observations, one episode each from the same RNG state, judged chunk by chunk (float32: relative L2; bf16: zoo's
bf16 rule against a float32 episode). ``ProcessedPolicy`` wraps a LeRobot policy and its processors without
importing lerobot (docs/host-loops.md, "The policy check").
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from zoo.core.errors import RunnerError
from zoo.core.numerics import compare, judge, judge_low_precision
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


@dataclass
class PolicyCheckResult:
    rows: List[ChunkRow]
    backend: str
    device: str
    seed: int
    rule: str  # "float32" or "bf16"
    notes: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.rows) and all(r.ok for r in self.rows)

    def failures(self) -> List[ChunkRow]:
        return [r for r in self.rows if not r.ok]

    def as_dict(self) -> Dict[str, Any]:
        return {"passed": self.ok, "backend": self.backend, "device": self.device, "seed": self.seed,
                "rule": self.rule, "chunks": len(self.rows), "rows": [asdict(r) for r in self.rows],
                "notes": list(self.notes), "table": self.table()}

    def table(self) -> str:
        bf16 = self.rule == "bf16"
        rows = [["chunk", "actions", "max|diff|", "rel L2", "cosine"] + (["LeRobot bf16 rel L2"] if bf16 else [])
                + ["bound", "result"]]
        for r in self.rows:
            rows.append([r.chunk, r.steps, f"{r.max_abs:.3e}", f"{r.rel_l2:.3e}", f"{r.cosine:.6f}"]
                        + ([_num(r.eager_rel_l2)] if bf16 else [])
                        + [f"{r.bound:.1e}", "ok" if r.ok else f"FAIL: {r.why}"])
        against = "LeRobot float32 (bf16 rule)" if bf16 else "LeRobot"
        return (f"policy check: runner ({self.backend}, {self.device}) against {against} select_action, "
                f"seed {self.seed}\n" + format_table(rows))


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
            rows.append(ChunkRow(chunk, len(steps), list(c.shape), c.max_abs, c.rel_l2, c.cosine, bound, c.ok, c.why,
                                 eager.rel_l2 if math.isfinite(eager.rel_l2) else None))
    return PolicyCheckResult(rows, backend=runner.backend.name, device=str(runner.device), seed=seed,
                             rule="float32" if reference_low is None else "bf16")
