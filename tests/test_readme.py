"""Every command in README.md works as written from a fresh clone.

The commands are read from the README's ```bash blocks. Which of them need a GPU or the network is said here,
by hand, for each command (never guessed from its text): a command the README gains fails
``test_every_readme_command_is_classified`` until it is added below. The others run here, in a folder laid
out like a fresh clone after ``scripts/setup.sh`` (the ``readme_clone`` fixture), exactly as written: the first
block's commands with ``.venv/bin/python``, every later one after ``source .venv/bin/activate``, as the README
says. Each must exit 0.
"""

from __future__ import annotations

import re
from typing import List

import pytest

from support.environment import REPO_ROOT
from support.shared_runs import run_in_clone

SETUP = "scripts/setup.sh && "  # .ci/run runs setup.sh before the tests: the rest of such a line runs here

# Every README command: what it needs. "run": runs here, offline on a CPU.
KINDS = {
    "scripts/setup.sh && .venv/bin/python -m zoo.export llama-rope-tiny": "run",
    "scripts/setup.sh && .venv/bin/python -m pytest -q": "ci: .ci/run is this command",
    "python -m zoo list": "run",
    "python -m zoo list 'lingbot*'": "run",
    "python -m zoo.export llama-rope unit.dtype=float32 verify.seeds=[0,1] --output-dir runs/smol-fp32":
        "network: downloads SmolLM2-135M",
    "python -m zoo.export llama-rope source.local_dir=/data/SmolLM2-135M": "a checkpoint folder of the user's",
    "python -m zoo doctor": "run",
    "python -m zoo doctor runs/llama-rope-tiny": "run",
    "python -m zoo lower --help": "run",
    "python -m zoo lower runs/llama-rope-tiny": "gpu",
    "python -m zoo audit runs/llama-rope-tiny --json": "gpu: audits the lowered artifact",
    "python -m zoo bundle BUNDLE --have-file scripts/have/h200-cuda-image.txt --recipe llama-rope-tiny "
    "--recipe lingbot-va-tiny --recipe fast-wam-tiny": "network: pip downloads wheels",
    "tools/gpu_check.sh BUNDLE llama-rope-tiny lingbot-va-tiny fast-wam-tiny": "gpu",
    "python -m zoo lower runs/llama-rope-tiny --target a100": "gpu: an H100/H200 lowering for the A100",
    "python -m zoo audit runs/llama-rope-tiny": "gpu: audits the lowered artifact",
    "python tools/gpu_targets_check.py --out /tmp/targets --tests": "gpu: lowers and verifies on this GPU",
    # The deploy commands need a fast-wam-tiny run folder (an export with LeRobot's policy check, minutes here);
    # tests/runner/test_deploy_cli.py and tests/runner/test_fast_wam_runner.py drive the same code on one.
    'python -m zoo prompt runs/fast-wam-tiny "pick up the bowl"': "a fast-wam-tiny run folder",
    'python -m zoo act runs/fast-wam-tiny --example-observation obs.safetensors --task "pick up the bowl"':
        "a fast-wam-tiny run folder",
    "python -m zoo act runs/fast-wam-tiny --observation obs.safetensors": "a fast-wam-tiny run folder",
    # The LeRobot plugin's commands need a fast-wam-tiny.pusht run, the plugin and gym-pusht installed, and whole
    # simulated episodes (minutes): tests/plugin/test_lerobot_closed_loop.py runs both as written (e2e).
    "lerobot-eval --policy.type=zoo --policy.run=runs/fast-wam-tiny.pusht --policy.backend=eager --env.type=pusht "
    "--rename_map='{\"observation.image\": \"observation.images.image\"}' --eval.n_episodes=2":
        "the plugin and gym-pusht installed, a fast-wam-tiny.pusht run (e2e test)",
    "python -m lerobot_policy_zoo.closed_loop runs/fast-wam-tiny.pusht --episodes 2 --steps 200 "
    "--rename_map '{\"observation.image\": \"observation.images.image\"}'":
        "the plugin and gym-pusht installed, a fast-wam-tiny.pusht run (e2e test)",
}


def readme_commands(text: str) -> List[str]:
    """The commands of the README's bash blocks, in order: continuation lines joined, comments left out."""
    commands: List[str] = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", "", block)
        for line in joined.splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            if line and not line.startswith("#"):
                commands.append(" ".join(line.split()))
    return commands


COMMANDS = readme_commands((REPO_ROOT / "README.md").read_text())


def test_every_readme_command_is_classified():
    assert COMMANDS, "no ```bash block in README.md"
    assert set(COMMANDS) == set(KINDS), {"unclassified": sorted(set(COMMANDS) - set(KINDS)),
                                         "gone from the README": sorted(set(KINDS) - set(COMMANDS))}


def test_the_readme_says_to_activate_the_venv_once():
    text = (REPO_ROOT / "README.md").read_text()
    assert "source .venv/bin/activate" in text
    first_block = re.findall(r"```bash\n(.*?)```", text, re.S)[0]
    assert all(line.startswith(SETUP + ".venv/bin/python") for line in first_block.strip().splitlines())


@pytest.mark.policies
def test_readme_commands_that_need_no_gpu_or_network(readme_clone, tiny_runs):
    tiny_runs("llama-rope-tiny").check_exported()  # the first command, run once for the session in readme_clone
    ran = [COMMANDS[0]]
    first_block = len(re.findall(r"```bash\n(.*?)```", (REPO_ROOT / "README.md").read_text(), re.S)[0]
                      .strip().splitlines())
    for index, command in enumerate(COMMANDS):
        if KINDS[command] != "run" or command in ran:
            continue
        proc = run_in_clone(readme_clone, command.removeprefix(SETUP), activate=index >= first_block)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        assert "Traceback" not in proc.stderr, f"{command}\n{proc.stderr[-2000:]}"
        ran.append(command)
    assert len(ran) == sum(1 for k in KINDS.values() if k == "run")
