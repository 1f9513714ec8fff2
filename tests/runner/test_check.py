"""zoo.runner.check on hand-worked episodes: chunks grouped as the runner predicted them, the float32 bound and
zoo's bf16 rule per chunk, and too short a sequence refused (no lerobot needed)."""

from __future__ import annotations

import pytest
import torch

from zoo.core.errors import RunnerError
from zoo.runner.check import ChunkTolerance, compare_episode


class ScriptedRunner:
    """Returns the given actions in order and predicts a new chunk every ``chunk`` calls, as a runner counts."""

    def __init__(self, actions, chunk):
        self.actions, self.chunk = actions, chunk
        self.backend = type("Backend", (), {"name": "scripted"})()
        self.device = "cpu"

    def reset(self):
        self.step, self.chunks_predicted = 0, 0

    def select_action(self, batch):
        if self.step % self.chunk == 0:
            self.chunks_predicted += 1
        action = self.actions[self.step]
        self.step += 1
        return action


def episode(scale: float, steps: int = 10):
    return [torch.full((1, 2), scale * (i + 1)) for i in range(steps)]


def test_float32_rows_follow_the_runners_chunks_and_the_bound():
    observations = [{}] * 10  # three whole chunks of 3 and the first action of a fourth
    ref = episode(1.0)
    got = [a.clone() for a in ref]
    got[3] = got[3] * (1 + 1e-4)  # chunk 2 (steps 3..5): a 1e-4 error on one of its three actions
    result = compare_episode(ScriptedRunner(got, 3), ref, observations, tolerance=ChunkTolerance(float32=1e-5))
    assert [(r.chunk, r.steps) for r in result.rows] == [(1, 3), (2, 3), (3, 3), (4, 1)]
    assert [r.ok for r in result.rows] == [True, False, True, True] and not result.ok
    # By hand: chunk 2 is actions 4, 5, 6 (x2 each); only the 4s are off, by 4e-4: sqrt(2)*4e-4 / sqrt(2*(16+25+36))
    assert result.rows[1].rel_l2 == pytest.approx(4e-4 / 77 ** 0.5, rel=1e-3)
    assert "FAIL: relative L2" in result.table()


def test_bf16_rule_against_the_float32_reference():
    observations = [{}] * 10
    ref32 = episode(1.0)
    lerobot_bf16 = episode(1.01)  # 1% from float32 in every chunk
    within, beyond = episode(1.012), episode(1.013)  # 1.2% <= 1.25 x 1% < 1.3%
    tol = ChunkTolerance(float32=1e-5, bf16_factor=1.25, bf16_min_cosine=0.99)
    ok = compare_episode(ScriptedRunner(within, 3), ref32, observations, tolerance=tol, reference_low=lerobot_bf16)
    assert ok.ok and ok.rule == "bf16"
    assert all(r.eager_rel_l2 == pytest.approx(0.01, rel=1e-5) and r.bound == pytest.approx(0.0125, rel=1e-5)
               for r in ok.rows)
    bad = compare_episode(ScriptedRunner(beyond, 3), ref32, observations, tolerance=tol, reference_low=lerobot_bf16)
    assert not bad.ok and all(not r.ok for r in bad.rows)
    assert "LeRobot bf16 rel L2" in bad.table()


def test_too_few_chunks_are_refused():
    with pytest.raises(RunnerError, match="covers 2 action chunk"):
        compare_episode(ScriptedRunner(episode(1.0, 7), 3), episode(1.0, 7), [{}] * 7, min_chunks=3)
