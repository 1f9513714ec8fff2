"""``python -m lerobot_policy_zoo.policy_server [LeRobot's policy server flags]``: LeRobot's async policy server, able
to serve a zoo policy folder (``python -m lerobot_policy_zoo.policy_folder``) to LeRobot's robot client.

LeRobot 0.6.1's server (``python -m lerobot.async_inference.policy_server``) serves only the policy types in its
``SUPPORTED_POLICIES`` list, and imports no plugin, so a robot client's ``--policy_type=zoo`` is refused before
anything is loaded. This command imports the plugin (which registers type ``zoo``), adds ``zoo`` to that list and
runs LeRobot's own ``serve``: the flags, the gRPC service and the loading (``from_pretrained`` of the client's
``pretrained_name_or_path``, the processors from the same folder) are LeRobot's. It needs LeRobot's ``async`` extra
(grpcio).
"""

from __future__ import annotations

import lerobot_policy_zoo  # noqa: F401  registers the zoo policy type, which the server looks up by name


def allow_zoo() -> None:
    """Add ``zoo`` to the types LeRobot's policy server serves (its module holds the same list object)."""
    from lerobot.async_inference import constants

    if "zoo" not in constants.SUPPORTED_POLICIES:
        constants.SUPPORTED_POLICIES.append("zoo")


def main() -> None:
    allow_zoo()
    from lerobot.async_inference.policy_server import serve

    serve()  # draccus reads the command line: --host, --port, --fps, --inference_latency, --obs_queue_timeout


if __name__ == "__main__":
    main()
