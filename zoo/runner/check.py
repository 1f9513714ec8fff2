"""The policy check: the runner against the policy's own ``select_action``, over a sequence of observations.

Both sides get the same observations, one episode each, from the same global RNG state (LingBot-VA draws its
noise from the global generator inside its loop, so the two episodes run one after the other, each after
``torch.manual_seed(seed)``, never interleaved). The actions are grouped into the chunks the runner predicted
and compared per chunk: float32 relative L2 <= tolerance. The reference is any object with ``reset()`` and
``select_action(batch)``; ``ProcessedPolicy`` makes one of a LeRobot policy and its processors, without
importing lerobot here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Sequence

import torch

from ..numerics import compare
from .errors import RunnerError

Batch = Dict[str, Any]


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
    tolerance: float
    ok: bool


@dataclass
class PolicyCheckResult:
    rows: List[ChunkRow]
    backend: str
    device: str
    seed: int
    notes: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.rows) and all(r.ok for r in self.rows)

    def as_dict(self) -> Dict[str, Any]:
        return {"passed": self.ok, "backend": self.backend, "device": self.device, "seed": self.seed,
                "rows": [asdict(r) for r in self.rows], "notes": list(self.notes)}

    def table(self) -> str:
        from ..report import format_table

        rows = [["chunk", "actions", "max|diff|", "rel L2", "cosine", "tol", "result"]]
        for r in self.rows:
            rows.append([r.chunk, r.steps, f"{r.max_abs:.3e}", f"{r.rel_l2:.3e}", f"{r.cosine:.6f}",
                         f"{r.tolerance:.1e}", "ok" if r.ok else "FAIL"])
        return (f"policy check: runner ({self.backend}, {self.device}) against the policy's own select_action, "
                f"seed {self.seed}\n" + format_table(rows))


def _copy(batch: Batch) -> Batch:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def run_episode(policy: Any, observations: Sequence[Batch], seed: int) -> List[torch.Tensor]:
    """``reset()``, then one ``select_action`` per observation, from ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    policy.reset()
    return [policy.select_action(_copy(obs)).detach().to("cpu", torch.float32) for obs in observations]


def policy_check(runner: Any, reference: Any, observations: Sequence[Batch], *, seed: int = 0,
                 tolerance: float = 1e-5, min_chunks: int = 3) -> PolicyCheckResult:
    """Run both episodes and compare them chunk by chunk (the runner's chunks)."""
    expected = run_episode(reference, observations, seed)
    return compare_episode(runner, expected, observations, seed=seed, tolerance=tolerance, min_chunks=min_chunks)


def compare_episode(runner: Any, expected: Sequence[torch.Tensor], observations: Sequence[Batch], *, seed: int = 0,
                    tolerance: float = 1e-5, min_chunks: int = 3) -> PolicyCheckResult:
    """The runner's episode against the reference's actions (``run_episode``), chunk by chunk."""
    if len(expected) != len(observations):
        raise RunnerError(f"{len(expected)} reference actions for {len(observations)} observations",
                          "run the reference over the same observations")
    torch.manual_seed(seed)
    runner.reset()
    got, chunk_ids = [], []
    for obs in observations:
        got.append(runner.select_action(_copy(obs)).detach().to("cpu", torch.float32))
        chunk_ids.append(runner.chunks_predicted)
    chunks: Dict[int, List[int]] = {}
    for step, chunk in enumerate(chunk_ids):
        chunks.setdefault(chunk, []).append(step)
    if len(chunks) < min_chunks:
        raise RunnerError(f"the observation sequence covers {len(chunks)} chunk(s); the policy check needs "
                          f"{min_chunks}", "pass more observations")
    rows = []
    for chunk, steps in sorted(chunks.items()):
        if len({tuple(got[i].shape) for i in steps} | {tuple(expected[i].shape) for i in steps}) != 1:
            rows.append(ChunkRow(chunk, len(steps), [], float("inf"), float("inf"), -1.0, tolerance, False))
            continue
        c = compare(f"chunk {chunk}", torch.stack([got[i] for i in steps]), torch.stack([expected[i] for i in steps]))
        rows.append(ChunkRow(chunk, len(steps), list(c.shape), c.max_abs, c.rel_l2, c.cosine, tolerance,
                             bool(c.ok and c.rel_l2 <= tolerance)))
    return PolicyCheckResult(rows, backend=runner.backend.name, device=str(runner.device), seed=seed)
