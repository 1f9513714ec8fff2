"""The artifact's files: ExecuTorch's ``model.pte`` and ``aoti_cuda_blob.ptd`` as the CUDA backend writes them,
read without any GPU, and each method's compiled ``.so`` and weights blob taken back out of their bytes.

Everything that reads an artifact (audit, verify, bench, the coming runner and C++ runtime backend) reads it
here; the compiler (``zoo.export.lower.lowering``) only writes it. ExecuTorch 1.2.0 keeps a method's ``.so`` inside the
``.pte`` as named data ``<method>_so_blob`` and its weights in the ``.ptd`` as ``<method>_weights_blob``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from zoo.core import atomic
from zoo.core.errors import LoweringError

PTE_NAME = "model.pte"
PTD_NAME = "aoti_cuda_blob.ptd"
PTD_TAG = "aoti_cuda_blob"  # the external tag CudaBackend gives its weights; the .ptd is named after it
SO_SUFFIX = "_so_blob"  # named data key of a method's .so inside the .pte (executorch 1.2.0)
WEIGHTS_SUFFIX = "_weights_blob"  # named data key of a method's weights inside the .ptd
CUDA_BACKEND_ID = "CudaBackend"
_CHUNK = 64 << 20


def so_file_name(method: str) -> str:
    """The file a method's compiled .so is extracted to."""
    return f"{method}.so"


def weights_file_name(method: str) -> str:
    """The file a method's weights blob is extracted to."""
    return f"{method}.weights.blob"


def ensure_flatc() -> str:
    """Point FLATC_EXECUTABLE at a flatc (writing or reading a .pte needs it) unless it is already set."""
    current = os.environ.get("FLATC_EXECUTABLE")
    if current and Path(current).is_file():
        return current
    candidates = [Path(sys.executable).parent / "flatc"]
    spec = importlib.util.find_spec("executorch")  # a namespace package: no __file__
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidates.append(Path(location) / "data" / "bin" / "flatc")
    on_path = shutil.which("flatc")
    if on_path:
        candidates.append(Path(on_path))
    for path in candidates:
        if path.is_file():
            if not os.access(path, os.X_OK):  # wheels unpacked with --target can lose the run bit
                with contextlib.suppress(OSError):
                    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
            if os.access(path, os.X_OK):
                os.environ["FLATC_EXECUTABLE"] = str(path)
                return str(path)
    raise LoweringError("no flatc executable found: writing and reading .pte files needs it",
                        "install executorch (it ships executorch/data/bin/flatc) or set FLATC_EXECUTABLE")


@dataclass
class PteMethod:
    name: str
    backend: str
    so_key: Optional[str]


def read_pte_file(pte_path: Path):
    """A ``.pte`` as executorch's ``PTEFile`` (program, mutable data, named data), segments restored inline; a
    clear error for bytes that are not an ExecuTorch program."""
    ensure_flatc()
    from executorch.exir._serialize._program import deserialize_pte_binary

    try:
        return deserialize_pte_binary(Path(pte_path).read_bytes())
    except Exception as exc:  # the deserializer raises plain exceptions of several kinds on foreign bytes
        raise LoweringError(f"{pte_path} is not a readable ExecuTorch program: {type(exc).__name__}: {exc}",
                            f"pass a {PTE_NAME} written by ExecuTorch 1.2") from exc


def read_pte(pte_path: Path) -> Tuple[Dict[str, PteMethod], Dict[str, bytes]]:
    """Methods of an ExecuTorch .pte with their delegate backend, and the named data stored inside it."""
    pte = read_pte_file(pte_path)
    named: Dict[str, bytes] = {}
    if pte.named_data is not None:
        for key, entry in pte.named_data.pte_data.items():
            named[key] = bytes(pte.named_data.buffers[entry.buffer_index])
    methods: Dict[str, PteMethod] = {}
    for plan in pte.program.execution_plan:
        backend = ""
        so_key = None
        for delegate in plan.delegates:
            backend = delegate.id
            specs = {spec.key: bytes(spec.value) for spec in delegate.compile_specs}
            name = specs.get("method_name", plan.name.encode()).decode("utf-8", "replace")
            if name + SO_SUFFIX in named:
                so_key = name + SO_SUFFIX
        methods[plan.name] = PteMethod(plan.name, backend, so_key)
    return methods, named


