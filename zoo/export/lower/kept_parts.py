"""The methods a lowering finished, kept for the next lowering of the same run when this one stops part way
(an interrupt, a kill, a lost terminal, another method failing), and reused only while their stamp matches.

Each finished method's part (its ``.pte``, its ``.ptd`` files and its worker's result record) is hard-linked
into ``.<run name>.lowered/<method>/`` beside the run (``RunFolder.kept_parts_dir``) with ``stamp.json``: the
sha256 of the program file it was lowered from, its lowering options, the lowering function, and the torch,
executorch and GPU it was lowered with. The next lowering of that run reuses a part whose stamp equals the one
it computes, removes any other (saying which fields differ), and removes them all once it has assembled.
How it fits the lowering, and why there: docs/ARCHITECTURE.md ("Lowering").
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch

from zoo.contract.run_folder import KEPT_STAMP_JSON, RunFolder
from zoo.core import atomic
from zoo.core.errors import first_line
from zoo.export.lower import compile_settings
from zoo.export.lower.workers import RESULT_JSON, MethodPart

_HASH_CHUNK = 16 << 20
# The stamp's fields every method of one lowering shares, and how a message names each when it differs.
_SHARED_FIELDS = (("function", "lowering function"), ("torch", "torch"), ("executorch", "executorch"),
                  ("gpu", "GPU"))


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def gpu_words(gpu: Mapping[str, Any]) -> str:
    """The GPU a part was lowered on, as its stamp names it: its name and compute capability."""
    capability = gpu.get("capability")
    return f"{gpu.get('name')} (sm_{capability})" if capability is not None else str(gpu.get("name"))


def stamp_differences(kept: Mapping[str, Any], now: Mapping[str, Any]) -> List[str]:
    """What differs between a kept part's stamp and the one computed now, in words; empty when they match."""
    why = []
    if kept.get("program_sha256") != now["program_sha256"]:
        why.append("program changed")
    kept_options, options = kept.get("options") or {}, now["options"]
    changed = sorted(k for k in set(kept_options) | set(options) if kept_options.get(k) != options.get(k))
    if changed:
        why.append(f"lowering options changed: {', '.join(changed)}")
    why += [f"{label} {kept.get(key)} -> {now[key]}" for key, label in _SHARED_FIELDS if kept.get(key) != now[key]]
    return why


@dataclass(frozen=True)
class PartStore:
    """Where one run's kept parts live, and the stamp fields every method of this lowering shares."""

    folder: Path
    shared: Dict[str, Any]

    @classmethod
    def for_run(cls, run: RunFolder, function: str, gpu: Mapping[str, Any]) -> "PartStore":
        return cls(folder=run.kept_parts_dir, shared={
            "function": function, "torch": torch.__version__, "executorch": compile_settings.executorch_version(),
            "gpu": gpu_words(gpu)})

    def stamped(self, files: Mapping[str, Path], method_options: Mapping[str, Dict[str, Any]]) -> "KeptParts":
        """The parts of the methods whose programs are the ``files``, stamped (each file hashed, side by side:
        at real size each is ~10 GB, and hashlib hashes large reads without the GIL)."""
        methods = list(files)
        with ThreadPoolExecutor(max_workers=max(1, min(4, len(methods)))) as pool:
            hashes = dict(zip(methods, pool.map(lambda m: file_sha256(Path(files[m])), methods)))
        # Through JSON, as stamp.json holds it: tuples become lists, so equal options compare equal.
        stamps = {m: {"program_sha256": hashes[m], "options": json.loads(json.dumps(method_options[m])),
                      **self.shared} for m in methods}
        return KeptParts(folder=self.folder, stamps=stamps)

    def remove(self) -> None:
        """After a lowering that assembled: nothing of this run is left to resume."""
        shutil.rmtree(self.folder, ignore_errors=True)


@dataclass
class KeptParts:
    """The stamps of the methods this lowering may keep and reuse (those lowered from a program file)."""

    folder: Path
    stamps: Dict[str, Dict[str, Any]]

    def reuse(self, methods: Sequence[str], work_dir: Path, say: Callable[[str], None]) -> Dict[str, MethodPart]:
        """The kept parts of ``methods`` whose stamp matches, linked into ``work_dir/<method>/`` (the lowering
        deletes its parts' files once assembled: the kept ones stay until the run is done). A part whose stamp
        differs is removed, and the message says why its method is lowered again."""
        parts: Dict[str, MethodPart] = {}
        for method in methods:
            folder = self.folder / method
            if method not in self.stamps or not folder.is_dir():
                continue
            why = self._mismatch(method, folder)
            if why:
                shutil.rmtree(folder, ignore_errors=True)
                say(f"lowering {method} again: the part an earlier lowering kept does not match ({'; '.join(why)})")
                continue
            parts[method] = _linked_part(method, folder, work_dir / method)
            say(f"reusing the lowered {method} from an earlier lowering that stopped (stamp matches)")
        return parts

    def _mismatch(self, method: str, folder: Path) -> List[str]:
        try:
            kept = json.loads((folder / KEPT_STAMP_JSON).read_text())
            json.loads((folder / RESULT_JSON).read_text())
        except (OSError, ValueError) as exc:
            return [f"it cannot be read: {first_line(exc, limit=120)}"]
        if not (folder / f"{method}.pte").is_file():
            return [f"its {method}.pte is missing"]
        return stamp_differences(kept, self.stamps[method])

    def keep(self, part: MethodPart) -> None:
        """Keep a finished method's part with its stamp, whole or not at all (built beside its place and moved
        in). A part that cannot be kept (a full disk) costs only a later resume, never this lowering."""
        stamp = self.stamps.get(part.method)
        if stamp is None:
            return
        try:
            with atomic.atomic_folder(self.folder / part.method) as building:
                for path in [part.pte, *part.data_files.values(), part.pte.parent / RESULT_JSON]:
                    _link_or_copy(path, building / path.name)
                atomic.write_json(building / KEPT_STAMP_JSON, stamp)
        except Exception:  # noqa: BLE001 - keeping is an optimisation; the lowering goes on without it
            pass


def _linked_part(method: str, kept: Path, folder: Path) -> MethodPart:
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    for path in kept.iterdir():
        if path.name != KEPT_STAMP_JSON:
            _link_or_copy(path, folder / path.name)
    result = json.loads((folder / RESULT_JSON).read_text())
    return MethodPart(method=method, pte=folder / f"{method}.pte",
                      data_files={p.name: p for p in sorted(folder.glob("*.ptd"))},
                      record=result.get("record", {}), seconds=float(result.get("seconds", 0.0)), log=None)


def _link_or_copy(src: Path, dst: Path) -> None:
    """A hard link (a part holds its method's whole weights: ~10 GB at real size), a copy where links fail."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
