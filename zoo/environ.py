"""Environment variables set for the length of a block, as they were afterwards."""

from __future__ import annotations

import contextlib
import os
from typing import Iterable, Iterator


@contextlib.contextmanager
def environ_restored(keys: Iterable[str]) -> Iterator[None]:
    """Put the named variables back as they were when the block ends: set, changed or removed inside it."""
    saved = {key: os.environ.get(key) for key in keys}
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
