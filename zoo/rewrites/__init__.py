"""zoo's graph rewrites, by name. Each lives in its own module, registers itself there with
``@registry.rewrite(NAME)`` and returns a ``RewriteResult``.

They run on the ATen-level ``ExportedProgram`` that ``torch.export`` returns, before any ExecuTorch step.
``zoo.rewrites.<name>`` is the rewrite function of that name (``narrow_float64`` included, whose module has the
same name; import its helpers as ``from zoo.rewrites.narrow_float64 import ...``).
"""

from __future__ import annotations

from typing import Any, Callable, List, Tuple

from zoo.core.errors import RecipeError
from zoo.rewrites import registry
from zoo.rewrites.autocast_regions import inline_autocast_regions
from zoo.rewrites.complex_to_real import replace_complex_with_real
from zoo.rewrites.detach import replace_detach_with_alias
from zoo.rewrites.float64_constants import split_float64_constants
from zoo.rewrites.fused_sdpa import replace_fused_sdpa_with_sdpa
from zoo.rewrites.narrow_float64 import narrow_float64
from zoo.rewrites.output_safety import make_outputs_safe
from zoo.rewrites.result import RewriteResult
from zoo.rewrites.split_kv_attention import replace_sdpa_with_split_kv_attention
from zoo.rewrites.view_copies import replace_view_copies
from zoo.rewrites.triton_unsafe_sdpa import replace_triton_unsafe_sdpa_with_math

# The order the pipeline applies them in, whatever order a recipe lists them in: autocast regions are inlined
# first so that the complex rewrite sees the rope ops they hide; float64 is narrowed (float32 pairs) or its
# constants split (float64 pairs) after the complex rewrite has turned complex128 into real pairs; outputs are
# made safe last, after every other rewrite has settled them. SDPA nodes become zoo's split-KV attention (opt-in)
# after the fused kernels have become SDPA nodes, and before attention that executorch's Triton SDPA gets wrong is
# written out, so that the kernel takes every attention it computes and the write-out only what is left. Every
# registered rewrite appears once (tests/rewrites/test_contract.py checks it).
DEFAULT_ORDER: Tuple[str, ...] = (
    "inline_autocast_regions",
    "replace_complex_with_real",
    "narrow_float64",
    "split_float64_constants",
    "replace_fused_sdpa_with_sdpa",
    "replace_sdpa_with_split_kv_attention",
    "replace_triton_unsafe_sdpa_with_math",
    "replace_detach_with_alias",
    "replace_view_copies",
    "make_outputs_safe",
)


def names() -> List[str]:
    """Every rewrite a recipe may name, in the order the pipeline applies them."""
    return list(DEFAULT_ORDER)


def get(name: str) -> Callable[..., RewriteResult]:
    """The rewrite function ``name``, to call with a program (and its own keyword arguments)."""
    return registry.registration(name).function


def rewrites_for(recipe: Any) -> List[Tuple[str, Callable[[Any], RewriteResult]]]:
    """``[(name, rewrite)]`` for the rewrites ``recipe.rewrites`` names, in ``DEFAULT_ORDER``; each ``rewrite``
    takes the program alone, the recipe's values already bound to the arguments its registration names
    (``replace_complex_with_real`` gets ``complex128_as=recipe.rotary_pairs``)."""
    unknown = [name for name in recipe.rewrites if name not in DEFAULT_ORDER]
    if unknown:
        raise RecipeError(f"unknown rewrite(s) {unknown}", f"use one of: {', '.join(DEFAULT_ORDER)}")
    return [(name, registry.registration(name).bound(recipe)) for name in DEFAULT_ORDER if name in recipe.rewrites]


__all__ = ["RewriteResult", "DEFAULT_ORDER", "names", "get", "rewrites_for", *DEFAULT_ORDER]
