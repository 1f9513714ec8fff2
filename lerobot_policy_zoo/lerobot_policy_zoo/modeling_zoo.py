"""``ZooPolicy``: LeRobot's ``PreTrainedPolicy`` over ``zoo.runner``, so every LeRobot loop (``lerobot-eval``,
``lerobot-rollout``, the async policy server) drives a zoo artifact as it drives a policy of its own.

LeRobot applies the run's processors around it (``processor_zoo``), so the runner runs with ``processors=False``:
it takes the preprocessed batch and returns normalised actions, as the LeRobot policy it was exported from does.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Union

import torch
from torch import Tensor

from lerobot.policies.pretrained import PreTrainedPolicy

from lerobot_policy_zoo.configuration_zoo import ZooConfig, _resolve
from lerobot_policy_zoo.prompts import TaskEmbedder
from zoo.core.errors import ZooError


class ZooPolicyError(RuntimeError):
    """A zoo error seen through LeRobot, which prints an exception's message only: the hint is part of it."""


@contextlib.contextmanager
def explained() -> Iterator[None]:
    try:
        yield
    except ZooError as exc:
        hint = f"\n  what to do: {exc.hint}" if exc.hint else ""
        raise ZooPolicyError(f"{exc.message}{hint}") from None


def register_family_steps(policy_type: str) -> None:
    """Import the LeRobot policy's own processor module, which registers its processor steps (Fast-WAM's action
    toggle) under the names the run's pipeline files use; a policy without one has only LeRobot's common steps."""
    name = f"lerobot.policies.{policy_type}.processor_{policy_type}"
    if importlib.util.find_spec(f"lerobot.policies.{policy_type}") is not None:
        with contextlib.suppress(ModuleNotFoundError):
            importlib.import_module(name)


class ZooPolicy(PreTrainedPolicy):
    config_class = ZooConfig
    name = "zoo"

    def __init__(self, config: ZooConfig, **_: Any):  # make_policy may pass dataset_stats / dataset_meta: unused
        super().__init__(config)
        config.validate_features()
        import zoo.runner

        with explained():
            run = _resolve(config.run)
            self.runner = zoo.runner.load(run, backend=config.backend, device=config.device, processors=False,
                                          et_runner=config.et_runner,
                                          embedder=TaskEmbedder(run) if config.embed_prompts else None)
        register_family_steps(self.runner.policy_type)
        self.reset()

    @classmethod
    def from_pretrained(cls, pretrained_name_or_path: Union[str, Path], *, config: Optional[ZooConfig] = None,
                        **kwargs: Any) -> "ZooPolicy":
        """A policy folder (``python -m lerobot_policy_zoo.policy_folder``: the async policy server and any code
        that names a policy by its folder), or, with ``config`` given, whatever its ``pretrained_path`` is
        (lerobot-eval and lerobot-rollout read the config first): no weights to read, the artifact has them."""
        if config is None:
            hub = {k: kwargs[k] for k in ("revision", "cache_dir", "force_download", "token", "local_files_only")
                   if k in kwargs}
            config = ZooConfig.from_pretrained(pretrained_name_or_path, **hub)
        return cls(config)

    def get_optim_params(self) -> Dict:
        return self.config.get_optimizer_preset()

    def reset(self) -> None:
        self.runner.reset()

    @torch.no_grad()
    def select_action(self, batch: Dict[str, Any], **_: Any) -> Tensor:
        with explained():
            return self.runner.select_action(batch)

    @torch.no_grad()
    def predict_action_chunk(self, batch: Dict[str, Any], **_: Any) -> Tensor:
        with explained():
            return self.runner.predict_action_chunk(batch)

    def forward(self, batch: Dict[str, Tensor]):
        self.config.get_optimizer_preset()  # refuses: an artifact is not trained
