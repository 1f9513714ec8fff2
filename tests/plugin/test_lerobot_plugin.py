"""lerobot_policy_zoo, the LeRobot plugin: LeRobot discovers it once pip installed it, ``--policy.type=zoo`` builds a
``ZooPolicy`` whose actions through LeRobot's own processors equal LeRobot's own ``FastWAMPolicy`` from the same
checkpoint (fast-wam-tiny, float32, eager backend), a task with no prompt file is embedded once with the
checkpoint's own text encoder and reused, and bad configs are refused with what to pass.

The whole simulated episodes (PushT, lerobot-eval itself) are tests/plugin/test_lerobot_closed_loop.py (e2e).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lerobot")
fast_wam = pytest.importorskip("zoo.policies.fast_wam.unit")

from lerobot.policies.factory import make_pre_post_processors  # noqa: E402

from lerobot_policy_zoo.configuration_zoo import ZooConfig, ZooConfigError  # noqa: E402
from lerobot_policy_zoo.modeling_zoo import ZooPolicy, ZooPolicyError  # noqa: E402
from support.environment import REPO_ROOT  # noqa: E402
from zoo.contract.recipes import load_recipe  # noqa: E402
from zoo.contract.run_folder import RunFolder  # noqa: E402
from zoo.export.tiny_hub import fabricated_hub  # noqa: E402

pytestmark = pytest.mark.policies

TINY = "fast-wam-tiny"
TASK = "open the drawer"  # no prompt file in the run: the plugin embeds it
CHUNK = 32


@pytest.fixture(scope="module")
def run(tiny_runs, tmp_path_factory):
    """A copy of the shared run (the plugin writes the new task's prompt into its prompts/)."""
    exported = tiny_runs(TINY)
    return exported.copy_to(tmp_path_factory.mktemp("plugin")), exported.checkpoint


@pytest.fixture(scope="module")
def lerobot(run):
    recipe = load_recipe(TINY)
    with fabricated_hub(recipe):  # the policy loads its VAE, UMT5 and tokenizer by Hub id
        return fast_wam.lerobot_policy(run[1], recipe)


def observations(count: int, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    return [{"observation.images.image": torch.rand(3, 64, 128, generator=g),
             "observation.state": torch.randn(8, generator=g), "task": TASK} for _ in range(count)]


def zoo_policy(run_dir: Path, **fields):
    """What lerobot-eval builds for --policy.type=zoo --policy.run=RUN_DIR: the policy, then the processors from the
    config's pretrained_path with eval's overrides."""
    config = ZooConfig(run=str(run_dir), device="cpu", **fields)
    policy = ZooPolicy(config).eval()
    pre, post = make_pre_post_processors(config, pretrained_path=str(config.pretrained_path),
                                         preprocessor_overrides={"device_processor": {"device": "cpu"}})
    return policy, pre, post


def episode(side, obs, seed: int = 0):
    policy, pre, post = side
    torch.manual_seed(seed)
    policy.reset()
    with torch.inference_mode():
        return torch.stack([post(policy.select_action(pre(dict(o)))) for o in obs])


def test_the_new_task_is_embedded_once_and_the_actions_are_lerobots(run, lerobot):
    """One chunk and the first action of the next, against LeRobot's FastWAMPolicy (which embeds the task with its
    own UMT5 every chunk); the task's prompt file is written by the first policy and loaded by the next."""
    run_dir = run[0]
    assert not RunFolder(run_dir).prompt_file(TASK).exists()
    obs = observations(CHUNK + 1)
    want = episode(lerobot, obs)
    got = episode(zoo_policy(run_dir), obs)
    assert got.shape == want.shape == (CHUNK + 1, 1, 7)
    assert float((got - want).norm() / want.norm()) <= 1e-5
    assert RunFolder(run_dir).prompt_file(TASK).is_file()
    # Reused: a policy that may not embed runs the task from the file the first one wrote.
    again = episode(zoo_policy(run_dir, embed_prompts=False), obs[:1])
    assert torch.equal(again, got[:1])


def test_a_new_task_without_embedding_is_refused_with_the_command(run):
    policy, pre, _ = zoo_policy(run[0], embed_prompts=False)
    obs = dict(observations(1)[0], task="wave at the camera")
    with pytest.raises(ZooPolicyError, match=r"(?s)no prompt embedding for task 'wave at the camera'.*python -m zoo "
                                             r"prompt"):
        policy.select_action(pre(obs))


def test_bad_configs_are_refused_with_what_to_pass(run, tmp_path):
    with pytest.raises(ZooConfigError, match="--policy.run=RUN_DIR"):
        ZooConfig(device="cpu").validate_features()
    with pytest.raises(ZooConfigError, match="not a zoo.runner backend; use one of: eager, artifact, executorch"):
        ZooConfig(run=str(run[0]), backend="tensorrt", device="cpu")
    with pytest.raises(Exception, match="neither a folder nor a Hub repo id"):
        ZooConfig(run=str(tmp_path / "missing" / "deep" / "run"), device="cpu")
    with pytest.raises(ZooConfigError, match="cannot be trained"):
        ZooConfig(run=str(run[0]), device="cpu").get_optimizer_preset()


def test_config_reads_the_runs_features_and_processors(run):
    config = ZooConfig(run=str(run[0]), device="cpu")
    assert config.type == "zoo"
    assert {k: (v.type.name, tuple(v.shape)) for k, v in config.input_features.items()} == {
        "observation.images.image": ("VISUAL", (3, 64, 128)), "observation.state": ("STATE", (8,))}
    assert tuple(config.output_features["action"].shape) == (7,)
    assert Path(config.pretrained_path) == RunFolder(run[0]).processors_dir


def test_lerobot_discovers_the_installed_plugin(tmp_path):
    """`pip install ./lerobot_policy_zoo` (into a folder of its own), then LeRobot's own discovery in a fresh
    interpreter: the zoo type is registered and its policy and processor factory are found by LeRobot's naming
    convention."""
    target = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--target", str(target), str(REPO_ROOT / "lerobot_policy_zoo")],
                         capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr[-2000:]
    probe = ("from lerobot.utils.import_utils import register_third_party_plugins\n"
             "from lerobot.configs.policies import PreTrainedConfig\n"
             "from lerobot.policies.factory import get_policy_class\n"
             "register_third_party_plugins()\n"
             "import importlib, lerobot_policy_zoo\n"
             "cls = PreTrainedConfig.get_choice_class('zoo')\n"
             "proc = importlib.import_module(cls.__module__.replace('configuration_', 'processor_'))\n"
             "print(cls.__name__, get_policy_class('zoo').__name__, proc.make_zoo_pre_post_processors.__name__,\n"
             "      lerobot_policy_zoo.__file__)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), str(REPO_ROOT)]))
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, env=env,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[:3] == ["ZooConfig", "ZooPolicy", "make_zoo_pre_post_processors"]
    assert out.stdout.split()[3].startswith(str(target))  # the installed copy, not the source folder
