"""zoo's graph rewrites, by name. Each lives in its own module and returns a ``RewriteResult``.

They run on the ATen-level ``ExportedProgram`` that ``torch.export`` returns, before any ExecuTorch step.
Modules are imported on first use so that ``import zoo.rewrites`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Callable, Dict, List

from .result import RewriteResult

# name -> module inside zoo.rewrites that defines a function of that name.
_MODULES: Dict[str, str] = {
    "inline_autocast_regions": "autocast_regions",
    "replace_complex_with_real": "complex_to_real",
    "narrow_float64": "narrow_float64",
    "split_float64_constants": "float64_constants",
    "replace_fused_sdpa_with_sdpa": "fused_sdpa",
    "replace_detach_with_alias": "detach",
    "replace_view_copies": "view_copies",
    "make_outputs_safe": "output_safety",
}

# The order the pipeline applies them in: autocast regions are inlined first so that the complex rewrite
# sees the rope ops they hide; float64 is narrowed (float32 pairs) or its constants split (float64 pairs)
# after the complex rewrite has turned complex128 into real pairs; outputs are made safe last, after every
# other rewrite has settled them.
DEFAULT_ORDER: List[str] = list(_MODULES)


def names() -> List[str]:
    return list(_MODULES)


def get(name: str) -> Callable[..., RewriteResult]:
    if name not in _MODULES:
        raise KeyError(f"unknown rewrite {name!r}; known: {', '.join(_MODULES)}")
    module = importlib.import_module(f"{__name__}.{_MODULES[name]}")
    return getattr(module, name)


def __getattr__(name: str):  # zoo.rewrites.replace_complex_with_real(...) works without an explicit import
    if name in _MODULES:
        return get(name)
    raise AttributeError(name)


__all__ = ["RewriteResult", "DEFAULT_ORDER", "names", "get", *_MODULES]
