"""Progress for long stages, on stderr, in a form a person can follow: '[zoo] export ... done in 3.2 s'."""

from __future__ import annotations

import logging
import sys
import time
from contextlib import contextmanager
from typing import Iterator

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


@contextmanager
def timed(label: str) -> Iterator[dict]:
    """Announce a stage, time it, announce the end. Yields a dict the caller may add facts to."""
    say(f"{label} ...")
    facts: dict = {}
    start = time.perf_counter()
    try:
        yield facts
    except BaseException:
        say(f"{label} failed after {time.perf_counter() - start:.1f} s")
        raise
    facts.setdefault("seconds", round(time.perf_counter() - start, 3))
    say(f"{label} done in {facts['seconds']:.1f} s")
