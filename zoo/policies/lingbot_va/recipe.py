"""What a LingBot-VA recipe sets, read and checked: its methods, dtype, static sizes and ``policy_config``.

``unit.options.policy_config`` holds LingBotVAConfig fields. Tiny recipes fabricate their checkpoint from them;
for every recipe ``load_policy`` checks the checkpoint's config.json against them, so a checkpoint for a different
camera layout or size is refused before export. ``inputs.batch / text_len / pool_tokens`` are optional: the static
sizes the recipe expects, checked against the checkpoint.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict

from lerobot.policies.lingbot_va import LingBotVAConfig

from zoo.contract.recipes import Recipe
from zoo.core.errors import RecipeError
from zoo.policies.lingbot_va import vae as vae_stream

FAMILY = "lingbot_va"
POLICY_TYPE = "lingbot_va"  # the "type" key LeRobot writes into config.json for this policy
DIT_METHODS = ("video_step", "action_step")
# The streaming Wan2.2 VAE encode of observed frames (zoo/policies/lingbot_va/vae.py), so the deploy side runs
# no PyTorch model code: both or neither.
VAE_METHODS = (vae_stream.FIRST_METHOD, vae_stream.STEP_METHOD)
# The prompt's cross-attention K/V, once per prompt (zoo/policies/lingbot_va/prompt_kv.py): listed, the DiT steps
# take them in place of text_emb.
PROMPT_METHOD = "prompt_kv"
METHODS = DIT_METHODS + VAE_METHODS + (PROMPT_METHOD,)
UNIT_DTYPES = ("float32", "bfloat16")  # LingBot-VA's own dtype table has no float64
INPUT_KEYS = ("batch", "text_len", "pool_tokens")


def validate_recipe(recipe: Recipe) -> Dict[str, Any]:
    """Check the LingBot-specific parts of a recipe; return its policy_config."""
    methods = list(recipe.unit.methods)
    if not methods or len(set(methods)) != len(methods) or not set(methods) <= set(METHODS):
        raise RecipeError(f"recipe {recipe.name!r}: unit.methods={methods} is not valid for LingBot-VA",
                          f"list each of {', '.join(METHODS)} at most once")
    if len(set(methods) & set(VAE_METHODS)) == 1:
        raise RecipeError(f"recipe {recipe.name!r}: unit.methods lists only one of {list(VAE_METHODS)}",
                          "the streaming VAE encode needs both: the episode's first call and the later ones")
    if PROMPT_METHOD in methods and not set(methods) & set(DIT_METHODS):
        raise RecipeError(f"recipe {recipe.name!r}: unit.methods lists {PROMPT_METHOD} without a DiT step",
                          f"list {PROMPT_METHOD} with video_step and action_step, or leave it out")
    if recipe.unit.dtype not in UNIT_DTYPES:
        raise RecipeError(f"recipe {recipe.name!r}: unit.dtype={recipe.unit.dtype!r} is not supported by LingBot-VA",
                          f"use one of: {', '.join(UNIT_DTYPES)}")
    if recipe.dynamic:
        raise RecipeError(f"recipe {recipe.name!r}: LingBot-VA units have only static shapes, but dynamic "
                          f"dims {sorted(recipe.dynamic)} are set",
                          "remove `dynamic:`; batch, frames, text length and pool size come from the checkpoint")
    unknown = sorted(set(recipe.inputs) - set(INPUT_KEYS))
    if unknown:
        raise RecipeError(f"recipe {recipe.name!r}: unknown inputs key(s) {unknown} for LingBot-VA",
                          f"known keys: {', '.join(INPUT_KEYS)}")
    for key, value in recipe.inputs.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise RecipeError(f"recipe {recipe.name!r}: inputs.{key}={value!r} is not a positive integer",
                              "give the size as a whole number")
    return _policy_config_options(recipe)


def _policy_config_options(recipe: Recipe) -> Dict[str, Any]:
    """unit.options.policy_config, its keys checked against LeRobot's LingBotVAConfig (the schema cannot: it
    is lerobot's class, and recipes load without lerobot)."""
    policy_config = dict(recipe.unit.options.policy_config)
    fields = {f.name for f in dataclasses.fields(LingBotVAConfig)}
    bad = sorted(set(policy_config) - fields)
    if bad:
        raise RecipeError(f"recipe {recipe.name!r}: unit.options.policy_config has unknown field(s) {bad}",
                          "use field names of lerobot's LingBotVAConfig, e.g. num_layers, attn_window, height")
    return policy_config
