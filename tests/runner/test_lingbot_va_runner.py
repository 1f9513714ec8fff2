"""The policy check for lingbot-va-tiny on the CPU: zoo.runner (eager backend: the rewritten video_step,
action_step and streaming VAE programs, no lerobot) against LeRobot's own ``LingBotVAPolicy`` from the same
checkpoint, driven as a LeRobot control loop drives it, over 3 chunks (12, 16 and 16 actions) and one more
step: the keyframe buffering, the KV feedback of observed frames and executed actions, slot reuse and (in the
third chunk) eviction, CFG and both schedulers. Both episodes draw their noise from the global generator
after the same ``torch.manual_seed``.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("lerobot")

from zoo.core.errors import PolicyCheckFailed  # noqa: E402
from zoo.export.policy_check import policy_check_step  # noqa: E402
from zoo.contract.recipes import load_recipe  # noqa: E402
from zoo.core.report import RunReport  # noqa: E402
from zoo.contract.run_folder import RunFolder  # noqa: E402
from zoo.runner import PromptEmbedding, RunnerError, load  # noqa: E402
from zoo.runner.check import ProcessedPolicy, compare_episode, run_episode  # noqa: E402
from zoo.export.tiny_hub import fabricated_hub  # noqa: E402
from support import shared_runs  # noqa: E402
from support.lingbot_va_tiny import TEXT_EMB_STEPS  # noqa: E402


lingbot_va = pytest.importorskip("zoo.policies.lingbot_va.unit")

pytestmark = pytest.mark.policies

TINY = "lingbot-va-tiny"
TASK = "pick up the bowl"
STEPS = 12 + 16 + 16 + 1  # three chunks and the first action of a fourth


@pytest.fixture(scope="module")
def recipe():
    return load_recipe(TINY)


@pytest.fixture(scope="module")
def run(tiny_runs):
    """`python -m zoo.export lingbot-va-tiny`, once for the session: read only (a test that changes it copies it)."""
    exported = tiny_runs(TINY)
    exported.check_exported()
    return exported.path, exported.checkpoint


@pytest.fixture(scope="module")
def lerobot(recipe, run):
    with fabricated_hub(recipe):
        return lingbot_va.lerobot_policy(run[1], recipe)


@pytest.fixture(scope="module")
def prompt_file(lerobot, tmp_path_factory):
    return lingbot_va.embed_prompt(lerobot[0], TASK).save(tmp_path_factory.mktemp("prompt") / "task.safetensors")


@pytest.fixture(scope="module")
def observations():
    g = torch.Generator().manual_seed(123)
    return [{"observation.images.image": torch.rand(3, 64, 64, generator=g),
             "observation.images.image2": torch.rand(3, 64, 64, generator=g), "task": TASK} for _ in range(STEPS)]


@pytest.fixture(scope="module")
def expected(lerobot, observations):
    return run_episode(ProcessedPolicy(*lerobot), observations, seed=0)


def runner_for(run_dir, prompt_file):
    runner = load(run_dir)
    runner.load_prompt(prompt_file)
    return runner


def test_policy_check_three_chunks(run, prompt_file, observations, expected):
    """The recipe's run against LeRobot's select_action. Its DiT steps take the prompt's cross-attention K/V from
    ``prompt_kv``, which LeRobot computes in every call: the runner makes them once for the episode."""
    steps = RunFolder(run[0]).read_io_spec().methods["action_step"]
    assert {"text_k", "text_v"} <= {s.name for s in steps.inputs} and "text_emb" not in {s.name for s in steps.inputs}
    calls = _episode_calls(run[0], prompt_file, observations, expected)
    assert calls.count("prompt_kv") == 1 and calls.count("action_step") > 20, sorted(set(calls))
    # Not a constant: the chunks differ (new noise, new observations fed back).
    first, second = torch.stack(expected[:12]), torch.stack(expected[12:24])
    assert float((first - second).norm() / first.norm()) > 1e-2


def _episode_calls(run_dir, prompt_file, observations, expected):
    """The policy check of one episode on ``run_dir``, and the methods the runner called, in order."""
    runner = runner_for(run_dir, prompt_file)
    calls = []
    call = runner.backend.call
    runner.backend.call = lambda method, **inputs: calls.append(method) or call(method, **inputs)
    result = compare_episode(runner, expected, observations, seed=0)
    assert [(r.chunk, r.steps) for r in result.rows] == [(1, 12), (2, 16), (3, 16), (4, 1)], result.table()
    assert result.ok, result.table()
    return calls


def broken_run(run_dir, dest):
    """A copy of the run with one video sigma of host_settings.json off by 1%."""
    shutil.copytree(run_dir, dest)
    settings = RunFolder(dest).read_host_settings()
    settings.scheduler.video.sigmas[5] *= 1.01
    RunFolder(dest).write_host_settings(settings)
    return dest


def test_perturbed_video_schedule_is_caught(run, prompt_file, observations, expected, tmp_path):
    broken = broken_run(run[0], tmp_path / "broken")
    result = compare_episode(runner_for(broken, prompt_file), expected[:12], observations[:12], seed=0, min_chunks=1)
    assert not result.ok and result.rows[0].rel_l2 > 1e-5, result.table()


def test_policy_check_stage_fails_on_a_perturbed_video_schedule(recipe, run, tmp_path):
    """The pipeline's own stage over 3 chunks of seeded synthetic observations: a 1% error in one sigma fails it
    with a table; the same stage on the run as exported passes (test_policy_check_three_chunks is the same
    comparison on hand-made observations)."""
    broken = broken_run(run[0], tmp_path / "broken")
    report = RunReport(broken, recipe.to_dict())
    with fabricated_hub(recipe), pytest.raises(PolicyCheckFailed) as info:
        policy_check_step(RunFolder(broken), recipe, report, where="cpu", checkpoint=run[1])
    assert "FAIL: relative L2" in info.value.message
    rows = report.get("policy_check")["cpu"]["rows"]
    assert [r["steps"] for r in rows] == [12, 16, 16, 1] and not rows[0]["ok"]


def test_missing_camera_is_refused(run, prompt_file, observations):
    runner = runner_for(run[0], prompt_file)
    obs = dict(observations[0])
    del obs["observation.images.image2"]
    with pytest.raises(RunnerError, match="observation.images.image2"):
        runner.select_action(obs)


def test_prompt_without_negative_is_refused_under_cfg(run, prompt_file, observations, tmp_path):
    prompt = PromptEmbedding.load(prompt_file)
    del prompt.tensors["negative_prompt_embeds"]
    runner = load(run[0])
    runner.load_prompt(prompt.save(tmp_path / "no-negative.safetensors"))
    with pytest.raises(RunnerError, match="negative"):
        runner.select_action(observations[0])


@pytest.mark.e2e  # a second tiny export and episode; the steps themselves: tests/policies/test_lingbot_va.py
def test_a_run_whose_steps_take_the_prompt_embedding_matches_lerobot(shared_cache, prompt_file, observations,
                                                                     expected):
    """Without prompt_kv the DiT steps take the prompt's embedding and compute its K/V in every call, as LeRobot's
    transformer does: the same actions, and no prompt_kv call."""
    exported = shared_runs.tiny_run(shared_cache, TINY, TEXT_EMB_STEPS, label="text-emb")
    exported.check_exported()
    steps = RunFolder(exported.path).read_io_spec().methods["action_step"]
    assert "text_emb" in {s.name for s in steps.inputs} and "text_k" not in {s.name for s in steps.inputs}
    calls = _episode_calls(exported.path, prompt_file, observations, expected)
    assert "prompt_kv" not in calls and calls.count("action_step") > 20, sorted(set(calls))


def as_lowered(run_dir, dest):
    """A copy of the run that the executorch backend takes for lowered: a stand-in ``model.pte`` (the fake
    zoo_runner runs ``exported.*.pt2``) and the runtime requirement a lowering writes."""
    from zoo.contract.releases import lowering_requirement

    shutil.copytree(run_dir, dest)
    (dest / "model.pte").write_bytes(b"stands in for the program; the fake runs exported.*.pt2")
    io_spec = RunFolder(dest).read_io_spec().methods
    planned = {m: {"inputs": [False] * len(io.inputs), "outputs": [False] * len(io.outputs)}
               for m, io in io_spec.items()}
    RunFolder(dest).write_runtime_requirement(lowering_requirement("1.2.0", planned).as_dict())
    return dest


def test_executorch_backend_keeps_the_kv_pool_and_vae_caches_in_the_runtime(run, prompt_file, observations, expected,
                                                                           fake_zoo_runner, monkeypatch, tmp_path):
    """The same policy check over backend="executorch" (the fake zoo_runner runs the exported programs): the
    actions match LeRobot's, and the KV pool and the VAE caches never leave the runtime: no file of theirs is
    written, and the runner copies none of them (``rescued``, ``host_copies``)."""
    from zoo.runtimes import executorch as et_runtime

    lowered = as_lowered(run[0], tmp_path / "lowered")
    io_spec = RunFolder(lowered).read_io_spec().methods
    shapes = {name: tuple(spec.shape) for io in io_spec.values() for spec in io.inputs
              for name in ("k_pool", "v_pool") if spec.name == name}
    shapes.update({spec.name: tuple(spec.shape) for spec in io_spec["vae_encode"].inputs[1:]})
    written = []
    original = et_runtime.write_tensor
    monkeypatch.setattr(et_runtime, "write_tensor",
                        lambda path, t, **how: written.append(tuple(t.shape)) or original(path, t, **how))
    runner = load(lowered, backend="executorch", device="cpu", et_runner=fake_zoo_runner)
    try:
        runner.load_prompt(prompt_file)
        result = compare_episode(runner, expected, observations, seed=0)
        stats = dict(runner.backend.session.stats)
    finally:
        runner.close()
    assert [(r.chunk, r.steps) for r in result.rows] == [(1, 12), (2, 16), (3, 16), (4, 1)], result.table()
    assert result.ok, result.table()
    assert stats["calls"] > 20 and stats["rescued"] == 0 and stats["host_copies"] == 0
    assert written and not set(shapes.values()) & set(written), (shapes, sorted(set(written)))


# --- the "buffer" layout: the KV pool inside the DiT methods, one copy shared by both ----------------------------

# Two episodes in the pipeline's policy check, on one runner: the second starts with the first's K/V in the pool.
BUFFER = ["lowering.kv_pool=buffer", "policy_check.episodes=2"]


@pytest.fixture(scope="module")
def buffer_run(shared_cache):
    """`python -m zoo.export lingbot-va-tiny lowering.kv_pool=buffer policy_check.episodes=2`, once a session."""
    exported = shared_runs.tiny_run(shared_cache, TINY, BUFFER, label="kv-buffer")
    exported.check_exported()
    return exported.path


@pytest.mark.e2e  # the buffer layout's own tiny export (~75 s on 2 cores)
def test_buffer_layout_passes_the_policy_check_over_two_episodes_of_one_runner(buffer_run, recipe):
    """The export's own CPU policy check against LeRobot's select_action, float32, at the io layout's tolerance:
    the steps take and return no pool, which lives in one K and one V buffer per layer that both DiT programs hold
    and the eager runner shares; the runner is not cleared between the episodes (stale K/V sit in masked slots)."""
    report = json.loads((buffer_run / "report.json").read_text())
    check = report["policy_check"]["cpu"]
    assert check["passed"] and check["rule"] == "float32", check["table"]
    assert len(check["rows"]) == 2 * (recipe.policy_check.chunks + 1)  # two episodes of 4 chunks
    assert {r["bound"] for r in check["rows"]} == {recipe.policy_check.tolerance.float32}
    run = RunFolder(buffer_run)
    settings = run.read_host_settings()
    assert settings.kv_pool.layout == "buffer"
    for method in ("video_step", "action_step"):
        io = run.read_io_spec().methods[method]
        assert not {"k_pool", "v_pool"} & {s.name for s in io.inputs} and len(io.outputs) == 1
        program = run.load_program("rewritten", method)
        held = {spec.target for spec in program.graph_signature.input_specs if spec.kind.name == "BUFFER"}
        assert held == set(settings.kv_pool.buffer_names()) == {"k_pool_0", "v_pool_0", "k_pool_1", "v_pool_1"}


@pytest.mark.e2e  # the buffer layout's own tiny export (~75 s on 2 cores)
def test_a_runner_whose_two_methods_keep_separate_pools_fails_the_policy_check(buffer_run, prompt_file, observations,
                                                                               expected):
    """Built to fail: action_step given a pool of its own (as a runtime that does not share them would) no longer
    sees video_step's K/V, and the policy check against LeRobot says so; the same runner before the change
    passes the same chunk."""
    runner = runner_for(buffer_run, prompt_file)
    first = compare_episode(runner, expected[:12], observations[:12], seed=0, min_chunks=1)
    assert first.ok, first.table()
    action = runner.backend._module("action_step")
    for name in runner.settings.kv_pool.buffer_names():  # empty, as a runtime loads each method's own from its blob
        action.register_buffer(name, torch.zeros_like(action.get_buffer(name)))
    broken = compare_episode(runner, expected[:12], observations[:12], seed=0, min_chunks=1)
    assert not broken.ok and broken.rows[0].rel_l2 > 1e-2, broken.table()


@pytest.mark.e2e  # the buffer layout's own tiny export (~75 s on 2 cores)
def test_a_backend_that_would_not_share_the_pool_is_refused_at_load(buffer_run, monkeypatch):
    from zoo.runner.state import SharedBuffers

    monkeypatch.setattr(SharedBuffers, "adopt", lambda self, module, program: None)  # each program its own pool
    with pytest.raises(RunnerError, match="does not give video_step and action_step one KV pool.*separate copies"):
        load(buffer_run)


def with_weight_blobs(lowered, blobs):
    """Give the lowered copy what a lowering records of the DiT methods' constants: ``so/<method>.io.json``
    listing the pool buffers each writes, and an ``aoti_cuda_blob.ptd`` whose ``<method>_weights_blob`` entries
    hold ``blobs[method]`` (identical bytes: one segment, as one constant table gives)."""
    from zoo.contract.artifact import DataEntry
    from zoo.export.lower.assemble import write_data_file

    run = RunFolder(lowered)
    names = run.read_host_settings().kv_pool.buffer_names()
    entries = []
    for method, data in blobs.items():
        run.write_io_order(method, {"mutable_buffers": {name: 0 for name in names}})
        path = lowered / f"{method}.blob"
        path.write_bytes(data)
        entries.append(DataEntry(f"{method}_weights_blob", path, 0, len(data)))
    write_data_file(entries, run.ptd)
    return lowered


ONE_TABLE = {"video_step": b"weights" * 64, "action_step": b"weights" * 64}


@pytest.mark.e2e  # the buffer layout's own tiny export (~75 s on 2 cores)
def test_executorch_backend_shares_the_pool_inside_the_runtime(buffer_run, prompt_file, observations, expected,
                                                              fake_zoo_runner, tmp_path):
    """Over backend="executorch" (the fake zoo_runner shares the methods' buffers by name, as the CUDA backend with
    weight sharing does for one constant table): the first chunk and the feedback into the second match LeRobot's,
    and no pool crosses the pipe."""
    lowered = with_weight_blobs(as_lowered(buffer_run, tmp_path / "lowered"), ONE_TABLE)
    runner = load(lowered, backend="executorch", device="cpu", et_runner=fake_zoo_runner)
    try:
        runner.load_prompt(prompt_file)
        result = compare_episode(runner, expected[:13], observations[:13], seed=0, min_chunks=1)
        stats = dict(runner.backend.session.stats)
    finally:
        runner.close()
    assert [(r.chunk, r.steps) for r in result.rows] == [(1, 12), (2, 1)] and result.ok, result.table()
    assert stats["rescued"] == 0 and stats["host_copies"] == 0


@pytest.mark.parametrize("case, blobs, match", [
    ("no-sharing", ONE_TABLE, "shares no constants between methods"),
    ("", {"video_step": b"weights" * 64, "action_step": b"others!" * 64},
     "weights blobs of video_step, action_step differ"),
])
@pytest.mark.e2e  # the buffer layout's own tiny export (~75 s on 2 cores)
def test_executorch_backend_that_cannot_share_the_pool_is_refused(buffer_run, fake_zoo_runner, monkeypatch, tmp_path,
                                                                  case, blobs, match):
    """A zoo_runner without weight sharing across methods, or methods whose constant tables differ (ExecuTorch's
    weight sharing then loads each method's own copy): refused before any call, with what to do."""
    monkeypatch.setenv("FAKE_ZOO_RUNNER_MODE", case)
    lowered = with_weight_blobs(as_lowered(buffer_run, tmp_path / "lowered"), blobs)
    with pytest.raises(RunnerError, match=match) as info:
        load(lowered, backend="executorch", device="cpu", et_runner=fake_zoo_runner)
    assert "lowering.kv_pool=io" in info.value.hint
