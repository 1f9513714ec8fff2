"""Pull a recipe's checkpoint: a Hugging Face Hub snapshot (pinned revision, the user's cache, HF_HUB_OFFLINE)
or a local checkpoint folder.

Every way this can fail becomes a ``PullError`` naming the repo, the revision and what to do. Loading the
weights (LeRobot's ``from_pretrained(..., strict=True)`` or the llama reader) happens in the family module;
here only the files are fetched and the folder checked to look like a checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

from zoo import policies
from zoo.export import tiny_hub
from zoo.core.errors import PullError, first_line
from zoo.export.hub_cache import hub_environment, put_in_cache
from zoo.core.progress import bars_on, on_terminal, say

# A checkpoint folder has its config and its weights, single-file or sharded with an index.
CONFIG_FILE = "config.json"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")

_COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass
class Checkpoint:
    """Where a recipe's checkpoint lies on disk and which exact version it is (written as source.json)."""

    path: Path
    repo_id: str
    revision: str
    commit: Optional[str]  # the resolved 40-hex commit (the snapshot folder's name); None for a local folder
    local_dir: Optional[str] = None
    cache_dir: Optional[str] = None
    offline: bool = False
    fabricated: bool = False

    def as_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["path"] = str(self.path)
        return d


def offline_hint(where: str = "") -> str:
    return (f"run once with network{where}, or `python -m zoo bundle` on a connected machine and copy the "
            "bundle here, or pass source.local_dir=/path/to/checkpoint")


def pull(recipe) -> Checkpoint:
    """Fetch ``recipe.source`` and return where it lies; a local_dir wins over the Hub id."""
    from huggingface_hub import constants

    src = recipe.source
    if src.local_dir:
        path = Path(src.local_dir).expanduser()
        check_checkpoint_folder(path, f"source.local_dir {path}", local=True)
        say(f"using local checkpoint {path}")
        return Checkpoint(path=path.resolve(), repo_id=src.repo_id, revision=src.revision, commit=None,
                          local_dir=str(path.resolve()), cache_dir=None, offline=bool(constants.HF_HUB_OFFLINE),
                          fabricated=False)
    path = snapshot(src.repo_id, src.revision, list(src.allow_patterns) or None)
    check_checkpoint_folder(path, f"{src.repo_id}@{src.revision}", local=False)
    commit = path.name if _COMMIT.match(path.name) else None
    return Checkpoint(path=path, repo_id=src.repo_id, revision=src.revision, commit=commit, local_dir=None,
                      cache_dir=str(constants.HF_HUB_CACHE), offline=bool(constants.HF_HUB_OFFLINE),
                      fabricated=bool(src.fabricate))


def snapshot(repo_id: str, revision: str, allow_patterns=None) -> Path:
    """``huggingface_hub.snapshot_download`` into the user's cache (HF_HUB_CACHE), errors made readable.

    huggingface_hub draws its own tqdm bars for the files it downloads; a cached snapshot returns at once.
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        DisabledRepoError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = f"{repo_id!r} at revision {revision!r}"
    offline = bool(constants.HF_HUB_OFFLINE)
    say(f"pulling {repo_id}@{revision} ({'offline, from the cache' if offline else 'Hub'}; cache {constants.HF_HUB_CACHE})")
    try:
        # Offline, ask for local files only: huggingface_hub otherwise wants a cached tree listing for a
        # pinned commit, which snapshots copied in by hand (or fabricated) do not have.
        with download_bars():
            return Path(snapshot_download(repo_id, revision=revision, allow_patterns=allow_patterns,
                                          local_files_only=offline))
    except GatedRepoError as exc:
        raise PullError(f"{what} is gated: the Hub answered {_hub_answer(exc)}",
                        f"accept the license on https://huggingface.co/{repo_id} and log in "
                        "(`hf auth login` or HF_TOKEN)") from exc
    except RevisionNotFoundError as exc:
        raise PullError(f"revision {revision!r} does not exist in {repo_id!r}: the Hub answered {_hub_answer(exc)}",
                        "set source.revision to a branch, tag or commit of the repo (see its 'Files' page)") from exc
    except RepositoryNotFoundError as exc:
        raise PullError(f"repo {repo_id!r} was not found on the Hub (revision {revision!r}): {_hub_answer(exc)}",
                        "check source.repo_id; a private repo needs a login (`hf auth login` or HF_TOKEN)") from exc
    except DisabledRepoError as exc:
        raise PullError(f"repo {repo_id!r} is disabled on the Hub: {_hub_answer(exc)}",
                        "use another checkpoint (source.repo_id) or a local copy (source.local_dir)") from exc
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as exc:
        if offline:
            raise PullError(f"{what} is not in the Hub cache {constants.HF_HUB_CACHE} and HF_HUB_OFFLINE is set",
                            offline_hint(" (HF_HUB_OFFLINE=0)")) from exc
        raise PullError(f"{what} could not be fetched (the Hub is unreachable: {_cause(exc)}) and is not in the "
                        f"cache {constants.HF_HUB_CACHE}", offline_hint()) from exc
    except HfHubHTTPError as exc:
        raise PullError(f"{what} could not be fetched: the Hub answered {_hub_answer(exc)}",
                        "try again later, or use a local copy (source.local_dir)") from exc
    except Exception as exc:
        if not _network_error(exc):
            raise
        raise PullError(f"{what} could not be fetched: network error {type(exc).__name__}: {exc}",
                        offline_hint()) from exc


@contextlib.contextmanager
def download_bars() -> Iterator[None]:
    """huggingface_hub's per-file download bars on a terminal; none in a log (they would fill it with \\r)."""
    if bars_on():
        with on_terminal():
            yield
        return
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            enable_progress_bars()


