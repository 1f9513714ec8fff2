"""Progress lines on stderr, in a form a person can follow: '[zoo] export ...'. Stage timing and its
record live in the run report (``zoo.report.timed_stage``)."""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("zoo")


def setup_logging(verbose: bool = False) -> None:
    if getattr(setup_logging, "_done", False):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[zoo] %(levelname)s %(message)s"))
    root = logging.getLogger("zoo")
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    root.propagate = False
    setup_logging._done = True  # type: ignore[attr-defined]


def say(message: str) -> None:
    """A progress line for the person at the terminal."""
    print(f"[zoo] {message}", file=sys.stderr, flush=True)