def planned_io(program: Any) -> Dict[str, Dict[str, List[bool]]]:
    """Per method of an ExecuTorch ``Program`` (``executorch.exir.schema``), which graph inputs and outputs live in
    the method's planned memory (``allocation_info``): a planned input is copied into that host memory by
    ``Method::set_input``, so it cannot take a GPU pointer; a non-tensor input or output counts as not planned."""

    def planned(plan: Any, index: int) -> bool:
        val = getattr(plan.values[index], "val", None)
        return getattr(val, "allocation_info", None) is not None

    return {plan.name: {"inputs": [planned(plan, i) for i in plan.inputs],
                        "outputs": [planned(plan, i) for i in plan.outputs]}
            for plan in program.execution_plan}


def io_memory_planning(pte_path: Path) -> Dict[str, Dict[str, List[bool]]]:
    """``planned_io`` of a written ``.pte``."""
    return planned_io(read_pte_file(pte_path).program)


@dataclass
class DataEntry:
    """One named entry of a ``.ptd``: where its bytes lie (file, absolute offset, size) and its tensor layout."""

    key: str
    source: Path
    offset: int
    size: int
    tensor_layout: Any = None  # executorch.exir.tensor_layout.TensorLayout or None


def read_ptd_entries(ptd_path: Path) -> List[DataEntry]:
    """The named entries of a ``.ptd`` with where their bytes lie; reads only the header and the index."""
    ensure_flatc()
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorHeader, _deserialize_to_flat_tensor

    path = Path(ptd_path)
    with open(path, "rb") as fh:
        head = fh.read(8 + FlatTensorHeader.EXPECTED_LENGTH)
        header = FlatTensorHeader.from_bytes(head[8:]) if len(head) == 8 + FlatTensorHeader.EXPECTED_LENGTH else None
        if header is None or not header.is_valid():
            raise LoweringError(f"{path} is not an ExecuTorch data file (.ptd)",
                                f"pass the {PTD_NAME} written beside the {PTE_NAME}")
        fh.seek(0)
        flat = _deserialize_to_flat_tensor(fh.read(header.flatbuffer_offset + header.flatbuffer_size))
    file_bytes = path.stat().st_size
    entries = []
    for named in flat.named_data:
        segment = flat.segments[named.segment_index]
        offset = header.segment_base_offset + segment.offset
        if offset + segment.size > file_bytes:
            raise LoweringError(f"{path}: entry {named.key!r} ends at {offset + segment.size}, past the file's "
                                f"{file_bytes} bytes", "the file is truncated; lower again")
        entries.append(DataEntry(named.key, path, offset, segment.size, named.tensor_layout))
    return entries


def range_chunks(path: Path, offset: int, size: int) -> Iterator[bytes]:
    """``size`` bytes of ``path`` from ``offset``, read in pieces of at most 64 MiB (a weights blob is ~10 GB)."""
    with open(path, "rb") as fh:
        fh.seek(offset)
        left = size
        while left:
            chunk = fh.read(min(left, _CHUNK))
            if not chunk:
                raise LoweringError(f"{path} ends before its entry at {offset}+{size}", "the file is truncated")
            yield chunk
            left -= len(chunk)


def copy_range(src: Path, offset: int, size: int, dest: Path) -> None:
    """Copy ``size`` bytes of ``src`` from ``offset`` into a new file ``dest`` (atomically), in the kernel where
    it can (``os.copy_file_range``: no pass through Python buffers), else in chunks."""
    with atomic.atomic_path(dest) as tmp, open(src, "rb") as fin, open(tmp, "wb") as fout:
        done = 0
        if hasattr(os, "copy_file_range"):
            try:
                while done < size:
                    n = os.copy_file_range(fin.fileno(), fout.fileno(), min(size - done, 1 << 30),
                                           offset + done, done)
                    if n == 0:
                        raise LoweringError(f"{src} ends before its entry at {offset}+{size}", "the file is truncated")
                    done += n
            except OSError:  # a filesystem or kernel without it: the chunked copy below takes over where it stopped
                pass
        fout.seek(done)
        for chunk in range_chunks(src, offset + done, size - done):
            fout.write(chunk)


# --- each method's .so and weights, out of the artifact --------------------------------------------------------

# What ``extract_method_files`` took from which files, written last into the folder it extracted to: a later
# reader (verification, the bench) may use the extracted files instead of extracting again only while the
# .pte, the .ptd and every extracted file are the very files recorded here, untouched.
EXTRACTED_JSON = "extracted.json"


