"""What each ExecuTorch CUDA runtime can run, and how zoo asks ExecuTorch's CUDA backend to compile for it.

- The release table (``zoo/data/runtimes.json``): per runtime release, the dtypes it has and every ``aoti_torch_*``
  function its shim library exports, each release written as the difference to its ``base``. The kernel
  preflight checks a program against it before the compile, the symbol audit checks the compiled ``.so``.
- The fallback allow-list: the ATen fallback kernels the installed executorch's ``CudaBackend`` lets a
  compiled method call (its compile refuses any other, but only after the whole compile).
- The compile specs zoo gives ``CudaPartitioner`` for each method.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Set

from zoo.core.errors import LoweringError

RUNTIMES_JSON = Path(__file__).resolve().parents[1] / "data" / "runtimes.json"


@dataclass
class Release:
    name: str
    version: str
    dtypes: List[str]
    symbols: Set[str]
    allowed_fallback_kernels: Set[str]


def load_runtimes(path: Path = RUNTIMES_JSON) -> Dict[str, Release]:
    """The releases in ``runtimes.json``, each resolved through its ``base`` chain to full sets."""
    raw = json.loads(Path(path).read_text())["releases"]
    resolved: Dict[str, Release] = {}

    def resolve(name: str, seen: tuple = ()) -> Release:
        if name in resolved:
            return resolved[name]
        if name in seen or name not in raw:
            raise LoweringError(f"{path}: release {name!r} has a missing or circular base", "fix runtimes.json")
        entry = raw[name]
        base = resolve(entry["base"], seen + (name,)) if entry.get("base") else None
        release = Release(
            name=name, version=entry["version"],
            dtypes=(list(base.dtypes) if base else []) + [d for d in entry["dtypes"] if not base or d not in base.dtypes],
            symbols=(set(base.symbols) if base else set()) | set(entry["symbols"]),
            allowed_fallback_kernels=(set(base.allowed_fallback_kernels) if base else set())
            | set(entry["allowed_fallback_kernels"]))
        resolved[name] = release
        return release

    for name in raw:
        resolve(name)
    return {name: resolved[name] for name in raw}


def supported_fallback_kernels() -> Set[str]:
    """The installed executorch's compile-time allow-list of ATen fallback kernels."""
    from executorch.backends.cuda.cuda_backend import CudaBackend

    return set(CudaBackend.get_supported_fallback_kernels())


def compile_specs(method: str, triton_kernel_mode: str) -> list:
    """``CudaPartitioner``'s compile specs for one method: its name, and whether SDPA uses the Triton kernel."""
    from executorch.backends.cuda.cuda_backend import CudaBackend
    from executorch.exir.backend.compile_spec_schema import CompileSpec

    return [CudaBackend.generate_method_name_compile_spec(method),
            CompileSpec("triton_kernel_mode", triton_kernel_mode.encode("utf-8"))]
