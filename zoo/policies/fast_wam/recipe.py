"""What a Fast-WAM recipe sets, read and checked: the methods' layout, ``unit.options`` and ``inputs``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from zoo.contract.recipes import Recipe
from zoo.core.errors import RecipeError

FAMILY = "fast_wam"
POLICY_TYPE = "fastwam"  # the "type" key of a Fast-WAM checkpoint's config.json

# One action chunk is a video prefill on the first-frame VAE latent (per-layer video K/V) followed by
# ``num_inference_steps`` Euler steps of the action expert against that K/V (``FastWAM.infer_action``). The
# recipe's ``unit.methods`` choose who runs the Euler loop: the unit, unrolled in-graph (``action_chunk``), or
# the host (``prefill`` plus one ``action_step`` per step).
CHUNK_METHODS = ("action_chunk",)
SPLIT_METHODS = ("prefill", "action_step")
# Optional, listed first: the Wan2.2 VAE encode of the observed first frame, so no PyTorch model code is
# left for the deploy side (zoo.runner); without it the host must run the VAE itself.
VAE_METHOD = "vae_encode"

_INPUT_KEYS = ("context_len",)
_UNIT_DTYPES = ("float32", "bfloat16")


@dataclass
class Options:
    """What a Fast-WAM recipe sets, read and checked: the layout its methods choose, ``unit.options``
    (FastWamOptions, zoo/policies/fast_wam/options.py: keys, types and ranges checked when the recipe loads)
    and ``inputs``."""

    layout: str  # "chunk" (one method, Euler loop unrolled) or "split" (prefill + action_step)
    with_vae: bool  # the unit also has the first-frame VAE encode (VAE_METHOD)
    num_inference_steps: Optional[int]  # None: the checkpoint's config value
    sigma_shift: Optional[float]  # None: the checkpoint's config value (itself None: scheduler infer_shift)
    context_len: Optional[int]  # None: the checkpoint's tokenizer_max_len
    fabricate_config: Dict[str, Any]
    fabricate_stats: Dict[str, Dict[str, Any]]


def parse_options(recipe: Recipe) -> Options:
    """Read and check the recipe's Fast-WAM knobs; a bad one raises ``RecipeError`` naming it."""
    name = recipe.name
    if recipe.family != FAMILY:
        raise RecipeError(f"recipe {name!r} has family {recipe.family!r}, not {FAMILY!r}",
                          f"build it with zoo.policies.{recipe.family}")
    layout, with_vae = _layout(recipe)
    if recipe.unit.dtype not in _UNIT_DTYPES:
        raise RecipeError(f"recipe {name!r}: unit.dtype={recipe.unit.dtype!r} is not supported by Fast-WAM",
                          f"use one of: {', '.join(_UNIT_DTYPES)} (LeRobot builds Fast-WAM only in these)")
    options = recipe.unit.options
    return Options(layout, with_vae, options.num_inference_steps, options.sigma_shift, _context_len(recipe),
                   dict(options.fabricate_config), dict(options.fabricate_stats))


def _layout(recipe: Recipe) -> Tuple[str, bool]:
    """``(layout, with_vae)`` of the recipe's ``unit.methods``."""
    methods = tuple(recipe.unit.methods)
    with_vae = methods[:1] == (VAE_METHOD,)
    if with_vae:
        methods = methods[1:]
    if methods == CHUNK_METHODS:
        return "chunk", with_vae
    if methods == SPLIT_METHODS:
        return "split", with_vae
    raise RecipeError(f"recipe {recipe.name!r}: unit.methods={list(methods)} is not a Fast-WAM layout",
                      f"use {list(CHUNK_METHODS)} (whole chunk, loop unrolled) or {list(SPLIT_METHODS)} "
                      f"(the host runs the Euler loop), optionally preceded by {VAE_METHOD!r} (the "
                      "first-frame VAE encode)")


def _context_len(recipe: Recipe) -> Optional[int]:
    """``inputs.context_len``, the one input size a Fast-WAM recipe may state."""
    inputs = dict(recipe.inputs)
    for key in inputs:
        if key not in _INPUT_KEYS:
            raise RecipeError(f"recipe {recipe.name!r}: unknown Fast-WAM input size inputs.{key}",
                              f"known input sizes: {', '.join(_INPUT_KEYS)}")
    context_len = inputs.get("context_len")
    if context_len is not None and not (
        isinstance(context_len, int) and not isinstance(context_len, bool) and context_len >= 1
    ):
        raise RecipeError(f"recipe {recipe.name!r}: inputs.context_len={context_len!r}",
                          "give the number of UMT5 context tokens (the checkpoint's tokenizer_max_len)")
    return context_len
