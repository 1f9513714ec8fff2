"""Atomic file writes: a reader sees the old file or the whole new one, never a half-written one.

Write to a temporary sibling, fsync, then ``os.replace``. A failed write removes its ``.<name>.tmp-*`` file;
one killed outright leaves only that file, which no zoo command treats as an artifact. A write the machine
refuses (disk full, read-only, permissions) is a ``StorageError`` naming the file.

``atomic_folder(final)`` does the same for a whole folder: it is built beside ``final`` and swapped into place in
one step (``exchange``); ``interrupts_deferred()`` keeps Ctrl-C (and SIGTERM) from cutting such a swap in half.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator, List, Union

from zoo.core.errors import StorageError, storage_error

PathLike = Union[str, Path]


@contextlib.contextmanager
def atomic_path(target: PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``target``; on success it is moved onto ``target``."""
    target = Path(target)
    tmp_path = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
        os.close(fd)
        tmp_path = Path(tmp)
        yield tmp_path
        with open(tmp_path, "rb") as fh:
            os.fsync(fh.fileno())
        # mkstemp makes the file 0600; give it the mode any other new file would get (0666 minus umask).
        os.chmod(tmp_path, 0o666 & ~_umask())
        os.replace(tmp_path, target)
    except OSError as exc:
        refused = storage_error(exc)
        if refused is None:
            raise
        refused.message = f"writing {target} failed: {refused.message}"
        raise refused from exc
    finally:
        if tmp_path is not None and tmp_path.exists():
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


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[List[int]]:
    """Run a short block (renames that put a run in place) to its end even if Ctrl-C or SIGTERM arrives.

    The signals that arrived are listed in the yielded list; the caller decides what to say about them. Outside
    the main thread (where signal handlers cannot be set) the block runs as it is.
    """
    received: List[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    watched = [signal.SIGINT] + ([signal.SIGTERM] if hasattr(signal, "SIGTERM") else [])
    saved = {sig: signal.signal(sig, lambda signum, frame: received.append(signum)) for sig in watched}
    try:
        yield received
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def exchange(a: Path, b: Path) -> bool:
    """Swap two folders in one step (Linux renameat2 with RENAME_EXCHANGE), so no moment exists where either
    path is missing; False where the system cannot (the caller then renames twice)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(str(a)), at_fdcwd, os.fsencode(str(b)), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_dead_leftovers(final: Path) -> None:
    """Remove ``.<name>.tmp-<pid>`` folders beside ``final`` whose process is gone (killed mid-build)."""
    final = Path(final)
    if not final.parent.is_dir():
        return
    for path in final.parent.glob(f".{final.name}.tmp-*"):
        pid = path.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def atomic_folder(final: PathLike) -> Iterator[Path]:
    """Yield an empty folder beside ``final``; when the block ends it replaces ``final`` whole. A failure, a
    Ctrl-C or a kill inside the block leaves ``final`` exactly as it was (a killed build's folder is removed
    by the next build)."""
    final = Path(final)
    remove_dead_leftovers(final)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        try:
            tmp.mkdir(parents=True)
        except OSError as exc:
            raise (storage_error(exc) or exc) from exc
        try:
            yield tmp
        except OSError as exc:
            refused = storage_error(exc)
            if refused is None:
                raise
            refused.message = refused.message.replace(str(tmp), str(final))
            raise refused from exc
        except StorageError as exc:  # name the folder being replaced, not its hidden temporary twin
            exc.message = exc.message.replace(str(tmp), str(final))
            raise
        with interrupts_deferred():
            if not final.exists():
                os.replace(tmp, final)
            elif not exchange(tmp, final):
                old = final.with_name(f".{final.name}.tmp-old-{os.getpid()}")
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
