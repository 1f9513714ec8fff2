"""Atomic file writes: a reader sees the old file or the whole new one, never a half-written one.

Write to a temporary sibling, fsync, then ``os.replace``. A failed write removes its ``.<name>.tmp-*`` file;
one killed outright leaves only that file, which no zoo command treats as an artifact.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator, Union

PathLike = Union[str, Path]


@contextlib.contextmanager
def atomic_path(target: PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``target``; on success it is moved onto ``target``."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb") as fh:
            os.fsync(fh.fileno())
        # mkstemp makes the file 0600; give it the mode any other new file would get (0666 minus umask).
        os.chmod(tmp_path, 0o666 & ~_umask())
        os.replace(tmp_path, target)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def _umask() -> int:
    mask = os.umask(0)  # reading the umask means setting it; put it straight back
    os.umask(mask)
    return mask


def write_bytes(target: PathLike, data: bytes) -> Path:
    with atomic_path(target) as tmp:
        tmp.write_bytes(data)
    return Path(target)


def write_text(target: PathLike, text: str) -> Path:
    return write_bytes(target, text.encode("utf-8"))


def write_json(target: PathLike, obj: Any) -> Path:
    return write_text(target, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
