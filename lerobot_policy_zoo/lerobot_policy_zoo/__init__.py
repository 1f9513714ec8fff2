"""LeRobot's plugin for zoo artifacts: ``--policy.type=zoo`` (or ``--policy.path`` of a folder this package wrote)
makes ``lerobot-eval``, ``lerobot-rollout`` and the async policy server drive a zoo run folder or published
artifact through ``zoo.runner`` on its ``eager``, ``artifact`` or ``executorch`` backend.

LeRobot imports this package by its distribution name (``register_third_party_plugins``); importing the
configuration registers the ``zoo`` policy type. The policy and processor modules are found from it by LeRobot's
naming convention (``configuration_zoo`` -> ``modeling_zoo`` / ``processor_zoo``).
"""

from lerobot_policy_zoo.configuration_zoo import ZooConfig

__all__ = ["ZooConfig"]
