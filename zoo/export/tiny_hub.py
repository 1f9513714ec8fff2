"""Tiny recipes' checkpoints, fabricated by zoo into a Hub cache of its own and served from it offline.

A tiny recipe (``source.fabricate: true``) names a repo id like a real one. Its family's
``fabricate_checkpoint(recipe, work_dir)`` writes seeded random weights in the checkpoint's real file layout,
for the policy repo and every repo the policy loads by id (VAE, UMT5, tokenizer). They go into zoo's tiny
cache (``ZOO_TINY_HUB_CACHE``, default ``~/.cache/zoo/tiny-hub``; never the user's Hub cache, because the
auxiliary repos reuse real ids such as ``google/umt5-xxl``), and the pipeline then pulls and builds them
through the very code a real checkpoint takes, with huggingface_hub pointed at that cache and offline.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Dict, Iterator, Optional

from zoo import policies
from zoo.core.errors import ExportError
from zoo.export.hub_cache import hub_environment, put_in_cache, tiny_cache_dir
from zoo.core.progress import say


def fabricate(recipe, cache_dir: Optional[Path] = None) -> Dict[str, str]:
    """Fabricate the recipe's checkpoint (and auxiliary repos) into the tiny cache; return {repo_id: commit}.

    Fabrication is seeded (``source.seed``), so the same recipe gives the same bytes and the same commit id,
    and an unchanged snapshot is not copied again.
    """
    cache = Path(cache_dir) if cache_dir is not None else tiny_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    family = policies.load_family(recipe.family)
    main_repo = recipe.source.repo_id
    say(f"fabricating {main_repo} (seed {recipe.source.seed}) into {cache}")
    with _cache_lock(cache), tempfile.TemporaryDirectory(prefix="zoo-fabricate-") as work:
        repos = family.fabricate_checkpoint(recipe, Path(work))
        if main_repo not in repos:
            raise ExportError(f"family {recipe.family!r} fabricated {sorted(repos)} but not the recipe's repo "
                              f"{main_repo!r}", "fabricate_checkpoint must return the recipe's source.repo_id")
        if recipe.source.fabricate_dtype:
            _store_weights_as(Path(repos[main_repo]), recipe.source.fabricate_dtype)
        commits = {}
        for repo_id, folder in repos.items():
            revision = recipe.source.revision if repo_id == main_repo else "main"
            commits[repo_id] = put_in_cache(repo_id, Path(folder), cache, revision)
    return commits


def _store_weights_as(folder: Path, dtype_name: str) -> None:
    """Rewrite every floating tensor of the folder's ``*.safetensors`` files in ``dtype_name``, metadata kept."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    dtype = getattr(torch, dtype_name)  # the recipe schema admits floating dtypes only
    for path in sorted(folder.rglob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata()
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        tensors = {name: t.to(dtype) if t.is_floating_point() else t for name, t in tensors.items()}
        save_file(tensors, str(path), metadata=metadata)


@contextlib.contextmanager
def fabricated_hub(recipe, cache_dir: Optional[Path] = None) -> Iterator[Path]:
    """Fabricate, then point huggingface_hub (and everything that calls it) at the tiny cache, offline."""
    cache = Path(cache_dir) if cache_dir is not None else tiny_cache_dir()
    fabricate(recipe, cache)
    with hub_environment(cache, offline=True):
        yield cache


@contextlib.contextmanager
def _cache_lock(cache: Path) -> Iterator[None]:
    """One fabrication at a time per cache: two runs writing the same snapshot would trip over each other."""
    try:
        import fcntl
    except ImportError:  # not on POSIX: no concurrent runs expected there
        yield
        return
    with open(cache / ".zoo-fabricate.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
