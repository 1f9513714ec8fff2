"""Kernel fixtures and tools shared by the GPU-target tests: the fixture .so files, cuobjdump as an independent
reader, and hand-packed fatbin containers."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
from pathlib import Path


FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "so"
H200 = FIXTURES / "h200_kernels.so"
A100 = FIXTURES / "a100_kernels.so"


def _cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton
    except ImportError:
        return ""
    shipped = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(shipped) if shipped.is_file() else ""


def _cuobjdump_images(tool: str, fatbin: Path) -> list:
    """(kind, arch) pairs as cuobjdump describes them: "Fatbin elf code: ... arch = sm_90a"."""
    out = subprocess.run([tool, str(fatbin)], capture_output=True, text=True, check=True).stdout
    return [("sass" if kind == "elf" else "ptx", arch)
            for kind, arch in re.findall(r"Fatbin (elf|ptx) code:\s*=+\s*arch = sm_(\w+)", out)]


def entry(kind: int, arch: int, flags: int = 0x11, payload: bytes = b"\0" * 8, header: int = 64,
          code: tuple = (1, 8)) -> bytes:
    """One fatbin entry packed by hand: kind, version 0x101, header size, payload size, PTX ISA / cubin version
    at 24, architecture at 28, flags at 40."""
    head = bytearray(header)
    struct.pack_into("<HHIQ", head, 0, kind, 0x101, header, len(payload))
    struct.pack_into("<HHI", head, 24, code[1], code[0], arch)
    struct.pack_into("<Q", head, 40, flags)
    return bytes(head) + payload


def container(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body
