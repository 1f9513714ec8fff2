"""The policy check for fast-wam-tiny on the CPU: zoo.runner (eager backend: the rewritten programs of a run
folder, no lerobot) against LeRobot's own ``FastWAMPolicy`` built from the same checkpoint, driven the way a
LeRobot control loop drives it (preprocessor, ``select_action``, postprocessor), over 3 action chunks.

The reference embeds the task with its own UMT5 on every chunk and draws its noise itself; the runner gets the
task's embedding from a prompt file and draws the noise from the numbers in host_settings.json.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lerobot")

from zoo.cli import deploy  # noqa: E402
from zoo.core.errors import PolicyCheckFailed  # noqa: E402
from zoo.export.policy_check import policy_check_step  # noqa: E402
from zoo.contract.recipes import load_recipe  # noqa: E402
from zoo.core.report import RunReport  # noqa: E402
from zoo.contract.run_folder import RunFolder  # noqa: E402
from zoo.runner import PromptEmbedding, RunnerError, load  # noqa: E402
from zoo.runner.check import ProcessedPolicy, policy_check  # noqa: E402
from zoo.runner.observations import load_observation  # noqa: E402
from zoo.export.tiny_hub import fabricated_hub  # noqa: E402


fast_wam = pytest.importorskip("zoo.policies.fast_wam.unit")

pytestmark = pytest.mark.policies

TINY = "fast-wam-tiny"
TASK = "pick up the black bowl"
CHUNK = 32  # the tiny recipe's n_action_steps


@pytest.fixture(scope="module")
def recipe():
    return load_recipe(TINY)


@pytest.fixture(scope="module")
def run(tiny_runs):
    """`python -m zoo.export fast-wam-tiny`, once for the session: read only (a test that changes it copies it)."""
    exported = tiny_runs(TINY)
    exported.check_exported()
    return exported.path, exported.checkpoint


@pytest.fixture(scope="module")
def lerobot(recipe, run):
    with fabricated_hub(recipe):  # the policy loads its VAE, UMT5 and tokenizer by Hub id
        return fast_wam.lerobot_policy(run[1], recipe)


@pytest.fixture(scope="module")
def prompt_file(lerobot, tmp_path_factory):
    return fast_wam.embed_prompt(lerobot[0], TASK).save(tmp_path_factory.mktemp("prompt") / "task.safetensors")


def observations(count: int, seed: int = 123):
    g = torch.Generator().manual_seed(seed)
    return [{"observation.images.image": torch.rand(3, 64, 128, generator=g),
             "observation.state": torch.randn(8, generator=g), "task": TASK} for _ in range(count)]


def runner_for(run_dir: Path, prompt_file: Path):
    runner = load(run_dir)
    runner.load_prompt(prompt_file)
    return runner


def test_policy_check_three_chunks(run, lerobot, prompt_file):
    runner = runner_for(run[0], prompt_file)
    result = policy_check(runner, ProcessedPolicy(*lerobot), observations(3 * CHUNK + 1), seed=0)
    assert [r.chunk for r in result.rows] == [1, 2, 3, 4] and [r.steps for r in result.rows] == [CHUNK] * 3 + [1]
    assert result.ok, result.table()
    assert max(r.rel_l2 for r in result.rows) <= 1e-5


def test_chunks_follow_the_observations(run, lerobot, prompt_file):
    """Not a constant: each chunk is predicted from its own observation (the noise is the same each chunk)."""
    runner = runner_for(run[0], prompt_file)
    obs = observations(2 * CHUNK)
    runner.reset()
    actions = torch.stack([runner.select_action(o) for o in obs])
    assert actions.shape == (2 * CHUNK, 1, 7)
    first, second = actions[:CHUNK], actions[CHUNK:]
    assert float((first - second).norm() / first.norm()) > 1e-3


def test_predict_action_chunk_matches_lerobot(run, lerobot, prompt_file):
    policy, pre, post = lerobot
    runner = runner_for(run[0], prompt_file)
    obs = observations(1, seed=5)[0]
    with torch.no_grad():
        want = post(policy.predict_action_chunk(pre(dict(obs))))
    got = runner.predict_action_chunk(dict(obs))
    assert got.shape == want.shape == (1, 32, 7)
    assert float((got - want).norm() / want.norm()) <= 1e-5


def broken_run(run_dir: Path, dest: Path) -> Path:
    """A copy of the run with one Euler delta of host_settings.json off by 1%."""
    shutil.copytree(run_dir, dest)
    settings = RunFolder(dest).read_host_settings()
    settings.deltas[3] *= 1.01
    RunFolder(dest).write_host_settings(settings)
    return dest


def test_perturbed_schedule_is_caught(run, lerobot, prompt_file, tmp_path):
    """One Euler delta off by 1% in host_settings.json: the policy check fails."""
    broken = broken_run(run[0], tmp_path / "broken")
    result = policy_check(runner_for(broken, prompt_file), ProcessedPolicy(*lerobot), observations(3 * CHUNK), seed=0)
    assert not result.ok and all(r.rel_l2 > 1e-5 for r in result.rows)


# The pipeline's own stage passing on the run as exported (seeded synthetic observations, 3 chunks, its table
# recorded) is tests/test_cli.py::test_policy_tiny_recipes_end_to_end[fast-wam-tiny], the same stage inside
# `python -m zoo.export fast-wam-tiny`.


def test_policy_check_stage_fails_the_run_on_a_perturbed_schedule(recipe, run, tmp_path):
    broken = broken_run(run[0], tmp_path / "broken")
    report = RunReport(broken, recipe.to_dict())
    with fabricated_hub(recipe), pytest.raises(PolicyCheckFailed) as info:
        policy_check_step(RunFolder(broken), recipe, report, where="cpu", checkpoint=run[1])
    # A clear table: every chunk, its relative L2 against LeRobot and the bound it broke.
    assert "chunk  actions" in info.value.message and "FAIL: relative L2" in info.value.message
    assert info.value.exit_code == 3
    assert report.get("failed_stage") == "policy_check"
    assert {s["stage"]: s["status"] for s in report.stages} == {"policy_check": "failed"}
    assert report.get("policy_check")["cpu"]["passed"] is False


def test_missing_prompt_names_the_command(run):
    runner = load(run[0])
    with pytest.raises(RunnerError, match="python -m zoo prompt"):
        runner.select_action(observations(1)[0])


def test_cuda_graphs_on_a_backend_that_has_none_is_refused(run):
    with pytest.raises(RunnerError, match="cuda_graphs=True replays the artifact's .so files; backend 'eager'"):
        load(run[0], backend="eager", cuda_graphs=True)


def test_prompt_of_another_policy_is_refused(run, prompt_file, tmp_path):
    other = PromptEmbedding.load(prompt_file)
    other.policy_type = "lingbot_va"
    with pytest.raises(RunnerError, match="lingbot_va"):
        load(run[0]).load_prompt(other.save(tmp_path / "other.safetensors"))


def test_other_schedule_is_refused(run, prompt_file):
    # A per-call option reaches the policy only past the preprocessor (LeRobot's own pipeline drops it), as in
    # LeRobot's loop: processors=False, the preprocessor applied by hand, the option added after it.
    runner = load(run[0], processors=False)
    runner.load_prompt(prompt_file)
    batch = runner.preprocessor(observations(1)[0])
    with pytest.raises(RunnerError, match="exported for 10 steps"):
        runner.select_action({**batch, "num_inference_steps": 4})


def test_per_call_options_do_not_pass_the_preprocessor(run, prompt_file):
    """As LeRobot's batch_to_transition drops them: the same actions with and without the option."""
    runner = runner_for(run[0], prompt_file)
    obs = observations(1, seed=6)[0]
    plain = runner.predict_action_chunk(dict(obs))
    assert torch.equal(runner.predict_action_chunk({**obs, "num_inference_steps": 4}), plain)


