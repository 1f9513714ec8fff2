"""The deploy half's command lines and files without lerobot: observation files, the synthetic sequence, and
the clear errors of `python -m zoo prompt` / `python -m zoo act` (the runs themselves: tests/runner/test_*_runner)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from zoo.cli import deploy
from zoo.__main__ import main
from zoo.core.errors import RunnerError
from zoo.contract.io_spec import IoSpec
from zoo.contract.recipes import load_recipe
from zoo.contract.run_folder import RunFolder
from zoo.runner.observations import load_observation, save_observation, synthetic_observations

from support.contract_cases import fast_wam_settings, llama_settings

# Its observation features: observation.state STATE [8], observation.images.image VISUAL [3, 4, 6].
SETTINGS = fast_wam_settings()


def test_synthetic_observations_are_drawn_as_documented():
    steps = synthetic_observations(SETTINGS, 2, seed=5, task="pick")
    # By hand: one generator seeded 5, per step the features in sorted key order, VISUAL uniform, others normal.
    g = torch.Generator().manual_seed(5)
    for obs in steps:
        image = torch.rand([3, 4, 6], generator=g)
        state = torch.randn([8], generator=g)
        assert torch.equal(obs["observation.images.image"], image) and torch.equal(obs["observation.state"], state)
        assert obs["task"] == "pick"
    assert not torch.equal(steps[0]["observation.state"], steps[1]["observation.state"])


def test_observation_file_round_trip_and_a_damaged_one(tmp_path):
    (obs,) = synthetic_observations(SETTINGS, 1, seed=0, task="pick up the bowl")
    path = save_observation(obs, tmp_path / "obs.safetensors")
    back = load_observation(path)
    assert back.keys() == obs.keys() and back["task"] == "pick up the bowl"
    assert all(torch.equal(back[k], obs[k]) for k in obs if k != "task")
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(RunnerError, match="not a safetensors observation file"):
        load_observation(tmp_path / "bad.safetensors")
    with pytest.raises(RunnerError, match="--example-observation"):
        load_observation(tmp_path / "missing.safetensors")


def test_act_on_a_run_the_runner_has_no_loop_for(tmp_path, capsys):
    run = RunFolder(tmp_path / "run")
    run.path.mkdir()
    run.write_host_settings(llama_settings())
    run.write_io_spec(IoSpec(dtype="float32", methods={}))
    save_observation({"observation.state": torch.zeros(2)}, tmp_path / "obs.safetensors")
    assert main(["act", str(run.path), "--observation", str(tmp_path / "obs.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "no host loop for the policy" in err and "family 'llama'" in err and "fastwam, lingbot_va" in err


def test_act_without_an_observation_says_how_to_make_one(tmp_path, capsys):
    assert main(["act", str(tmp_path)]) == 2
    assert "--example-observation" in capsys.readouterr().err


def test_prompt_needs_lerobot_and_a_policy_with_an_action_loop(tmp_path, monkeypatch, capsys):
    run = RunFolder(tmp_path / "run")
    run.path.mkdir()
    run.write_recipe(load_recipe("llama-rope-tiny"))
    assert main(["prompt", str(run.path), "hello"]) == 2
    assert "not applicable: llama has no action loop" in capsys.readouterr().err
    run.write_recipe(load_recipe("fast-wam-tiny"))
    real = importlib.util.find_spec
    monkeypatch.setattr(deploy.importlib.util, "find_spec", lambda name, *a: None if name == "lerobot" else real(name, *a))
    assert main(["prompt", str(run.path), "pick up the bowl"]) == 2
    err = capsys.readouterr().err
    assert "needs lerobot" in err and "the robot needs only the prompt file" in err


def test_prompt_files_of_a_run_go_into_its_prompts_folder(tmp_path):
    run = RunFolder(tmp_path)
    a, b = run.prompt_file("pick up the bowl"), run.prompt_file("pick up the bowl!")
    assert a.parent == run.prompts_dir and a.name.startswith("pick-up-the-bowl-") and a != b
    assert run.prompt_files() == []