def _file_identity(path: Path) -> List[int]:
    """What changes whenever a file is replaced or written: device, inode, size, modification and change times
    (the change time cannot be set back by a user, so an edit followed by ``touch -r`` still shows)."""
    st = os.stat(path)
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def extract_method_files(pte_path: Path, ptd_path: Optional[Path], so_dir: Path,
                         methods: Optional[Sequence[str]] = None) -> Dict[str, Dict[str, Any]]:
    """Write each CUDA method's .so (from the .pte) and weights blob (from the .ptd) into ``so_dir``; only
    ``methods`` when given.

    Methods whose weights keys name one segment of the .ptd (identical blobs, stored once: ``zoo.export.lower.assemble``)
    get one file: the first method's is written, the others are hard links to it (symbolic links where the
    filesystem has none), so a ~10 GB blob shared by two methods is copied once. ``EXTRACTED_JSON`` is
    written last, naming the files read and written (``reusable_method_files``)."""
    so_dir = Path(so_dir)
    stamp = so_dir / EXTRACTED_JSON
    stamp.unlink(missing_ok=True)  # the files below change now: an earlier stamp no longer describes them
    found, named = read_pte(pte_path)
    wanted = list(found) if methods is None else list(methods)
    ptd_there = ptd_path is not None and Path(ptd_path).exists()
    entries = {e.key: e for e in read_ptd_entries(ptd_path)} if ptd_there else {}
    out: Dict[str, Dict[str, Any]] = {}
    written: Dict[Tuple[int, int], Path] = {}  # (offset, size) of a segment -> the file holding it
    for name in wanted:
        method = found.get(name)
        if method is None or method.so_key is None:
            continue
        so_path = so_dir / so_file_name(name)
        atomic.write_bytes(so_path, named[method.so_key])
        entry: Dict[str, Any] = {"so": so_path, "so_bytes": len(named[method.so_key]), "weights": None,
                                 "weights_bytes": 0, "shares_weights_with": None}
        data = entries.get(name + WEIGHTS_SUFFIX)
        if data is not None:
            blob = so_dir / weights_file_name(name)
            first = written.get((data.offset, data.size))
            if first is None:
                copy_range(data.source, data.offset, data.size, blob)
                written[(data.offset, data.size)] = blob
            else:
                _link(first, blob)
                entry["shares_weights_with"] = first.name
            entry.update(weights=blob, weights_bytes=data.size)
        out[name] = entry
    atomic.write_json(stamp, {
        "pte": [Path(pte_path).name, _file_identity(pte_path)],
        "ptd": [Path(ptd_path).name, _file_identity(ptd_path)] if ptd_there else None,
        "methods": {name: {"so": e["so"].name, "so_bytes": e["so_bytes"], "so_identity": _file_identity(e["so"]),
                           "weights": e["weights"].name if e["weights"] else None,
                           "weights_bytes": e["weights_bytes"], "shares_weights_with": e["shares_weights_with"],
                           "weights_identity": _file_identity(e["weights"]) if e["weights"] else None}
                    for name, e in out.items()}})
    return out


def _link(existing: Path, new: Path) -> None:
    """``new`` names the same bytes as ``existing`` (same folder), replacing whatever ``new`` was."""
    tmp = new.with_name(f".{new.name}.link-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        os.link(existing, tmp)
    except OSError:  # no hard links here (some network and FUSE filesystems): a relative symbolic link
        os.symlink(existing.name, tmp)
    os.replace(tmp, new)


def reusable_method_files(pte_path: Path, ptd_path: Optional[Path], so_dir: Path,
                          methods: Sequence[str]) -> Optional[Dict[str, Dict[str, Any]]]:
    """The files an earlier ``extract_method_files`` left in ``so_dir`` for ``methods``, when they are still
    what the .pte and .ptd hold now: the stamp names these very .pte/.ptd files (same inode, size and times)
    and every extracted file is untouched. None otherwise (extract again): a swapped or edited artifact is
    never judged by stale copies."""
    so_dir = Path(so_dir)
    try:
        stamp = json.loads((so_dir / EXTRACTED_JSON).read_text())
        ptd_there = ptd_path is not None and Path(ptd_path).exists()
        if stamp["pte"] != [Path(pte_path).name, _file_identity(pte_path)]:
            return None
        if (stamp["ptd"] is None) == ptd_there or (
                ptd_there and stamp["ptd"] != [Path(ptd_path).name, _file_identity(ptd_path)]):
            return None
        out: Dict[str, Dict[str, Any]] = {}
        for name in methods:
            rec = stamp["methods"][name]
            so, weights = so_dir / rec["so"], (so_dir / rec["weights"]) if rec["weights"] else None
            if _file_identity(so) != rec["so_identity"]:
                return None
            if weights is not None and _file_identity(weights) != rec["weights_identity"]:
                return None
            out[name] = {"so": so, "so_bytes": rec["so_bytes"], "weights": weights,
                         "weights_bytes": rec["weights_bytes"], "shares_weights_with": rec["shares_weights_with"]}
        return out
    except (OSError, ValueError, KeyError, TypeError):  # no stamp, a damaged one, a file gone: extract again
        return None
