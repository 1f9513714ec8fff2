"""What every zoo command line does with errors and signals, and the exit codes they document.

A ZooError prints ``error: ...`` and what to do, then exits with its code. A write the machine refused (disk
full, read-only) is one too. Ctrl-C, and SIGTERM (a job scheduler's stop), exit 130 after the attempt was put
away. Where an attempt was kept beside an earlier run, the message says where. Anything else is a bug in zoo
and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence

from zoo.core.errors import (  # noqa: F401  (the exit codes are re-exported for the command lines)
    EXIT_CHECK_FAILED,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_KEPT_ASIDE,
    EXIT_MISMATCH,
    EXIT_OK,
    Interrupted,
    ZooError,
    exit_status_help,
    storage_error,
)

def parser(prog: str, description: str, codes: Sequence[int],
           words: Optional[Dict[int, str]] = None) -> argparse.ArgumentParser:
    """An argument parser whose --help ends with the command's exit codes."""
    return argparse.ArgumentParser(prog=prog, description=description, epilog=exit_status_help(codes, words),
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def guarded(command: Callable[[], int], verbose: bool = False) -> int:
    with _sigterm_interrupts():
        try:
            return command()
        except ZooError as exc:
            return report_error(exc, verbose)
        except Interrupted as exc:
            error = (exc.report.get("error") or {}) if exc.report is not None else {}
            print(error.get("message") or "interrupted", file=sys.stderr)
            _print_where(exc.report, exc.placement)
            return EXIT_INTERRUPTED
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        except OSError as exc:
            refused = storage_error(exc)
            if refused is None:
                raise
            refused.__cause__ = exc
            return report_error(refused, verbose)


def report_error(exc: ZooError, verbose: bool = False) -> int:
    """Print a ZooError the way every zoo command does (and where its attempt went); return its exit code."""
    if verbose and exc.__cause__ is not None:
        traceback.print_exception(exc.__cause__, file=sys.stderr)
    print(f"error: {exc.message}", file=sys.stderr)
    if exc.hint:
        print(f"  what to do: {exc.hint}", file=sys.stderr)
    _print_where(exc.report, exc.placement)
    return exc.exit_code


def _print_where(report, placement) -> None:
    """Where the failed attempt went, what became of the earlier run, and the command to run next."""
    if placement is not None:
        status = report.get("status", "failed") if report is not None else "failed"
        print(placement.describe(status), file=sys.stderr)
    nxt = (report.get("next") or {}) if report is not None else {}
    if nxt.get("command"):
        print(f"next: {nxt['command']}" + (f"  ({nxt['why']})" if nxt.get("why") else ""), file=sys.stderr)


def print_summary(report, out=None, headline: bool = True) -> None:
    """The stage table; unless ``headline`` is False (a failure, which ``guarded`` reports), where the attempt
    is (the run folder, or attempts/ beside it) and the status, what was skipped and why, the next command."""
    out = out or sys.stdout
    print("", file=out)
    print(report.summary_table(), file=out)
    print("", file=out)
    if not headline:  # a failure: guarded() says where the attempt went, after the error
        out.flush()
        return
    placement = report.get("placement") or {}
    if placement.get("placed", True):
        print(f"run folder: {report.run_dir}  ({report.get('status', '?')})", file=out)
    else:
        run = Path(placement["folder"]).parent.parent
        print(f"kept in {placement['folder']}  ({report.get('status', '?')}); the earlier run in {run} is "
              f"unchanged ({placement.get('earlier')})", file=out)
    for line in plain(report.headline()):
        if line:
            print(line, file=out)
    out.flush()


def plain(lines: List[str]) -> List[str]:
    """report.md's headline lines for a terminal: without Markdown's emphasis and code marks."""
    return [line.replace("**", "").replace("`", "") for line in lines]


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM ends a command the way Ctrl-C does: the attempt is put away and the earlier run kept."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGTERM"):
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt("SIGTERM")

    saved = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, saved)
