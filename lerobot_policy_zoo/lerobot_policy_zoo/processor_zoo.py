"""``make_zoo_pre_post_processors``: the run's own processor pipelines (``processors/``, the checkpoint's files), loaded
by LeRobot's ``PolicyProcessorPipeline``, so LeRobot's pipeline around a zoo policy is the one around the policy it
was exported from.

LeRobot calls this when the config has no ``pretrained_path``; a ``ZooConfig`` with a run always has one (the run's
``processors/``, or the policy folder it was read from), and LeRobot then loads the same files itself, with the
command line's overrides.
"""

from __future__ import annotations

from typing import Any, Optional

from lerobot.policies.factory import make_pre_post_processors

from lerobot_policy_zoo.configuration_zoo import ZooConfig, _resolve
from lerobot_policy_zoo.modeling_zoo import explained, register_family_steps


def make_zoo_pre_post_processors(config: ZooConfig, dataset_stats: Optional[Any] = None):
    """(preprocessor, postprocessor) of the run: from the policy folder the config was read from, else from the
    run's ``processors/`` (the same files); ``dataset_stats`` is unused: the run's statistics are the ones its
    policy was trained with."""
    config.validate_features()
    with explained():
        run = _resolve(config.run)
        register_family_steps(run.read_host_settings().policy_type)
    source = config.pretrained_path or run.processors_dir
    return make_pre_post_processors(config, pretrained_path=str(source),
                                    preprocessor_overrides={"device_processor": {"device": str(config.device)}})
