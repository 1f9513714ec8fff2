"""zoo tensor files (``.zt``): one tensor per file, what the C++ runner (runtime/cpp) reads and writes.

Layout (all little-endian)::

    offset  size      field
    0       8         magic b"ZOOTENS\\0"
    8       4         version, uint32 = 1
    12      4         dtype, uint32: ExecuTorch's (= c10's) ScalarType number, see DTYPE_CODES
    16      4         rank, uint32 (0 for a 0-d tensor, at most 16)
    20      4         reserved, uint32 = 0
    24      8 * rank  sizes, int64 each, >= 0
    24+8r   ...       the elements, C-contiguous, numel * element size bytes; nothing after them

The bytes go straight between the tensor's memory and the file (ctypes over ``data_ptr``), with no copy
through Python objects: a real-size KV pool is gigabytes. The same layout is read and written by
``runtime/cpp/tensor_file.cpp``; docs/runtime.md documents it for other languages.
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys
from pathlib import Path
from typing import Union

import torch

from zoo.core.atomic import atomic_path
from zoo.core.errors import TensorFileError

MAGIC = b"ZOOTENS\x00"
VERSION = 1
MAX_RANK = 16
HEADER = struct.Struct("<8sIIII")  # magic, version, dtype, rank, reserved

# torch dtype -> ScalarType number (c10 and ExecuTorch share the numbering).
DTYPE_CODES = {
    torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.int64: 4, torch.float16: 5,
    torch.float32: 6, torch.float64: 7, torch.complex64: 9, torch.complex128: 10, torch.bool: 11,
    torch.bfloat16: 15, torch.uint16: 27, torch.uint32: 28, torch.uint64: 29,
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}

PathLike = Union[str, Path]


def _check_host() -> None:
    if sys.byteorder != "little":
        raise TensorFileError("zoo tensor files are little-endian and this host is big-endian",
                              "exchange tensors with the runner on a little-endian host (x86-64, aarch64)")


def _raw(tensor: torch.Tensor, nbytes: int):
    """A writable view of a contiguous CPU tensor's bytes, for file.write / file.readinto."""
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def write_tensor(path: PathLike, tensor: torch.Tensor, *, handover: bool = False) -> Path:
    """Write ``tensor`` (any device, any strides) to ``path``, atomically (``zoo.core.atomic``).

    ``handover=True`` writes it in place instead, unsynced: for a file another process is told about only after
    this returns and deletes after reading (ExecuTorch's runner), where the telling orders the two, nothing must
    survive a crash, and the temporary files, renames and fsyncs of atomic writes cost 2.3 ms per call of a DiT
    step's five inputs on a CPU machine's disk (benchmarks/bench_session.py)."""
    _check_host()
    if tensor.dtype not in DTYPE_CODES:
        raise TensorFileError(f"{path}: dtype {tensor.dtype} has no code in the zoo tensor format",
                              f"use one of {', '.join(str(d).replace('torch.', '') for d in DTYPE_CODES)}")
    t = tensor.detach().to("cpu").contiguous()
    if t.dim() > MAX_RANK:
        raise TensorFileError(f"{path}: rank {t.dim()} is above the format's {MAX_RANK}")
    nbytes = t.numel() * t.element_size()
    if handover:
        with open(path, "wb") as fh:
            _write_to(fh, t, nbytes)
    else:
        with atomic_path(path) as tmp, open(tmp, "wb") as fh:
            _write_to(fh, t, nbytes)
    return Path(path)


def _write_to(fh, t: torch.Tensor, nbytes: int) -> None:
    fh.write(HEADER.pack(MAGIC, VERSION, DTYPE_CODES[t.dtype], t.dim(), 0))
    fh.write(struct.pack(f"<{t.dim()}q", *t.shape))
    if nbytes:
        fh.write(_raw(t, nbytes))


def read_tensor(path: PathLike) -> torch.Tensor:
    """Read a tensor file into a new CPU tensor; ``TensorFileError`` for anything but a whole, valid file."""
    _check_host()
    path = Path(path)
    try:
        size = os.path.getsize(path)
        fh = open(path, "rb")
    except OSError as exc:
        raise TensorFileError(f"{path}: cannot open ({exc.strerror})", "is the path right?") from exc
    with fh:
        head = fh.read(HEADER.size)
        if len(head) < HEADER.size:
            raise TensorFileError(f"{path}: not a zoo tensor file (shorter than its {HEADER.size}-byte header)",
                                  "the runner writes whole files; was it interrupted, or is this another format?")
        magic, version, code, rank, reserved = HEADER.unpack(head)
        if magic != MAGIC:
            raise TensorFileError(f"{path}: not a zoo tensor file (magic {magic!r}, expected {MAGIC!r})",
                                  "tensor files are written by zoo.contract.tensor_file.write_tensor or zoo_runner")
        if version != VERSION:
            raise TensorFileError(f"{path}: zoo tensor file version {version}, this zoo reads version {VERSION}",
                                  "use a zoo and a zoo_runner built from the same checkout")
        if code not in CODE_DTYPES:
            raise TensorFileError(f"{path}: dtype code {code} is not one the zoo tensor format carries")
        if rank > MAX_RANK or reserved != 0:
            raise TensorFileError(f"{path}: corrupt header (rank {rank}, reserved {reserved})")
        raw_sizes = fh.read(8 * rank)
        if len(raw_sizes) < 8 * rank:
            raise TensorFileError(f"{path}: truncated (the header promises {rank} sizes)")
        shape = struct.unpack(f"<{rank}q", raw_sizes)
        if any(s < 0 for s in shape):
            raise TensorFileError(f"{path}: corrupt header (negative size in {list(shape)})")
        dtype = CODE_DTYPES[code]
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = 1
        for s in shape:
            numel *= s
        want = numel * itemsize
        have = size - HEADER.size - 8 * rank
        if have != want:
            raise TensorFileError(
                f"{path}: {'truncated' if have < want else 'trailing bytes'} ({want} data bytes expected for "
                f"{str(dtype).replace('torch.', '')} {list(shape)}, {have} present)",
                "the file was cut short or is not what its header says; write it again")
        out = torch.empty(shape, dtype=dtype)
        if want and fh.readinto(_raw(out, want)) != want:
            raise TensorFileError(f"{path}: read error (the file changed while it was read?)")
    return out
