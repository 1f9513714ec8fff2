"""zoo.runner's processor pipelines against LeRobot's own, on files LeRobot wrote.

Each case builds LeRobot's pipelines (``make_policy_processor_pipelines`` with its own step classes and
statistics), saves them with ``save_pretrained`` as a checkpoint does, and runs the same raw observation and
action through LeRobot's loaded pipeline and through zoo.runner's reading of the same files.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("lerobot")

from zoo.core.errors import RunnerError  # noqa: E402
from zoo.contract.run_folder import RunFolder  # noqa: E402
from zoo.runner.processors import load_pipeline, load_processors  # noqa: E402

pytestmark = pytest.mark.policies


def lerobot_pipelines(folder, norm_map, stats, toggle=()):
    """LeRobot's pipelines, saved into ``folder`` (a run folder's processors/) and loaded back from it."""
    from lerobot.configs.types import FeatureType, NormalizationMode, PolicyFeature
    from lerobot.policies.fastwam.processor_fastwam import FastWAMActionToggleProcessorStep
    from lerobot.processor import (AddBatchDimensionProcessorStep, DeviceProcessorStep, NormalizerProcessorStep,
                                   RenameObservationsProcessorStep, UnnormalizerProcessorStep,
                                   make_policy_processor_pipelines)
    from lerobot.processor.pipeline import PolicyProcessorPipeline

    features = {"observation.state": PolicyFeature(FeatureType.STATE, (5,)),
                "observation.images.top": PolicyFeature(FeatureType.VISUAL, (3, 4, 6)),
                "action": PolicyFeature(FeatureType.ACTION, (5,))}
    modes = {FeatureType[k]: NormalizationMode[v] for k, v in norm_map.items()}
    pre_steps = [RenameObservationsProcessorStep(rename_map={"observation.images.cam": "observation.images.top"}),
                 AddBatchDimensionProcessorStep(), DeviceProcessorStep(device="cpu"),
                 NormalizerProcessorStep(features=features, norm_map=modes, stats=stats)]
    post_steps = [UnnormalizerProcessorStep(features={"action": features["action"]}, norm_map=modes, stats=stats)]
    if toggle:
        post_steps.append(FastWAMActionToggleProcessorStep(toggle_dimensions=list(toggle)))
    post_steps.append(DeviceProcessorStep(device="cpu"))
    pre, post = make_policy_processor_pipelines(input_steps=pre_steps, output_steps=post_steps)
    pre.save_pretrained(folder)
    post.save_pretrained(folder)
    # Loaded back from the files, as LeRobot's factory does for a checkpoint.
    pre = PolicyProcessorPipeline.from_pretrained(folder, config_filename="policy_preprocessor.json")
    from lerobot.processor.converters import policy_action_to_transition, transition_to_policy_action

    post = PolicyProcessorPipeline.from_pretrained(folder, config_filename="policy_postprocessor.json",
                                                   to_transition=policy_action_to_transition,
                                                   to_output=transition_to_policy_action)
    return pre, post


def stats(generator):
    def one(shape):
        low = torch.randn(shape, generator=generator)
        return {"mean": torch.randn(shape, generator=generator), "std": 0.5 + torch.rand(shape, generator=generator),
                "min": low, "max": low + 0.5 + torch.rand(shape, generator=generator),
                "q01": low, "q99": low + 1 + torch.rand(shape, generator=generator),
                "q10": low, "q90": low + 0.5 + torch.rand(shape, generator=generator)}

    out = {"observation.state": one((5,)), "action": one((5,)), "observation.images.top": one((3,))}
    out["action"]["max"][2] = out["action"]["min"][2]  # a zero range: LeRobot substitutes eps
    out["action"]["q99"][1] = out["action"]["q01"][1]
    return out


@pytest.mark.parametrize("state_mode,action_mode,visual_mode", [
    ("MEAN_STD", "MEAN_STD", "IDENTITY"), ("MIN_MAX", "MIN_MAX", "MEAN_STD"),
    ("QUANTILES", "QUANTILES", "IDENTITY"), ("QUANTILE10", "QUANTILE10", "MIN_MAX"),
    ("IDENTITY", "IDENTITY", "IDENTITY"),
])
def test_pipelines_match_lerobot(tmp_path, state_mode, action_mode, visual_mode):
    g = torch.Generator().manual_seed(3)
    norm_map = {"STATE": state_mode, "ACTION": action_mode, "VISUAL": visual_mode}
    run = RunFolder(tmp_path)
    pre, post = lerobot_pipelines(run.processors_dir, norm_map, stats(g), toggle=(-1,))
    ours_pre, ours_post = load_processors(run, "cpu")
    # A per-call option and a precomputed context: LeRobot's batch_to_transition drops both.
    obs = {"observation.state": torch.randn(5, generator=g), "observation.images.cam": torch.rand(3, 4, 6, generator=g),
           "task": "pick the cup", "seed": 3, "context": torch.ones(2)}
    want = pre(dict(obs))
    got = ours_pre(dict(obs))
    kept = {k for k in want if k.startswith("observation.") or k == "task"}
    assert set(got) == kept == {"observation.state", "observation.images.top", "task"}
    for key in ("observation.state", "observation.images.top"):
        assert got[key].shape == want[key].shape
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)
    assert got["task"] == want["task"] == ["pick the cup"]
    action = torch.randn(1, 5, generator=g) * 2
    torch.testing.assert_close(ours_post.action(action), post(action), rtol=0, atol=0)
    chunk = torch.randn(1, 7, 5, generator=g)  # predict_action_chunk's [B, T, A]: statistics broadcast
    torch.testing.assert_close(ours_post.action(chunk), post(chunk), rtol=0, atol=0)


def test_unknown_step_is_refused(tmp_path):
    (tmp_path / "policy_preprocessor.json").write_text(json.dumps(
        {"name": "policy_preprocessor", "steps": [{"registry_name": "tokenizer_processor", "config": {}}]}))
    with pytest.raises(RunnerError, match="tokenizer_processor"):
        load_pipeline(tmp_path / "policy_preprocessor.json", "cpu")


def test_missing_state_file_is_refused(tmp_path):
    g = torch.Generator().manual_seed(0)
    run = RunFolder(tmp_path)
    lerobot_pipelines(run.processors_dir, {"STATE": "MEAN_STD", "ACTION": "MEAN_STD", "VISUAL": "IDENTITY"}, stats(g))
    for path in run.processors_dir.glob("policy_preprocessor_step_*.safetensors"):
        path.unlink()
    with pytest.raises(RunnerError, match="missing"):
        load_pipeline(run.preprocessor_file, "cpu")