def checkpoint_into_cache(recipe, cache_dir: Path) -> Dict[str, str]:
    """Put a recipe's checkpoint, and every repo its policy loads by Hub id, into the Hub cache ``cache_dir``
    (``python -m zoo bundle``: a cache to carry to a machine without network). Returns {repo_id: commit}.

    The auxiliary repos (VAE, text encoder, tokenizer) are whatever the family's loaders fetch: the export unit
    is built once with huggingface_hub pointed at ``cache_dir``, so the cache holds exactly what an offline
    export needs. Tiny recipes are fabricated into it; a local checkpoint folder is filed under its repo id.
    """
    cache_dir = Path(cache_dir)
    src = recipe.source
    if src.fabricate and not src.local_dir:
        return tiny_hub.fabricate(recipe, cache_dir)
    if src.local_dir:
        folder = Path(src.local_dir).expanduser()
        check_checkpoint_folder(folder, f"source.local_dir {folder}", local=True)
        return {src.repo_id: put_in_cache(src.repo_id, folder, cache_dir, src.revision)}
    before = cached_commits(cache_dir)
    with hub_environment(cache_dir):
        checkpoint = pull(recipe)
        say(f"building the {recipe.family} unit once, so the repos it loads by id land in {cache_dir}")
        policies.load_family(recipe.family).build_unit(checkpoint.path, recipe)
    # The recipe's repo, and every repo the build fetched (a repo an earlier recipe already cached is not
    # listed again: huggingface_hub does not say which cached repos a loader read).
    after = cached_commits(cache_dir)
    fetched = {repo: commit for repo, commit in after.items() if before.get(repo) != commit}
    return {src.repo_id: checkpoint.commit or after.get(src.repo_id, ""), **fetched}


def cached_commits(cache_dir: Path) -> Dict[str, str]:
    """{repo_id: commit of refs/main (or of the only ref)} for every model repo in a Hub cache."""
    out = {}
    for repo in sorted(Path(cache_dir).glob("models--*")):
        refs = sorted((repo / "refs").glob("*")) if (repo / "refs").is_dir() else []
        ref = next((r for r in refs if r.name == "main"), refs[0] if refs else None)
        if ref is not None:
            out[repo.name[len("models--"):].replace("--", "/")] = ref.read_text().strip()
    return out


def check_checkpoint_folder(path: Path, label: str, local: bool) -> None:
    """A checkpoint folder holds config.json and its weights (model.safetensors, or an index of shards)."""
    if not path.exists():
        raise PullError(f"{label} does not exist", "give the folder that holds config.json and model.safetensors")
    if not path.is_dir():
        raise PullError(f"{label} is not a folder", "give the folder that holds config.json and model.safetensors")
    missing = []
    if not (path / CONFIG_FILE).is_file():
        missing.append(CONFIG_FILE)
    if not any((path / w).is_file() for w in WEIGHT_FILES):
        missing.append(" or ".join(WEIGHT_FILES))
    if missing:
        have = sorted(p.name for p in path.iterdir())[:12]
        where = "folder" if local else "snapshot"
        raise PullError(f"{label} is not a checkpoint: the {where} {path} lacks {', '.join(missing)} "
                        f"(it has: {', '.join(have) or 'nothing'})",
                        "point the recipe at a checkpoint saved with save_pretrained (config.json + "
                        "model.safetensors)" + ("" if local else "; check source.allow_patterns"))
    redo = ("restore the folder from its source" if local else
            "remove it from the Hub cache and pull again (or `hf download REPO --force-download`)")
    for weights in sorted(path.glob("*.safetensors")):
        check_safetensors(weights, redo)


def check_safetensors(path: Path, redo: str) -> None:
    """Refuse a truncated or foreign ``.safetensors`` file now, from its header alone (a few bytes read), rather
    than minutes later when the policy loads it: the header's tensors must end within the file."""
    size = path.stat().st_size
    hint = f"the file is incomplete or damaged (an interrupted download or copy): {redo}"
    with open(path, "rb") as fh:
        head = fh.read(8)
        header_len = int.from_bytes(head, "little") if len(head) == 8 else -1
        if header_len < 2 or 8 + header_len > size:
            raise PullError(f"{path} is truncated or not a safetensors file ({size} bytes; its header cannot be "
                            "read)", hint)
        try:
            header = json.loads(fh.read(header_len))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise PullError(f"{path} is not a readable safetensors file: its header is damaged ({exc})", hint) from None
    if 8 + header_len + end > size:
        raise PullError(f"{path} is truncated: its header places tensor data up to byte {8 + header_len + end}, "
                        f"the file has {size} bytes", hint)


def _network_error(exc: BaseException) -> bool:
    """A connection, proxy or timeout error of the HTTP client huggingface_hub uses (httpx, which zoo does not
    import itself), or of the standard library."""
    return isinstance(exc, (ConnectionError, TimeoutError)) or type(exc).__module__.split(".")[0] == "httpx"


def _hub_answer(exc: BaseException) -> str:
    """The Hub's own explanation: the server message when there is one, else the first line of the error."""
    server = getattr(exc, "server_message", None)
    text = server or str(exc)
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return " ".join(lines[:2]) if lines else type(exc).__name__


def _cause(exc: BaseException) -> str:
    cause = exc.__cause__ or exc.__context__
    if cause is None:
        return type(exc).__name__
    return f"{type(cause).__name__}: {first_line(str(cause))}".rstrip(": ")
