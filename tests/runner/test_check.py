"""zoo.runner.check on hand-worked episodes: chunks grouped as the runner predicted them, the float32 bound per
chunk, zoo's bf16 rule over all the actions (each chunk's own numbers for reading), and too short a sequence
refused (no lerobot needed)."""

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
    # Every chunk is 1.3% off, so is the whole episode: the pooled rule fails it; no chunk fails on its own.
    assert not bad.ok and all(r.ok for r in bad.rows) and not bad.pooled.ok
    assert bad.pooled.rel_l2 == pytest.approx(0.013, rel=1e-5) and bad.pooled.bound == pytest.approx(0.0125, rel=1e-5)
    assert "LeRobot bf16 rel L2" in bad.table() and "over its own bound (read only)" in bad.table()
    assert "all 10 actions at rel L2 1.300e-02 against a bound of 1.250e-02" in bad.verdict()


def test_bf16_rule_is_judged_over_all_actions_not_a_one_action_chunk():
    """A one-action chunk 1.5% off (over its own 1.25% bound) in an episode otherwise 1.1% off passes: by hand,
    actions k = 1..10 (x2 columns): sqrt((0.011^2 * (1+...+81) + 0.015^2 * 100) / 385) = 0.012166 <= 0.0125."""
    observations = [{}] * 10
    ref32, lerobot_bf16 = episode(1.0), episode(1.01)
    got = episode(1.011)
    got[9] = torch.full((1, 2), 1.015 * 10)
    tol = ChunkTolerance(float32=1e-5, bf16_factor=1.25, bf16_min_cosine=0.99)
    result = compare_episode(ScriptedRunner(got, 3), ref32, observations, tolerance=tol, reference_low=lerobot_bf16)
    assert result.rows[3].steps == 1 and result.rows[3].rel_l2 == pytest.approx(0.015, rel=1e-5)
    assert result.rows[3].rel_l2 > result.rows[3].bound and result.rows[3].ok
    assert result.pooled.rel_l2 == pytest.approx(((0.011 ** 2 * 285 + 0.015 ** 2 * 100) / 385) ** 0.5, rel=1e-5)
    assert result.pooled.rel_l2 == pytest.approx(0.012166, abs=1e-5) and result.ok
    assert result.as_dict()["pooled"]["ok"] and result.as_dict()["passed"]


def test_a_chunk_that_turns_against_the_reference_fails_on_its_own():
    observations = [{}] * 10
    ref32, lerobot_bf16 = episode(1.0), episode(1.01)
    got = episode(1.01)
    got[3:6] = [-a for a in got[3:6]]  # chunk 2 points the other way
    tol = ChunkTolerance(float32=1e-5, bf16_factor=1.25, bf16_min_cosine=0.99)
    result = compare_episode(ScriptedRunner(got, 3), ref32, observations, tolerance=tol, reference_low=lerobot_bf16)
    assert [r.ok for r in result.rows] == [True, False, True, True] and not result.ok
    assert "cosine" in result.rows[1].why


def test_pooled_sums_add_up_across_episodes():
    """Two episodes pooled by adding their sums equal one comparison over both episodes' actions."""
    from zoo.runner.check import Pooled

    tol = ChunkTolerance()
    g = torch.Generator().manual_seed(0)
    ref = [torch.randn(5, 3, generator=g) for _ in range(2)]
    low = [r + 0.01 * torch.randn(5, 3, generator=g) for r in ref]
    got = [r + 0.012 * torch.randn(5, 3, generator=g) for r in ref]
    both = Pooled.of(got[0], ref[0], low[0], tol) + Pooled.of(got[1], ref[1], low[1], tol)
    whole = torch.cat(got) - torch.cat(ref)
    assert both.actions == 10
    assert both.rel_l2 == pytest.approx(float(whole.norm() / torch.cat(ref).norm()), rel=1e-5)
    assert both.reference_rel_l2 == pytest.approx(float((torch.cat(low) - torch.cat(ref)).norm()
                                                        / torch.cat(ref).norm()), rel=1e-5)
    cos = torch.nn.functional.cosine_similarity(torch.cat(got).flatten(), torch.cat(ref).flatten(), dim=0)
    assert both.cosine == pytest.approx(float(cos), rel=1e-5)


def test_too_few_chunks_are_refused():
    with pytest.raises(RunnerError, match="covers 2 action chunk"):
        compare_episode(ScriptedRunner(episode(1.0, 7), 3), episode(1.0, 7), [{}] * 7, min_chunks=3)


def test_episodes_merge_into_one_verdict_with_every_chunk():
    """Two bf16 episodes: each 1.2% off alone passes; merged, the rows carry their seeds and the verdict is the
    pooled one over both (here one episode 1.4% off pulls the whole over the 1.25% bound: by hand
    sqrt((0.012^2 + 0.014^2) / 2) = 0.01304 for two episodes of equal norm)."""
    from zoo.runner.check import PolicyCheckResult

    observations = [{}] * 10
    ref32, lerobot_bf16 = episode(1.0), episode(1.01)
    tol = ChunkTolerance(float32=1e-5, bf16_factor=1.25, bf16_min_cosine=0.99)
    first = compare_episode(ScriptedRunner(episode(1.012), 3), ref32, observations, seed=0, tolerance=tol,
                            reference_low=lerobot_bf16)
    second = compare_episode(ScriptedRunner(episode(1.014), 3), ref32, observations, seed=1, tolerance=tol,
                             reference_low=lerobot_bf16)
    merged = PolicyCheckResult.merged([first, second])
    assert first.ok and not second.ok
    assert [r.seed for r in merged.rows] == [0] * 4 + [1] * 4 and merged.pooled.actions == 20
    assert merged.pooled.rel_l2 == pytest.approx(((0.012 ** 2 + 0.014 ** 2) / 2) ** 0.5, rel=1e-4)
    assert not merged.ok and "seeds 0, 1" in merged.table()