def test_vae_encode_is_the_wan_vae_by_hand(run, lerobot):
    """The exported first-frame encode against diffusers' AutoencoderKLWan called directly, normalised by hand."""
    policy = lerobot[0]
    vae = policy.model.vae.vae
    runner = load(run[0])
    image = torch.rand(1, 3, 64, 128, generator=torch.Generator().manual_seed(9))
    got = runner.call("vae_encode", image=image)["first_frame_latents"]
    with torch.no_grad():
        mu = vae.encode((image * 2 - 1).unsqueeze(2)).latent_dist.mode().float()
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    want = (mu - mean) / std
    assert got.shape == want.shape == (1, 48, 1, 4, 8)
    assert float((got - want).norm() / want.norm()) <= 1e-6


def test_runner_imports_no_model_libraries():
    code = ("import sys, zoo.runner, zoo.runner.fast_wam, zoo.runner.lingbot_va, zoo.runner.check; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('lerobot', 'transformers', 'diffusers')); "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- python -m zoo prompt / act ----------------------------------------------------------------------------


def test_prompt_command_writes_lerobots_own_embedding(run, lerobot, tmp_path, capsys):
    out = tmp_path / "task.safetensors"
    assert deploy.prompt_main([str(run[0]), TASK, "-o", str(out)]) == 0
    got = PromptEmbedding.load(out)
    want = fast_wam.embed_prompt(lerobot[0], TASK)  # LeRobot's encode_prompt of the templated task
    assert got.task == TASK and got.policy_type == "fastwam" and got.text == want.text
    for name in ("context", "context_mask"):
        assert torch.equal(got.tensors[name], want.tensors[name])


def test_act_command_prints_lerobots_action_chunk(run, lerobot, tmp_path, capsys):
    obs_file = tmp_path / "obs.safetensors"
    assert deploy.act_main([str(run[0]), "--example-observation", str(obs_file), "--task", TASK, "--seed", "4"]) == 0
    batch = load_observation(obs_file)
    assert batch["task"] == TASK and batch["observation.images.image"].shape == (3, 64, 128)
    prompt = tmp_path / "task.safetensors"
    fast_wam.embed_prompt(lerobot[0], TASK).save(prompt)
    capsys.readouterr()
    assert deploy.act_main([str(run[0]), "--observation", str(obs_file), "--prompt", str(prompt), "--json"]) == 0
    got = torch.tensor(json.loads(capsys.readouterr().out))
    policy, pre, post = lerobot
    with torch.no_grad():
        want = post(policy.predict_action_chunk(pre(dict(load_observation(obs_file)))))[0]
    assert got.shape == want.shape == (32, 7)
    assert float((got - want).norm() / want.norm()) <= 1e-5
    # The table form names the shape and the backend.
    assert deploy.act_main([str(run[0]), "--observation", str(obs_file), "--prompt", str(prompt)]) == 0
    text = capsys.readouterr().out
    assert "action chunk [1, 32, 7]" in text and "(eager, cpu)" in text and "step  a0" in text


def test_act_without_its_prompt_names_the_prompt_command(run, tmp_path, capsys):
    obs_file = tmp_path / "obs.safetensors"
    deploy.act_main([str(run[0]), "--example-observation", str(obs_file), "--task", "wave"])
    from zoo.__main__ import main

    assert main(["act", str(run[0]), "--observation", str(obs_file)]) == 2
    err = capsys.readouterr().err
    assert "no prompt embedding for task 'wave'" in err and "python -m zoo prompt" in err


def test_the_state_the_host_loop_keeps_is_in_the_runs_signatures(run):
    """What backend="executorch" keeps on the GPU: the prefill's video K/V, fed to action_step's inputs of the same
    names (checked against the exported io_spec.json); a name the run does not have is refused."""
    from zoo.runner.backends import check_state
    from zoo.runner.fast_wam import FastWAMRunner

    methods = RunFolder(run[0]).read_io_spec().methods
    state = FastWAMRunner.device_state(RunFolder(run[0]).read_host_settings())
    check_state(state, methods)
    assert state == {"prefill": {"video_k": "video_k", "video_v": "video_v"}}
    assert {"video_k", "video_v"} <= {s.name for s in methods["action_step"].inputs}
    with pytest.raises(RunnerError, match="keeps output 'video_q' of 'prefill'"):
        check_state({"prefill": {"video_q": "video_k"}}, methods)
