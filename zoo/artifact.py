"""The artifact's files: ExecuTorch's ``model.pte`` and ``aoti_cuda_blob.ptd`` as the CUDA backend writes them,
read without any GPU, and each method's compiled ``.so`` and weights blob taken back out of their bytes.

Everything that reads an artifact (audit, verify, bench, the coming runner and C++ runtime backend) reads it
here; the compiler (``zoo.lowering``) only writes it. ExecuTorch 1.2.0 keeps a method's ``.so`` inside the
``.pte`` as named data ``<method>_so_blob`` and its weights in the ``.ptd`` as ``<method>_weights_blob``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

from . import atomic
from .errors import LoweringError

PTE_NAME = "model.pte"
PTD_NAME = "aoti_cuda_blob.ptd"
PTD_TAG = "aoti_cuda_blob"  # the external tag CudaBackend gives its weights; the .ptd is named after it
SO_SUFFIX = "_so_blob"  # named data key of a method's .so inside the .pte (executorch 1.2.0)
WEIGHTS_SUFFIX = "_weights_blob"  # named data key of a method's weights inside the .ptd
CUDA_BACKEND_ID = "CudaBackend"


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


def read_pte(pte_path: Path) -> Tuple[Dict[str, PteMethod], Dict[str, bytes]]:
    """Methods of an ExecuTorch .pte with their delegate backend, and the named data stored inside it."""
    ensure_flatc()
    from executorch.exir._serialize._program import deserialize_pte_binary

    data = Path(pte_path).read_bytes()
    try:
        pte = deserialize_pte_binary(data)
    except Exception as exc:  # the deserializer raises plain exceptions of several kinds on foreign bytes
        raise LoweringError(f"{pte_path} is not a readable ExecuTorch program: {type(exc).__name__}: {exc}",
                            f"pass a {PTE_NAME} written by ExecuTorch 1.2") from exc
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


def read_ptd_index(ptd_path: Path) -> Dict[str, Tuple[int, int]]:
    """Named entries of a .ptd as {key: (file offset, size)}, reading only the header and index."""
    ensure_flatc()
    from executorch.extension.flat_tensor.serialize.serialize import (
        FlatTensorHeader,
        _deserialize_to_flat_tensor,
    )

    with open(ptd_path, "rb") as fh:
        head = fh.read(8 + FlatTensorHeader.EXPECTED_LENGTH)
        header = FlatTensorHeader.from_bytes(head[8:]) if len(head) > 8 else None
        if header is None or not header.is_valid():
            raise LoweringError(f"{ptd_path} is not an ExecuTorch data file (.ptd)",
                                f"pass the {PTD_NAME} written beside the {PTE_NAME}")
        fh.seek(0)
        flat = _deserialize_to_flat_tensor(fh.read(header.flatbuffer_offset + header.flatbuffer_size))
    return {entry.key: (header.segment_base_offset + flat.segments[entry.segment_index].offset,
                        flat.segments[entry.segment_index].size)
            for entry in flat.named_data}


def _copy_range(src: Path, offset: int, size: int, dest: Path) -> None:
    with atomic.atomic_path(dest) as tmp, open(src, "rb") as fin, open(tmp, "wb") as fout:
        fin.seek(offset)
        left = size
        while left:
            chunk = fin.read(min(left, 64 << 20))
            if not chunk:
                raise LoweringError(f"{src} ends before its entry at {offset}+{size}", "the file is truncated")
            fout.write(chunk)
            left -= len(chunk)


def extract_method_files(pte_path: Path, ptd_path: Optional[Path], so_dir: Path,
                         only: Optional[Sequence[str]] = None) -> Dict[str, Dict[str, Any]]:
    """Write each CUDA method's .so (from the .pte) and weights blob (from the .ptd) into ``so_dir``; with
    ``only``, just those methods (a real-size blob is ~10 GB: timing one method need not copy the others)."""
    methods, named = read_pte(pte_path)
    index = read_ptd_index(ptd_path) if ptd_path is not None and Path(ptd_path).exists() else {}
    out: Dict[str, Dict[str, Any]] = {}
    for name, method in methods.items():
        if method.so_key is None or (only is not None and name not in only):
            continue
        so_path = so_dir / so_file_name(name)
        atomic.write_bytes(so_path, named[method.so_key])
        entry: Dict[str, Any] = {"so": so_path, "so_bytes": len(named[method.so_key]), "weights": None,
                                 "weights_bytes": 0}
        key = name + WEIGHTS_SUFFIX
        if key in index:
            offset, size = index[key]
            blob = so_dir / weights_file_name(name)
            _copy_range(Path(ptd_path), offset, size, blob)
            entry.update(weights=blob, weights_bytes=size)
        out[name] = entry
    return out
