"""``ZooConfig``: LeRobot's policy config for a zoo artifact, registered as policy type ``zoo``.

A zoo run folder is not a LeRobot checkpoint: its weights are inside the artifact's methods, and what LeRobot reads
from a checkpoint folder (the processor pipelines) sits in the run's ``processors/``. So the config names the run
(``run``: a run folder or a published Hub repo id) and the backend, and points LeRobot's ``pretrained_path`` at the
run's ``processors/``: LeRobot's own ``make_pre_post_processors`` then loads the run's pipelines with the overrides
the command line gives (``--rename_map``, the device), exactly as for a checkpoint of its own.

``python -m lerobot_policy_zoo.policy_folder RUN OUT`` writes such a config as a LeRobot policy folder (its
``config.json`` beside a copy of the run's processor files), for the tools that name a policy by ``--policy.path``;
read back from there, ``pretrained_path`` is that folder, so its processors are the ones loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from lerobot.configs.policies import PreTrainedConfig
from lerobot.configs.types import FeatureType, PolicyFeature
from lerobot.optim.optimizers import AdamWConfig

# zoo.runner.BACKENDS, without importing the runner here
BACKENDS = ("eager", "artifact", "executorch", "executorch-inprocess")


class ZooConfigError(ValueError):
    """A zoo policy config that cannot drive anything; the message says what to pass."""


@PreTrainedConfig.register_subclass("zoo")
@dataclass
class ZooConfig(PreTrainedConfig):
    # The run folder `python -m zoo.export` wrote, or a published artifact's Hub repo id (ORG/NAME).
    run: Optional[str] = None
    # eager: the rewritten programs (CPU or GPU); artifact: the shipped .so files (GPU); executorch: model.pte on
    # ExecuTorch's C++ runtime (et_runner or $ZOO_ET_RUNNER).
    backend: str = "eager"
    # A task with no prompt file in the run's prompts/ is embedded with the checkpoint's own text encoder and kept
    # there; false refuses it with the `python -m zoo prompt` command to run.
    embed_prompts: bool = True
    et_runner: Optional[str] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.backend not in BACKENDS:
            raise ZooConfigError(f"--policy.backend={self.backend!r} is not a zoo.runner backend; use one of: "
                                 f"{', '.join(BACKENDS)}")
        if not self.run:
            return  # draccus builds a bare config first; validate_features refuses it before a policy is made
        folder = _resolve(self.run)
        if self.pretrained_path is None:
            self.pretrained_path = folder.processors_dir
        if not self.input_features or not self.output_features:
            inputs, outputs = run_features(folder)
            self.input_features = self.input_features or inputs
            self.output_features = self.output_features or outputs

    @property
    def observation_delta_indices(self) -> None:
        return None

    @property
    def action_delta_indices(self) -> None:
        return None

    @property
    def reward_delta_indices(self) -> None:
        return None

    def get_optimizer_preset(self) -> AdamWConfig:
        raise ZooConfigError("a zoo artifact runs a trained policy and cannot be trained: train the LeRobot policy "
                             "(its own --policy.type), then export it with `python -m zoo.export`")

    def get_scheduler_preset(self) -> None:
        return None

    def validate_features(self) -> None:
        if not self.run:
            raise ZooConfigError("--policy.type=zoo needs the artifact to drive: pass --policy.run=RUN_DIR (a run "
                                 "folder of `python -m zoo.export`) or --policy.run=ORG/NAME (a published artifact)")
        if not self.image_features:
            raise ZooConfigError(f"the run {self.run} declares no camera input (observation_features in its "
                                 "host_settings.json): export the run again with this zoo")

    @classmethod
    def from_pretrained(cls, pretrained_name_or_path: Union[str, Path], **kwargs: Any) -> "ZooConfig":
        """The config of a policy folder (``python -m lerobot_policy_zoo.policy_folder``, local or a Hub repo id),
        its processors to be loaded from that folder, as lerobot-eval and lerobot-rollout point
        ``pretrained_path`` at their ``--policy.path``."""
        config = super().from_pretrained(pretrained_name_or_path, **kwargs)
        if not isinstance(config, ZooConfig):
            raise ZooConfigError(f"{pretrained_name_or_path} holds a LeRobot policy of type {config.type!r}, not a "
                                 "zoo policy: name it with its own --policy.path, or write a zoo policy folder "
                                 "with `python -m lerobot_policy_zoo.policy_folder RUN OUT`")
        local = Path(pretrained_name_or_path).expanduser()
        config.pretrained_path = local if local.is_dir() else Path(str(pretrained_name_or_path))
        return config


def _resolve(run: str):
    from zoo.runner.loading import resolve  # zoo's errors carry their own hint; LeRobot prints them as raised

    return resolve(str(Path(run).expanduser()) if Path(run).expanduser().exists() else run)


def run_features(folder) -> tuple:
    """``(input_features, output_features)`` of a run, as LeRobot's ``PolicyFeature``s: what the checkpoint's config
    declared (host_settings.json's ``observation_features``) and its action size."""
    settings = folder.read_host_settings()
    features = getattr(settings, "observation_features", None) or {}
    inputs = {key: PolicyFeature(type=FeatureType[f.type], shape=tuple(f.shape)) for key, f in sorted(features.items())}
    action_dim = getattr(settings, "action_dim", None)
    if action_dim is None and getattr(settings, "action", None) is not None:
        action_dim = settings.action.action_dim
    outputs = {"action": PolicyFeature(type=FeatureType.ACTION, shape=(int(action_dim),))} if action_dim else {}
    return inputs, outputs
