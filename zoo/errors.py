"""One error type for everything a user can get wrong or the machine cannot do.

Every ``ZooError`` carries what went wrong and what to do about it; the CLI prints both and exits non-zero
without a traceback. Anything else escaping the CLI is a bug in zoo and keeps its traceback.
"""

from __future__ import annotations

from typing import Optional, Union


class ZooError(Exception):
    """A failure the user can act on. ``hint`` says what to do; ``exit_code`` is what the CLI returns."""

    exit_code = 2

    def __init__(self, message: str, hint: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  what to do: {self.hint}"


class RecipeError(ZooError):
    """Unknown recipe, unknown or ill-typed key, bad override."""


class PullError(ZooError):
    """The checkpoint could not be found, downloaded or loaded."""


class ExportError(ZooError):
    """torch.export or a policy's export unit failed."""


class RewriteDeclined(ZooError):
    """A required rewrite declined the program; the message names the op and the source line."""


class LoweringError(ZooError):
    """ExecuTorch lowering failed or was refused before compiling (kernel preflight)."""


class KernelPreflightRefused(LoweringError):
    """The kernel preflight found kernels the target runtime cannot run: refused before the compile."""


class NoGpuError(ZooError):
    """A stage needs a CUDA device and none is present."""


class VerificationFailed(ZooError):
    """The artifact does not compute what eager PyTorch computes, within the recipe's tolerances."""

    exit_code = 3


class PublishRefused(ZooError):
    """zoo refuses to publish: unverified run, hash mismatch, no token, no write access."""


class TensorFileError(ZooError):
    """A tensor file exchanged with the C++ runner is missing, cut short or not in zoo's format."""


class RuntimeNotBuilt(ZooError):
    """zoo_runner (ExecuTorch's C++ runtime with zoo's runner) is not built, or not built for the job."""


class RuntimeCallFailed(ZooError):
    """ExecuTorch's C++ runtime could not load the artifact or a call failed; its log says why."""


class RunnerError(ZooError):
    """zoo.runner cannot drive this artifact with this input: a missing run-folder file, an unknown processor
    step, an observation or option the policy's own code would treat differently than the runner can."""


class PolicyCheckFailed(ZooError):
    """The runner's actions differ from the LeRobot policy's own, beyond the recipe's policy_check tolerance."""

    exit_code = 3


def first_line(error: Union[BaseException, str], limit: Optional[int] = None) -> str:
    """The first line of an error's message (a ``ZooError``'s message, without its hint), for a table cell or a
    one-line report entry; the error's type name when it says nothing. ``limit`` cuts longer lines with "..."."""
    if isinstance(error, BaseException):
        text, fallback = getattr(error, "message", None) or str(error), type(error).__name__
    else:
        text, fallback = error, ""
    text = text.strip()
    line = text.splitlines()[0] if text else fallback
    return line if limit is None or len(line) <= limit else line[: limit - 3] + "..."
