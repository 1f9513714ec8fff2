"""The runner's error: something about the run folder, the observation or the prompt the user can fix."""

from __future__ import annotations

from ..errors import ZooError


class RunnerError(ZooError):
    """The runner cannot drive this artifact with this input (missing file, unknown processor step, an
    observation or option the policy's own code would treat differently than the runner can)."""
