"""What every zoo command line does with errors: a ZooError prints ``error: ...`` and what to do, then exits
with its code; Ctrl-C exits 130; anything else is a bug in zoo and keeps its traceback."""

from __future__ import annotations

import sys
import traceback
from typing import Callable

from .errors import ZooError

EXIT_INTERRUPTED = 130


def guarded(command: Callable[[], int], verbose: bool = False) -> int:
    try:
        return command()
    except ZooError as exc:
        return report_error(exc, verbose)
    except KeyboardInterrupt:
        print("interrupted: nothing half-written was left in the output folder", file=sys.stderr)
        return EXIT_INTERRUPTED


def report_error(exc: ZooError, verbose: bool = False) -> int:
    """Print a ZooError the way every zoo command does; return its exit code."""
    if verbose and exc.__cause__ is not None:
        traceback.print_exception(exc.__cause__, file=sys.stderr)
    print(f"error: {exc.message}", file=sys.stderr)
    if exc.hint:
        print(f"  what to do: {exc.hint}", file=sys.stderr)
    return exc.exit_code
