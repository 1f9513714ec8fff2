"""Closed loop, whole episodes: fast-wam-tiny.pusht in LeRobot's PushT simulation (gym-pusht, headless on the CPU),
the zoo policy (eager backend, float32) against LeRobot's own FastWAMPolicy from the same checkpoint, same seeds;
2 episodes of 200 environment steps each must agree to float32 precision at every step, an artifact with one
weight perturbed must be caught, and `lerobot-eval` itself runs 2 such episodes, with the run named by
`--policy.type=zoo --policy.run` and by `--policy.path` of its policy folder (lerobot_policy_zoo.policy_folder).

e2e (minutes on two cores): run with `pytest -m e2e tests/plugin/test_lerobot_closed_loop.py`. Needs gym-pusht
(`pip install 'lerobot[pusht]==0.6.1'`); skipped without it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lerobot")
pytest.importorskip("gym_pusht", reason="the PushT simulation: pip install 'lerobot[pusht]==0.6.1'")

from lerobot_policy_zoo.closed_loop import closed_loop_check  # noqa: E402
from lerobot_policy_zoo.policy_folder import main as policy_folder  # noqa: E402
from support.environment import REPO_ROOT  # noqa: E402
from zoo.contract.run_folder import RunFolder  # noqa: E402

pytestmark = [pytest.mark.policies, pytest.mark.e2e]

TINY = "fast-wam-tiny.pusht"
RENAME = {"observation.image": "observation.images.image"}  # PushT's one camera under Fast-WAM's camera key
EPISODES, STEPS = 2, 200


@pytest.fixture(scope="module")
def run(tiny_runs, tmp_path_factory):
    return tiny_runs(TINY).copy_to(tmp_path_factory.mktemp("closed-loop"))


def test_whole_episodes_equal_lerobots(run):
    result = closed_loop_check(str(run), "pusht", episodes=EPISODES, steps=STEPS, rename_map=RENAME)
    print(result.table())
    assert result.ok, result.table()
    assert [r.steps for r in result.rows] == [STEPS] * EPISODES
    for row in result.rows:
        assert row.worst_action_rel_l2 <= 1e-5 and row.worst_state_max_abs <= 1e-3
        assert row.state_travel > 100.0  # the agent moved about the table: the environment reacted


def perturbed(run: Path, dest: Path) -> Path:
    """A copy of the run whose action expert has one weight matrix scaled by 1 + 1e-3 (rewritten.action_step.pt2,
    what the eager backend runs and what would be lowered)."""
    shutil.copytree(run, dest)
    folder = RunFolder(dest)
    program = folder.load_program("rewritten", "action_step")
    # The action expert's: action_step also holds the video expert's weights, which the prefill's K/V stand in for.
    name = next(n for n, t in program.state_dict.items()
                if n.startswith("mot.mixtures.action.") and t.ndim == 2 and t.numel() >= 1024)
    with torch.no_grad():
        program.state_dict[name].mul_(1.001)
    folder.save_program(program, "rewritten", "action_step")
    return dest


def test_a_perturbed_artifact_is_caught(run, tmp_path):
    broken = perturbed(run, tmp_path / "broken")
    result = closed_loop_check(str(broken), "pusht", episodes=1, steps=STEPS, rename_map=RENAME)
    print(result.table())
    assert not result.ok
    assert result.rows[0].first_step_beyond == 0  # the very first action already differs ...
    assert result.rows[0].worst_state_max_abs > 1e-3  # ... and the environment carries it into the trajectory


def test_lerobot_eval_drives_the_artifact(run, tmp_path):
    """LeRobot's own command, as a user types it, with the plugin pip-installed (into a folder of its own): the run
    named by --policy.type=zoo --policy.run, then by --policy.path of the policy folder written for it; the same
    seeds give the same episodes."""
    pytest.importorskip("datasets", reason="lerobot-eval needs lerobot's dataset extra")
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
                    str(site), str(REPO_ROOT / "lerobot_policy_zoo")], check=True, capture_output=True, timeout=300)
    by_run, said = lerobot_eval(["--policy.type=zoo", f"--policy.run={run}", "--policy.backend=eager"], site,
                                tmp_path / "eval-run")
    assert "No pretrained path was provided" in said  # LeRobot looks for --policy.path only
    assert policy_folder([str(run), str(tmp_path / "policy")]) == 0
    by_path, said = lerobot_eval([f"--policy.path={tmp_path / 'policy'}"], site, tmp_path / "eval-path")
    assert "No pretrained path was provided" not in said
    assert by_run["overall"]["n_episodes"] == by_path["overall"]["n_episodes"] == EPISODES
    rewards = [[(t["metrics"]["sum_rewards"], t["metrics"]["max_rewards"]) for t in info["per_task"]]
               for info in (by_run, by_path)]
    assert rewards[0] == rewards[1]


def lerobot_eval(policy: list, site: Path, out_dir: Path):
    """(eval_info.json, what lerobot-eval printed to stderr) of PushT episodes driven by the ``policy`` flags."""
    command = [str(Path(sys.executable).parent / "lerobot-eval"), *policy, "--env.type=pusht",
               f"--env.episode_length={STEPS}", f"--eval.n_episodes={EPISODES}", "--eval.batch_size=1",
               f"--rename_map={json.dumps(RENAME)}", f"--output_dir={out_dir}"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(command, capture_output=True, text=True, timeout=1200, env=env, cwd=out_dir.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out_dir / "eval_info.json").read_text()), proc.stderr
