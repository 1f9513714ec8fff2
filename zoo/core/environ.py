"""Environment variables set for the length of a block, as they were afterwards; how a shell runs this Python
(the exact commands reports and messages print)."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Iterable, Iterator, Sequence


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


def python_command() -> str:
    """How a shell runs this Python again: ``python`` where that is what PATH finds (an activated venv), else
    the interpreter's own path (``.venv/bin/python`` run without activating the venv)."""
    found = shutil.which("python")
    exe = Path(sys.executable)
    with contextlib.suppress(OSError):
        if found and Path(found).parent.resolve() == exe.parent.resolve():
            return "python"
    return str(exe)


def zoo_command(module: str, args: Sequence[str]) -> str:
    """The exact shell command that runs ``python -m <module> <args>`` with this Python."""
    return " ".join([python_command(), "-m", module, shlex.join([str(a) for a in args])]).rstrip()
