"""The Hugging Face Hub cache layout, written by zoo itself, and pointing huggingface_hub at a cache.

zoo fabricates the tiny recipes' checkpoints (seeded random weights in the real file layout) into a cache of
its own (never the user's real Hub cache: the tiny repos reuse real ids such as ``google/umt5-xxl`` for the
frozen parts LeRobot loads by id). The layout is huggingface_hub's:
``models--{org}--{name}/refs/{revision}`` holding a 40-hex commit, and ``snapshots/{commit}/{files}``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from pathlib import Path
from typing import Iterator, Optional

from zoo.core.environ import environ_restored


def tiny_cache_dir() -> Path:
    """zoo's own cache for fabricated tiny checkpoints; ZOO_TINY_HUB_CACHE is read at call time so tests and
    users can move it after zoo was imported."""
    return Path(os.environ.get("ZOO_TINY_HUB_CACHE", Path.home() / ".cache" / "zoo" / "tiny-hub")).expanduser()


def repo_folder(cache_dir: Path, repo_id: str) -> Path:
    return Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))


def folder_commit(folder: Path) -> str:
    """A 40-hex commit id derived from the folder's file names and bytes, so the same content maps to the same id."""
    digest = hashlib.sha1()
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        digest.update(path.relative_to(folder).as_posix().encode())
        digest.update(hashlib.sha1(path.read_bytes()).digest())
    return digest.hexdigest()


def put_in_cache(repo_id: str, folder: Path, cache_dir: Path, revision: str = "main") -> str:
    """Copy ``folder`` into ``cache_dir`` as revision ``revision`` of ``repo_id``; return the commit id."""
    commit = folder_commit(folder)
    repo = repo_folder(cache_dir, repo_id)
    snapshot = repo / "snapshots" / commit
    if not snapshot.exists():
        staging = repo / "snapshots" / f".{commit}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(folder, staging)
        os.replace(staging, snapshot)  # a crashed copy never looks like a finished snapshot
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return commit


@contextlib.contextmanager
def hub_environment(cache_dir: Optional[Path] = None, offline: Optional[bool] = None) -> Iterator[None]:
    """Point huggingface_hub (and libraries calling it: transformers, diffusers, LeRobot) at ``cache_dir``,
    optionally offline, for the duration of the block.

    huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE into module constants at import time, so both the
    environment and those constants are set, and restored afterwards.
    """
    from huggingface_hub import constants

    keys = ("HF_HUB_CACHE", "HF_HUB_OFFLINE")
    saved_const = {k: getattr(constants, k) for k in keys}
    with environ_restored(keys):
        try:
            if cache_dir is not None:
                os.environ["HF_HUB_CACHE"] = str(cache_dir)
                constants.HF_HUB_CACHE = str(cache_dir)
            if offline is not None:
                os.environ["HF_HUB_OFFLINE"] = "1" if offline else "0"
                constants.HF_HUB_OFFLINE = bool(offline)
            yield
        finally:
            for key, value in saved_const.items():
                setattr(constants, key, value)
