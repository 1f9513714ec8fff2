"""lerobot_policy_zoo, the LeRobot plugin: LeRobot discovers it once pip installed it, ``--policy.type=zoo`` builds a
``ZooPolicy`` whose actions through LeRobot's own processors equal LeRobot's own ``FastWAMPolicy`` from the same
checkpoint (fast-wam-tiny, float32, eager backend), a task with no prompt file is embedded once with the
checkpoint's own text encoder and reused, and bad configs are refused with what to pass. The policy folder
(`python -m lerobot_policy_zoo.policy_folder RUN OUT`), loaded the ways LeRobot's tools load a `--policy.path`,
gives the actions of the `--policy.run` route and of LeRobot's own policy, with its own processor files (LeRobot's
async policy server included, where its extra is installed); bad input is refused before anything is written.

The whole simulated episodes (PushT, lerobot-eval itself) are tests/plugin/test_lerobot_closed_loop.py (e2e).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("lerobot")
fast_wam = pytest.importorskip("zoo.policies.fast_wam.unit")

from lerobot.configs.policies import PreTrainedConfig  # noqa: E402
from lerobot.configs.types import FeatureType, PolicyFeature  # noqa: E402
from lerobot.envs.configs import PushtEnv  # noqa: E402
from lerobot.policies.factory import get_policy_class, make_policy, make_pre_post_processors  # noqa: E402

from lerobot_policy_zoo.configuration_zoo import ZooConfig, ZooConfigError  # noqa: E402
from lerobot_policy_zoo.modeling_zoo import ZooPolicy, ZooPolicyError  # noqa: E402
from lerobot_policy_zoo.policy_folder import main as policy_folder  # noqa: E402
from lerobot_policy_zoo.processor_zoo import make_zoo_pre_post_processors  # noqa: E402
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


# --- the policy folder: what LeRobot's --policy.path names ------------------------------------------------------

CPU = {"device_processor": {"device": "cpu"}}


def tiny_env():
    """An environment config with fast-wam-tiny's features, for make_policy's feature checks (lerobot-eval builds
    the policy from its --env's features; no simulation is made)."""
    env = PushtEnv()
    env.features = {"action": PolicyFeature(type=FeatureType.ACTION, shape=(7,)),
                    "pixels": PolicyFeature(type=FeatureType.VISUAL, shape=(64, 128, 3)),
                    "agent_pos": PolicyFeature(type=FeatureType.STATE, shape=(8,))}
    env.features_map = {"action": "action", "pixels": "observation.images.image", "agent_pos": "observation.state"}
    return env


def as_lerobot_eval(folder: Path):
    """lerobot-eval's and lerobot-rollout's route: the config read from --policy.path, pretrained_path set to it,
    the policy by make_policy, the processors from pretrained_path."""
    config = PreTrainedConfig.from_pretrained(folder)
    config.pretrained_path = folder
    policy = make_policy(config, env_cfg=tiny_env()).eval()
    pre, post = make_pre_post_processors(config, pretrained_path=config.pretrained_path,
                                         preprocessor_overrides={**CPU, "rename_observations_processor":
                                                                 {"rename_map": {}}})
    return policy, pre, post


def as_policy_server(folder: Path):
    """The async policy server's route (SendPolicyInstructions): the class of the policy type, from_pretrained of
    pretrained_name_or_path, the processors from the same path."""
    policy = get_policy_class("zoo").from_pretrained(str(folder)).eval()
    pre, post = make_pre_post_processors(policy.config, pretrained_path=str(folder), preprocessor_overrides=CPU,
                                         postprocessor_overrides=CPU)
    return policy, pre, post


def preprocessed_state(processors, obs) -> torch.Tensor:
    return processors[0](dict(obs))["observation.state"]


def test_the_policy_folder_gives_the_runs_actions_through_lerobots_loaders(run, lerobot, tmp_path, capsys):
    """One chunk and the first action of the next, through the two ways LeRobot's tools load a --policy.path
    folder, after the run's own processor statistics were changed (the folder's own are the ones used): equal to
    the --policy.run route and to LeRobot's own FastWAMPolicy from the checkpoint. (Each zoo policy loads the
    artifact's programs, 2.5 s on two cores: the plugin's own factory is checked on its processors only.)"""
    run_dir = shutil.copytree(run[0], tmp_path / "run" / TINY)
    fast_wam.embed_prompt(lerobot[0], TASK).save(RunFolder(run_dir).prompt_file(TASK))  # no second encoder build
    obs = observations(CHUNK + 1)
    want = episode(lerobot, obs)
    by_run = episode(zoo_policy(run_dir), obs)

    folder = tmp_path / "policy"
    assert policy_folder([str(run_dir), str(folder)]) == 0
    assert f"policy folder: {folder}" in capsys.readouterr().out
    written = json.loads((folder / "config.json").read_text())
    assert {k: written[k] for k in ("type", "run", "backend", "device", "pretrained_path")} == {
        "type": "zoo", "run": str(run_dir.resolve()), "backend": "eager", "device": "cpu", "pretrained_path": None}
    assert written["input_features"]["observation.images.image"] == {"type": "VISUAL", "shape": [3, 64, 128]}
    assert written["output_features"] == {"action": {"type": "ACTION", "shape": [7]}}
    processors = RunFolder(run_dir).processors_dir
    assert sorted(p.name for p in folder.iterdir()) == sorted(["config.json"] + [p.name for p in processors.iterdir()])
    for path in processors.iterdir():
        assert (folder / path.name).read_bytes() == path.read_bytes()

    shift_statistics(processors)  # the run's own processors now normalise otherwise; the folder's are unchanged
    from_run = make_pre_post_processors(ZooConfig(run=str(run_dir), device="cpu"), pretrained_path=str(processors),
                                        preprocessor_overrides=CPU)
    config = ZooConfig.from_pretrained(folder)
    assert Path(config.pretrained_path) == folder
    plugin_factory = make_zoo_pre_post_processors(config)
    assert torch.equal(preprocessed_state(plugin_factory, obs[0]), preprocessed_state(lerobot[1:], obs[0]))
    assert not torch.equal(preprocessed_state(from_run, obs[0]), preprocessed_state(lerobot[1:], obs[0]))

    routes = {route.__name__: episode(route(folder), obs) for route in (as_lerobot_eval, as_policy_server)}
    assert float((by_run - want).norm() / want.norm()) <= 1e-5
    for name, got in routes.items():
        assert torch.equal(got, by_run), name


def shift_statistics(processors: Path) -> None:
    """Every normalisation statistic of the preprocessor in ``processors`` plus 1."""
    from safetensors.torch import load_file, save_file

    for path in processors.glob("policy_preprocessor_*.safetensors"):
        save_file({k: v + 1 for k, v in load_file(str(path)).items()}, str(path))


def test_bad_input_is_refused_and_nothing_is_written(run, tmp_path, capsys):
    out = tmp_path / "policy"
    not_a_run = tmp_path / "not-a-run"
    not_a_run.mkdir()
    (not_a_run / "notes.txt").write_text("a folder, but no zoo run")
    assert policy_folder([str(not_a_run), str(out)]) == 2
    assert "not-a-run is not a complete zoo run folder" in capsys.readouterr().err
    assert not out.exists()

    no_processors = tmp_path / "no-processors"
    shutil.copytree(run[0], no_processors, ignore=shutil.ignore_patterns("processors", "*.pt2"))
    assert policy_folder([str(no_processors), str(out)]) == 2
    err = capsys.readouterr().err
    assert "no-processors/processors is missing" in err and "what to do: export the run again" in err
    assert not out.exists()

    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert policy_folder([str(run[0]), str(out)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert policy_folder([str(run[0]), str(run[0].parent), "--force"]) == 2
    assert "would replace the run" in capsys.readouterr().err
    assert policy_folder([str(run[0]), str(no_processors), "--force"]) == 2
    assert "is a zoo run folder; a policy folder never replaces one" in capsys.readouterr().err
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging folder left behind

    with pytest.raises(ZooConfigError, match="of type 'fastwam', not a zoo policy"):
        ZooConfig.from_pretrained(run[1])  # LeRobot's own checkpoint folder


def test_lerobots_policy_server_serves_the_policy_folder(run, lerobot, tmp_path, monkeypatch):
    """LeRobot's own PolicyServer (its SendPolicyInstructions and _predict_action_chunk, as a robot client drives
    them) serves the policy folder once `python -m lerobot_policy_zoo.policy_server` allowed type zoo; the chunk
    equals LeRobot's own FastWAMPolicy's through the same server code. Skipped without LeRobot's async extra
    (grpcio); about 3 s with it."""
    pytest.importorskip("grpc", reason="LeRobot's async extra: pip install 'lerobot[async]==0.6.1'")
    import pickle

    monkeypatch.chdir(tmp_path)  # the server's module writes its log file into ./logs when imported

    from lerobot.async_inference import policy_server
    from lerobot.async_inference.configs import PolicyServerConfig
    from lerobot.async_inference.helpers import RemotePolicyConfig, TimedObservation
    from lerobot.transport import services_pb2

    from lerobot_policy_zoo.policy_server import allow_zoo

    run_dir = shutil.copytree(run[0], tmp_path / "run" / TINY)
    fast_wam.embed_prompt(lerobot[0], TASK).save(RunFolder(run_dir).prompt_file(TASK))
    assert policy_folder([str(run_dir), str(tmp_path / "policy")]) == 0
    assert "zoo" not in policy_server.SUPPORTED_POLICIES
    allow_zoo()
    assert "zoo" in policy_server.SUPPORTED_POLICIES

    state_names = [f"joint{i}" for i in range(8)]
    features = {"observation.state": {"dtype": "float32", "shape": (8,), "names": state_names},
                "observation.images.image": {"dtype": "image", "shape": (64, 128, 3),
                                             "names": ["height", "width", "channels"]}}
    g = torch.Generator().manual_seed(3)
    raw = {**dict(zip(state_names, torch.randn(8, generator=g).tolist())), "task": TASK,
           "image": (torch.rand(64, 128, 3, generator=g) * 255).to(torch.uint8).numpy()}
    server = policy_server.PolicyServer(PolicyServerConfig())
    setup = RemotePolicyConfig("zoo", str(tmp_path / "policy"), features, actions_per_chunk=CHUNK, device="cpu")
    server.SendPolicyInstructions(services_pb2.PolicySetup(data=pickle.dumps(setup)), SimpleNamespace(peer=str))
    assert isinstance(server.policy, ZooPolicy)

    def served_chunk() -> torch.Tensor:
        torch.manual_seed(0)
        server.policy.reset()
        timed = TimedObservation(timestamp=0.0, timestep=0, observation=dict(raw))
        return torch.stack([a.get_action() for a in server._predict_action_chunk(timed)])

    got = served_chunk()
    server.policy, server.preprocessor, server.postprocessor = lerobot
    want = served_chunk()
    assert got.shape == want.shape == (CHUNK, 7)
    assert float((got - want).norm() / want.norm()) <= 1e-5
