"""One error type for everything a user can get wrong or the machine cannot do.

Every ``ZooError`` carries what went wrong and what to do about it; the CLI prints both and exits non-zero
without a traceback. Anything else escaping the CLI is a bug in zoo and keeps its traceback.
"""

from __future__ import annotations

import errno
from typing import Any, Dict, Optional, Sequence, Union

# The exit codes of every zoo command line, documented in each command's --help (``exit_status_help``).
EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_ERROR = 2
EXIT_MISMATCH = 3
EXIT_KEPT_ASIDE = 4
EXIT_INTERRUPTED = 130

EXIT_WORDS: Dict[int, str] = {
    EXIT_OK: "success",
    EXIT_CHECK_FAILED: "the check ran and said no",
    EXIT_ERROR: "bad input, a failed step or a refusal: the message says which and what to do "
                "(disk full included); an earlier run in the folder is unchanged",
    EXIT_MISMATCH: "the artifact does not compute what eager PyTorch computes (verification failed)",
    EXIT_KEPT_ASIDE: "finished, but kept in RUN_DIR/attempts/ because the run already there had passed stages "
                     "this attempt did not (e.g. a CPU-only export over a verified run); --force replaces it",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C or SIGTERM): the attempt's report is kept, an earlier run is unchanged",
}


def exit_status_help(codes: Sequence[int], words: Optional[Dict[int, str]] = None) -> str:
    """The ``exit status`` paragraph of a command's ``--help`` (``words`` overrides the common wording)."""
    words = {**EXIT_WORDS, **(words or {})}
    return "exit status:\n" + "\n".join(f"  {code:<4d}{words[code]}" for code in codes)


class ZooError(Exception):
    """A failure the user can act on. ``hint`` says what to do; ``exit_code`` is what the CLI returns.

    A command that fails part way through an attempt at a run folder sets ``report`` (the attempt's
    ``RunReport``, whose stage table the CLI prints) and ``placement`` (where the attempt went)."""

    exit_code = EXIT_ERROR

    def __init__(self, message: str, hint: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.report: Optional[Any] = None
        self.placement: Optional[Any] = None

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  what to do: {self.hint}"


class RecipeError(ZooError):
    """Unknown recipe, unknown or ill-typed key, bad override."""


class PullError(ZooError):
    """The checkpoint could not be found, downloaded or loaded."""


class ExportError(ZooError):
    """torch.export or a policy's export unit failed."""


class QuantizationBlocked(ExportError):
    """The recipe's unit.quantize cannot be built on this line (int4 weight-only: no CPU kernel packs or runs
    its layout); refused before anything is fabricated or downloaded."""


class RewriteDeclined(ZooError):
    """A required rewrite declined the program; the message names the op and the source line."""


class LoweringError(ZooError):
    """ExecuTorch lowering failed or was refused before compiling (kernel preflight)."""


class KernelPreflightRefused(LoweringError):
    """The kernel preflight found kernels the target runtime cannot run: refused before the compile."""


class NoGpuError(ZooError):
    """A stage needs a CUDA device and none is present."""


class VerificationFailed(ZooError):
    """The artifact (or, on the CPU, the rewritten program) does not compute what eager PyTorch computes, within
    the recipe's tolerances. ``result`` holds the comparison table the stage records."""

    exit_code = EXIT_MISMATCH

    def __init__(self, message: str, hint: Optional[str] = None, result: Optional[Any] = None):
        super().__init__(message, hint)
        self.result = result


class PublishRefused(ZooError):
    """zoo refuses to publish: unverified run, hash mismatch, no token, no write access."""


class ContractError(ZooError):
    """A run folder's io_spec.json or host_settings.json is of a format this zoo does not read, or malformed."""


class TensorFileError(ZooError):
    """A tensor file exchanged with the C++ runner is missing, cut short or not in zoo's format."""


class RuntimeNotBuilt(ZooError):
    """zoo_runner (ExecuTorch's C++ runtime with zoo's runner) is not built, or not built for the job."""


class RuntimeMismatch(RuntimeNotBuilt):
    """The zoo_runner found is another ExecuTorch release than the one the artifact was lowered for."""


class RuntimeConflict(ZooError):
    """Two runtimes would serve the compiled code's aoti_torch_* functions in one process (zoo.runtimes.shims)."""


class RuntimeCallFailed(ZooError):
    """ExecuTorch's C++ runtime could not load the artifact or a call failed; its log says why."""


class GpuTargetMismatch(ZooError):
    """The artifact's compiled code cannot run on this GPU or host (read from its .so before loading it), or a
    lowering was asked for a GPU or host this machine cannot compile for."""


class StorageError(ZooError):
    """The machine could not write (or read) a file: disk full, quota, read-only, permissions, I/O error."""


# errno values that mean "the machine's storage refused", not "zoo has a bug": they become a StorageError.
STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO, errno.EFBIG,
                  errno.EMFILE, errno.ENFILE}


def storage_error(exc: BaseException) -> Optional[StorageError]:
    """The ``StorageError`` an ``OSError`` of the machine's storage stands for; None for any other error."""
    if not isinstance(exc, OSError) or exc.errno not in STORAGE_ERRNOS:
        return None
    where = f" ({exc.filename})" if exc.filename else ""
    what = exc.strerror or errno.errorcode.get(exc.errno or 0, "error")
    hints = {errno.ENOSPC: "free disk space (`df -h` shows where), or write the run to another disk with "
                           "--output-dir, then run the command again",
             errno.EDQUOT: "your disk quota is used up: free space or write elsewhere with --output-dir",
             errno.EROFS: "the folder is on a read-only file system: choose another one with --output-dir"}
    return StorageError(f"the machine could not write a file: [Errno {exc.errno}] {what}{where}",
                        hints.get(exc.errno or 0, "check the folder's permissions and the disk, then run again"))


class RunnerError(ZooError):
    """zoo.runner cannot drive this artifact with this input: a missing run-folder file, an unknown processor
    step, an observation or option the policy's own code would treat differently than the runner can."""


class PolicyCheckFailed(ZooError):
    """The runner's actions differ from the LeRobot policy's own, beyond the recipe's policy_check tolerance.
    ``result`` holds the per-chunk table."""

    exit_code = EXIT_MISMATCH

    def __init__(self, message: str, hint: Optional[str] = None, result: Optional[Any] = None):
        super().__init__(message, hint)
        self.result = result


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM during an attempt at a run folder, with the attempt's ``report`` and ``placement``
    (as on a ``ZooError``) so that the CLI can say where it went."""

    def __init__(self, report: Optional[Any] = None, placement: Optional[Any] = None):
        super().__init__()
        self.report = report
        self.placement = placement


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
