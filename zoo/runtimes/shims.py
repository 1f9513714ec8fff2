"""Who serves the ``aoti_torch_*`` names in this process: libtorch or ExecuTorch's CUDA shims, never both.

A compiled method's ``.so`` imports its runtime functions by those names, and the first library made global that
defines them serves every ``.so`` opened after it. libtorch's take ``at::Tensor``, ExecuTorch's take its own
tensor type, so a ``.so`` given the other's would crash (docs/runtime.md, "Why the runtime runs in a process of
its own"). Each runtime claims the names before it makes its library global; a claim by the other one is
refused with what to do.
"""

from __future__ import annotations

import ctypes
from typing import Optional

from zoo.core.errors import RuntimeConflict

LIBTORCH = "libtorch (torch's AOTI runner: verification, the artifact backend)"
EXECUTORCH = "ExecuTorch's CUDA shims (the in-process ExecuTorch session)"
# One name every shim library defines; present in the global scope once either library is made global.
PROBE = "aoti_torch_empty_strided"

_owner: Optional[str] = None


def owner() -> Optional[str]:
    return _owner


def _global_has(symbol: str) -> bool:
    return hasattr(ctypes.CDLL(None), symbol)


def claim(who: str) -> None:
    """Make ``who`` the one library serving the names, or RuntimeConflict when another already does."""
    global _owner
    if _owner == who:
        return
    if _owner is None and who == EXECUTORCH and _global_has(PROBE):
        # Made global before zoo was asked (by the caller, or torch loaded with RTLD_GLOBAL): libtorch's.
        _owner = LIBTORCH
    if _owner is not None:
        other = "the ExecuTorch session (zoo_runner, a process of its own)" if who == EXECUTORCH else \
            "a process that has not loaded the in-process ExecuTorch session"
        raise RuntimeConflict(f"this process already serves the aoti_torch_* names from {_owner}; {who} cannot "
                              "serve them too",
                              f"run it in {other}: one process cannot hold both runtimes' shims")
    _owner = who


def release(who: str) -> None:
    """Undo ``claim(who)`` when its library then failed to load (nothing was made global)."""
    global _owner
    if _owner == who:
        _owner = None
