"""Loading a LingBot-VA checkpoint with LeRobot's own classes, its config checked against the recipe's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict

from lerobot.policies.lingbot_va import LingBotVAConfig, LingBotVAPolicy
from lerobot.policies.lingbot_va.utils import WanTransformer3DModel

from zoo.contract.recipes import Recipe
from zoo.core.errors import PullError
from zoo.policies.fast_init import built_on_meta
from zoo.policies.lingbot_va.recipe import POLICY_TYPE, validate_recipe

SAFETENSORS = "model.safetensors"
# Set by zoo whatever the checkpoint says: export needs plain SDPA ("flex" is training-only and compiles
# itself, "flashattn" is an opaque extension), a CPU build, and the recipe's dtype.
ZOO_SET_FIELDS = ("dtype", "attn_mode", "device")


def _read_config_json(checkpoint_dir: Path) -> Dict[str, Any]:
    path = checkpoint_dir / "config.json"
    if not path.is_file():
        raise PullError(f"{checkpoint_dir} has no config.json, so it is not a LeRobot policy checkpoint",
                        "point the recipe's source at a LeRobot LingBot-VA repo, e.g. lerobot/lingbot_va_libero_long")
    try:
        raw = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise PullError(f"{path} is not valid JSON: {exc}", "re-download the checkpoint") from None
    if not isinstance(raw, dict):
        raise PullError(f"{path} does not hold a JSON object", "re-download the checkpoint")
    kind = raw.get("type")
    if kind != POLICY_TYPE:
        raise PullError(f"{checkpoint_dir} holds a {kind!r} policy (config.json \"type\"), not LingBot-VA "
                        f"({POLICY_TYPE!r})",
                        "use a recipe of that policy's family, or point this recipe at a LingBot-VA checkpoint")
    return raw


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _check_policy_config(config: LingBotVAConfig, expected: Dict[str, Any], checkpoint_dir: Path,
                         recipe: Recipe) -> None:
    wrong = [f"{key}={getattr(config, key)!r} (recipe expects {value!r})"
             for key, value in sorted(expected.items())
             if key not in ZOO_SET_FIELDS and not _same(getattr(config, key), value)]
    if wrong:
        raise PullError(f"checkpoint {checkpoint_dir} does not match recipe {recipe.name!r}: " + "; ".join(wrong),
                        "point the recipe at the checkpoint it was written for, or write a recipe for this one "
                        "(unit.options.policy_config)")


def load_policy(checkpoint_dir: Path, recipe: Recipe) -> LingBotVAPolicy:
    """LeRobot's own ``LingBotVAPolicy.from_pretrained(strict=True)``, with attn_mode/dtype/device set by zoo."""
    checkpoint_dir = Path(checkpoint_dir)
    expected = validate_recipe(recipe)
    _read_config_json(checkpoint_dir)
    if not (checkpoint_dir / SAFETENSORS).is_file():
        raise PullError(f"{checkpoint_dir} has no {SAFETENSORS}",
                        "LeRobot policies load one unsharded model.safetensors; re-download the checkpoint")
    from lerobot.configs.policies import PreTrainedConfig

    try:
        config = PreTrainedConfig.from_pretrained(checkpoint_dir)
    except Exception as exc:  # draccus raises a zoo of types for ill-typed fields; all mean the same here
        raise PullError(f"{checkpoint_dir}/config.json is not a valid LingBot-VA config: {exc}",
                        "re-download the checkpoint, or fix the field named above") from None
    config.attn_mode = "torch"
    config.dtype = recipe.unit.dtype
    config.device = "cpu"  # export runs on the CPU; lowering moves the program to the GPU itself
    _check_policy_config(config, expected, checkpoint_dir, recipe)
    try:
        # The policy builds the transformer, casts it whole to config.dtype (modeling_lingbot_va.py:95, as
        # LeRobot's inference does), then loads the file; strict=True turns missing/unexpected keys into errors.
        # The transformer's parameters are built on meta and take the file's tensors by assignment: no random
        # initialisation of 5 B values that the file overwrites (zoo.policies.fast_init).
        with built_on_meta(LingBotVAPolicy, [WanTransformer3DModel]):
            policy = LingBotVAPolicy.from_pretrained(checkpoint_dir, config=config, strict=True)
    except Exception as exc:  # safetensors' own error type, RuntimeError for key/shape mismatch, OSError
        raise PullError(f"the weights in {checkpoint_dir / SAFETENSORS} do not load into LingBot-VA "
                        f"({config.num_layers} layers, {config.num_attention_heads} heads): {_short(exc)}",
                        "the file is incomplete, corrupt or for another model size; re-download the checkpoint "
                        "(missing, unexpected or mis-shaped tensors are named above)") from None
    return policy.eval()


def _short(exc: BaseException, limit: int = 600) -> str:
    """torch's load_state_dict message on one line (it names the missing and mis-shaped keys), capped."""
    text = " ".join(part.strip() for part in str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
