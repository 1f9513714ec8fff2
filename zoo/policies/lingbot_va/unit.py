"""LingBot-VA (LeRobot 0.6.1): the export unit is one DiT step per stream over an explicit KV pool.

``video_step`` and ``action_step`` each run LeRobot's own ``WanTransformer3DModel`` once, with the stateful,
data-dependent KV cache replaced by a fixed zero-initialised pool (``zoo/policies/lingbot_va_pool.py``).
The host keeps what LeRobot's ``_infer`` loop does around those calls: slot bookkeeping (``HostSlotAllocator``),
the two flow-matching schedulers, CFG, grid ids, the VAE and the UMT5 text encoder; ``host_settings`` carries
the numbers it needs.

Recipe knobs (unit.options: LingbotVaOptions, zoo/policies/lingbot_va_options.py):
  unit.options.policy_config  LingBotVAConfig fields. Tiny recipes fabricate their checkpoint from them; for
                              every recipe ``build_unit`` checks the checkpoint's config.json against them
                              (except dtype/attn_mode/device, which zoo sets itself), so a checkpoint for a
                              different camera layout or size is refused before export.
  inputs.batch / text_len / pool_tokens
                              optional: the static sizes the recipe expects; checked against the checkpoint.
  lowering.kv_pool            "io" (pool passed in and returned) or "buffer" (pool is a mutable buffer).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Dict, Iterator, List

import torch

from zoo.core.errors import ExportError, PullError, RecipeError
from zoo.contract.recipes import Recipe
from zoo.runner.prompt import PromptEmbedding
from zoo.policies.base import ExportUnit, InputSpec, MethodSpec, feature_record
from zoo.policies.lingbot_va import vae as vae_stream
from zoo.policies.fast_init import built_on_meta
from zoo.policies.lingbot_va.pool import PoolStep, zero_pools
from zoo.policies.tiny_wan import Z_DIM, tiny_wan22_vae

# lerobot is the policies extra: zoo.policies.load_family turns a failed import into an ExportError with a hint.
from lerobot.policies.lingbot_va import LingBotVAConfig, LingBotVAPolicy
from lerobot.policies.lingbot_va.utils import WanTransformer3DModel

FAMILY = "lingbot_va"
POLICY_TYPE = "lingbot_va"  # the "type" key LeRobot writes into config.json for this policy
DIT_METHODS = ("video_step", "action_step")
# The streaming Wan2.2 VAE encode of observed frames (zoo/policies/lingbot_va_vae.py), so the deploy side runs
# no PyTorch model code: both or neither.
VAE_METHODS = (vae_stream.FIRST_METHOD, vae_stream.STEP_METHOD)
METHODS = DIT_METHODS + VAE_METHODS
UNIT_DTYPES = ("float32", "bfloat16")  # LingBot-VA's own dtype table has no float64
# Set by zoo whatever the checkpoint says: export needs plain SDPA ("flex" is training-only and compiles
# itself, "flashattn" is an opaque extension), a CPU build, and the recipe's dtype.
ZOO_SET_FIELDS = ("dtype", "attn_mode", "device")
INPUT_KEYS = ("batch", "text_len", "pool_tokens")
LATENT_CHANNELS = Z_DIM  # Wan2.2 VAE z_dim; LeRobot hard-codes it (modeling_lingbot_va.py:756)
SAFETENSORS = "model.safetensors"


# ----------------------------------------------------------------------------------------------------------
# recipe options


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


def _validate_recipe(recipe: Recipe) -> Dict[str, Any]:
    """Check the LingBot-specific parts of a recipe; return its policy_config."""
    methods = list(recipe.unit.methods)
    if not methods or len(set(methods)) != len(methods) or not set(methods) <= set(METHODS):
        raise RecipeError(f"recipe {recipe.name!r}: unit.methods={methods} is not valid for LingBot-VA",
                          f"list each of {', '.join(METHODS)} at most once")
    if len(set(methods) & set(VAE_METHODS)) == 1:
        raise RecipeError(f"recipe {recipe.name!r}: unit.methods lists only one of {list(VAE_METHODS)}",
                          "the streaming VAE encode needs both: the episode's first call and the later ones")
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


# ----------------------------------------------------------------------------------------------------------
# loading


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
    expected = _validate_recipe(recipe)
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


# ----------------------------------------------------------------------------------------------------------
# the unit


@dataclasses.dataclass
class _Layout:
    """Static sizes of one LingBot-VA checkpoint's export unit."""

    batch: int
    frames: int
    latent_h: int
    latent_w: int
    video_tokens: int
    action_tokens: int
    pool_tokens: int
    text_len: int
    pool: List[int]  # [layers, batch, pool_tokens, heads, head_dim]


def _layout(policy: LingBotVAPolicy) -> _Layout:
    cfg = policy.config
    latent_h, latent_w = policy._latent_hw  # the policy's own rule (width_concat or robotwin_tshape)
    patch = tuple(cfg.patch_size)
    video_tokens = (cfg.frame_chunk_size * latent_h * latent_w) // math.prod(patch)
    action_tokens = cfg.frame_chunk_size * cfg.action_per_frame
    # WanTransformer3DModel.create_empty_cache's size (utils.py:877-899), from _init_streaming_cache's inputs.
    pool_tokens = (cfg.attn_window // 2) * video_tokens + (cfg.attn_window // 2) * action_tokens
    batch = 2 if policy._use_cfg else 1  # CFG runs conditional and unconditional rows together
    return _Layout(batch=batch, frames=cfg.frame_chunk_size, latent_h=latent_h, latent_w=latent_w,
                   video_tokens=video_tokens, action_tokens=action_tokens, pool_tokens=pool_tokens,
                   text_len=cfg.max_sequence_length,
                   pool=[cfg.num_layers, batch, pool_tokens, cfg.num_attention_heads, cfg.attention_head_dim])


def _check_inputs(recipe: Recipe, layout: _Layout, checkpoint_dir: Path) -> None:
    have = {"batch": layout.batch, "text_len": layout.text_len, "pool_tokens": layout.pool_tokens}
    wrong = [f"{k}={v} (the checkpoint gives {have[k]})" for k, v in sorted(recipe.inputs.items()) if have[k] != v]
    if wrong:
        raise PullError(f"checkpoint {checkpoint_dir} does not give the sizes recipe {recipe.name!r} states: "
                        + "; ".join(wrong),
                        "fix the recipe's inputs, or point it at the checkpoint it was written for")


def _method_inputs(method: str, policy: LingBotVAPolicy, layout: _Layout, dtype: str,
                   kv_pool: str) -> List[InputSpec]:
    cfg = policy.config
    b = layout.batch
    if method == "video_step":
        tokens = layout.video_tokens
        latents = InputSpec("noisy_latents", dtype,
                            [b, LATENT_CHANNELS, layout.frames, layout.latent_h, layout.latent_w])
        # get_mesh_id gives int64 (frame, row, column, stream) ids for video tokens (utils.py:82-96); any
        # non-negative position is valid, rope_max_seq_len bounds what an episode reaches.
        grid = InputSpec("grid_id", "int64", [b, 4, tokens], f"randint:0:{cfg.rope_max_seq_len}")
    else:
        tokens = layout.action_tokens
        latents = InputSpec("noisy_latents", dtype, [b, cfg.action_dim, layout.frames, cfg.action_per_frame, 1])
        # Action ids are float32: frame + k/(action_per_frame+1), with row and column -1.
        grid = InputSpec("grid_id", "float32", [b, 4, tokens], f"uniform:-1:{cfg.rope_max_seq_len}")
    specs = [
        latents,
        InputSpec("timesteps", "float32", [b, layout.frames], "uniform:0:1000"),
        grid,
        InputSpec("text_emb", dtype, [b, layout.text_len, cfg.text_dim]),
        InputSpec("slots", "int64", [tokens], f"randperm:{layout.pool_tokens}"),
        InputSpec("visible", "bool", [layout.pool_tokens], "bernoulli:0.5"),
    ]
    if kv_pool == "io":
        specs += [InputSpec("k_pool", dtype, list(layout.pool)), InputSpec("v_pool", dtype, list(layout.pool))]
    return specs


def _host_settings(policy: LingBotVAPolicy, layout: _Layout, recipe: Recipe) -> Dict[str, Any]:
    cfg = policy.config
    kv_pool = recipe.lowering.kv_pool
    return {
        "policy_type": POLICY_TYPE,
        "dtype": recipe.unit.dtype,
        "kv_pool": {
            "layout": kv_pool,
            "shape": list(layout.pool),  # [layers, batch, tokens, heads, head_dim], zero-initialised
            "tokens": layout.pool_tokens,
            "video_slots_per_step": layout.video_tokens,
            "action_slots_per_step": layout.action_tokens,
            "protocol": (
                "Per call, pick `slots` (distinct pool indices, one per new token) and pass `visible` (bool "
                "[tokens]: slots holding K/V of earlier committed steps); the unit writes the step's K/V at `slots` "
                "and attends over visible slots plus its own. update_cache (LeRobot's meaning: 0 denoising step, "
                "1 last denoising step, 2 KV feedback of observed frames/executed actions) is a host decision: "
                "1 or 2 marks `slots` visible for later calls, 0 leaves them invisible. "
                + ("With layout 'io' keep the returned k_pool_next/v_pool_next as the pool for the next call "
                   "(after an update_cache=0 step they differ only in invisible slots, so dropping them is "
                   "equally correct). " if kv_pool == "io" else
                   "With layout 'buffer' each method of the .pte owns its own copy of the pool; video_step's "
                   "writes are not seen by action_step unless the runtime shares the constants. ")
                + "Slot choice and eviction: zoo.runner.slots.HostSlotAllocator mirrors LeRobot."
            ),
        },
        "batch": layout.batch,
        "cfg": {
            "enabled": bool(policy._use_cfg),
            # _repeat_input_for_cfg: row 0 is the prompt, row 1 the empty (negative) prompt; the guided
            # prediction is pred[1] + scale * (pred[0] - pred[1]) when scale > 1, else pred[0].
            "rows": ["prompt", "negative_prompt"] if policy._use_cfg else ["prompt"],
            "video_guidance_scale": cfg.guidance_scale,
            "action_guidance_scale": cfg.action_guidance_scale,
        },
        "video": {
            "num_inference_steps": cfg.num_inference_steps,
            "snr_shift": cfg.snr_shift,
            "exec_step": cfg.video_exec_step,
            "latent_shape": [LATENT_CHANNELS, layout.frames, layout.latent_h, layout.latent_w],
            "patch_size": list(cfg.patch_size),
            "tokens_per_step": layout.video_tokens,
        },
        "action": {
            "num_inference_steps": cfg.action_num_inference_steps,
            "snr_shift": cfg.action_snr_shift,
            "action_dim": cfg.action_dim,
            "used_action_channel_ids": list(cfg.used_action_channel_ids),
            "action_per_frame": cfg.action_per_frame,
            "tokens_per_step": layout.action_tokens,
        },
        "scheduler": _scheduler_settings(policy),
        # _infer (modeling_lingbot_va.py:756-759) draws both per chunk from the global generator, on the
        # policy's device, directly in the model dtype: the video latents first, then the actions.
        "noise": {"generator": "global", "dtype": recipe.unit.dtype,
                  "video_shape": [1, LATENT_CHANNELS, layout.frames, layout.latent_h, layout.latent_w],
                  "action_shape": [1, cfg.action_dim, layout.frames, cfg.action_per_frame, 1]},
        # What LingBotVAPolicy._infer / _prepare_latent_input do around the unit calls (modeling_lingbot_va.py).
        "host_loop": [
            "video: for each t of the schedule plus a final t=0, call video_step with timesteps=t for every "
            "latent frame and grid_id=get_mesh_id(F, h // 2, w // 2, 0, 1, frame_st_id) (patch 1x2x2); the final "
            "call commits (update_cache=1)",
            "first chunk: latent frame 0 is the encoded observation with timestep 0, re-imposed after each update",
            "action: the same with action_step, grid_id=get_mesh_id(F, action_per_frame, 1, 1, 1, frame_st_id, "
            "action=True), channels outside used_action_channel_ids zeroed before each call; on the first chunk "
            "action frame 0 is zeros with timestep 0",
            "next chunk: clear prediction slots, then feed back the observed latents and executed actions with "
            "update_cache=2 (t=0), frame_st_id advancing by frame_chunk_size",
        ],
        "frame_chunk_size": cfg.frame_chunk_size,
        "chunk_size": cfg.chunk_size,
        "attn_window": cfg.attn_window,
        "text": {
            "max_sequence_length": layout.text_len,
            "text_dim": cfg.text_dim,
            "frozen_components": cfg.wan_pretrained_path,  # vae/, text_encoder/ (UMT5), tokenizer/
        },
        # What the policy reads from an observation batch (its config's input_features): the runner's
        # observation keys, and what the policy check draws its synthetic observations from.
        "observation_features": feature_record(cfg.input_features),
        "cameras": {
            "keys": list(cfg.obs_cam_keys),
            "layout": cfg.camera_layout,
            "height": cfg.height,
            "width": cfg.width,
            "image_hflip": cfg.image_hflip,
        },
    }


def _scheduler_settings(policy: LingBotVAPolicy) -> Dict[str, Any]:
    """The flow-matching schedulers LingBotVAPolicy.reset builds (one per stream), read off the objects."""
    video, action = policy._scheduler, policy._action_scheduler
    return {
        "kind": "FlowMatchScheduler (lerobot.policies.lingbot_va.utils)",
        "num_train_timesteps": video.num_train_timesteps,
        "sigma_min": video.sigma_min,
        "sigma_max": video.sigma_max,
        "extra_one_step": video.extra_one_step,
        "video_shift": video.shift,
        "action_shift": action.shift,
        # _infer pads each stream's schedule with one t=0 step; that last call is the one that commits
        # (update_cache=1), and its prediction is not used for an update.
        "append_zero_step": True,
        # The tables _infer steps with (set_timesteps(num_inference_steps) on each scheduler), float32 values:
        # FlowMatchScheduler.step takes sigma[i] and sigma[i + 1] (0 after the last) at argmin |timesteps - t|.
        "video": _scheduler_tables(video, policy.config.num_inference_steps),
        "action": _scheduler_tables(action, policy.config.action_num_inference_steps),
    }


def _scheduler_tables(scheduler: Any, steps: int) -> Dict[str, List[float]]:
    import copy

    scheduler = copy.deepcopy(scheduler)  # the policy's own instance keeps its state
    scheduler.set_timesteps(steps)
    return {"sigmas": [float(x) for x in scheduler.sigmas.tolist()],
            "timesteps": [float(x) for x in scheduler.timesteps.tolist()]}


def _vae_settings(policy: LingBotVAPolicy, methods: Dict[str, MethodSpec]) -> Dict[str, Any]:
    """What the host does around the streaming VAE methods (modeling_lingbot_va.py:526-576)."""
    cfg = policy.config
    return {
        "first_method": vae_stream.FIRST_METHOD,
        "step_method": vae_stream.STEP_METHOD,
        "frames_per_call": vae_stream.FRAMES_PER_CALL,
        "cache": [s.name for s in methods[vae_stream.STEP_METHOD].inputs[1:]],
        # select_action buffers an observation every keyframe_stride executed actions (reset(), :167).
        "keyframe_stride": max(1, cfg.action_per_frame // 4),
        "frames": ("_camera_frame per camera in obs_cam_keys order: float32, hflip if image_hflip, bilinear resize "
                   "(align_corners=False) to height x width, 2 * x - 1, to the model dtype; cameras stacked on the "
                   "batch axis, frames on the time axis"),
    }


def _host_files(checkpoint_dir: Path) -> List[Path]:
    names = ("policy_preprocessor*.json", "policy_preprocessor*.safetensors",
             "policy_postprocessor*.json", "policy_postprocessor*.safetensors")
    files = sorted({p for pattern in names for p in checkpoint_dir.glob(pattern) if p.is_file()})
    return files


class LeRobotSteps:
    """LeRobot's own stateful transformer calls, exactly as ``_infer`` / ``_compute_kv_cache`` make them.

    The reference the unit is judged against: ``steps(method, noisy_latents, timesteps, grid_id, text_emb,
    update_cache)`` runs ``policy.transformer`` with its own KV cache (created on first use the way
    ``_init_streaming_cache`` does), and ``clear_predictions()`` is ``clear_pred_cache``.
    """

    cache_name = "pos"  # the name LingBotVAPolicy uses

    def __init__(self, policy: LingBotVAPolicy):
        self.policy = policy
        policy.reset()
        policy._init_streaming_cache(None)

    @torch.no_grad()
    def __call__(self, method: str, noisy_latents: torch.Tensor, timesteps: torch.Tensor, grid_id: torch.Tensor,
                 text_emb: torch.Tensor, update_cache: int) -> torch.Tensor:
        inputs = {"noisy_latents": noisy_latents, "timesteps": timesteps, "grid_id": grid_id, "text_emb": text_emb}
        return self.policy.transformer(inputs, update_cache=update_cache, cache_name=self.cache_name,
                                       action_mode=(method == "action_step"))

    def clear_predictions(self) -> None:
        self.policy.transformer.clear_pred_cache(self.cache_name)

    def cache(self, layer: int) -> Dict[str, torch.Tensor]:
        return self.policy.transformer.blocks[layer].attn1.attn_caches[self.cache_name]


def check_recipe(recipe: Recipe) -> None:
    """What the pipeline asks before fabricating or downloading anything: can this recipe be built?"""
    _validate_recipe(recipe)


def _vae_methods(policy: LingBotVAPolicy, dtype: str) -> Dict[str, MethodSpec]:
    """``vae_encode_first`` and ``vae_encode``: the streaming VAE LeRobot loads from ``wan_pretrained_path``."""
    from lerobot.policies.lingbot_va.utils import load_vae

    cfg = policy.config
    if cfg.camera_layout != "width_concat":
        raise ExportError(f"the streaming VAE methods support camera_layout 'width_concat', this checkpoint has "
                          f"{cfg.camera_layout!r} (two VAEs, half-resolution wrists)",
                          "export without vae_encode_first/vae_encode; zoo.runner refuses this layout for now")
    try:
        vae = load_vae(cfg.wan_pretrained_path, torch_dtype=policy.dtype, torch_device="cpu", subfolder="vae").eval()
    except OSError as exc:
        raise PullError(f"LingBot-VA's VAE cannot be loaded from {cfg.wan_pretrained_path!r}: {exc}",
                        "make the repo reachable (online, or in the Hub cache when offline)") from None
    cams = len(cfg.obs_cam_keys)
    conv, shapes = vae_stream.cache_layout(vae, [cams, 3, 1, cfg.height, cfg.width], policy.dtype)
    cache = [InputSpec(f"vae_cache_{i}", dtype, shape) for i, shape in enumerate(shapes)]
    latent_h, latent_w = policy._latent_hw
    frames = [cams, 3, None, cfg.height, cfg.width]
    outputs = ["latent"] + [c.name for c in cache]
    first, step = vae_stream.FIRST_METHOD, vae_stream.STEP_METHOD
    return {
        first: MethodSpec(first, vae_stream.StreamingVaeEncode(vae, True, conv).eval(),
                          [InputSpec("frames", dtype, frames[:2] + [1] + frames[3:], "uniform:-1:1")], outputs),
        step: MethodSpec(step, vae_stream.StreamingVaeEncode(vae, False, conv).eval(),
                         [InputSpec("frames", dtype, frames[:2] + [vae_stream.FRAMES_PER_CALL] + frames[3:],
                                    "uniform:-1:1")] + cache, outputs),
    }


def build_unit(checkpoint_dir: Path, recipe: Recipe) -> ExportUnit:
    checkpoint_dir = Path(checkpoint_dir)
    policy = load_policy(checkpoint_dir, recipe)
    layout = _layout(policy)
    _check_inputs(recipe, layout, checkpoint_dir)
    dtype = recipe.unit.dtype
    kv_pool = recipe.lowering.kv_pool
    shared = zero_pools(layout.pool, getattr(torch, dtype)) if kv_pool == "buffer" else None
    vae = _vae_methods(policy, dtype) if set(VAE_METHODS) & set(recipe.unit.methods) else {}
    methods: Dict[str, MethodSpec] = {}
    for name in recipe.unit.methods:
        if name in vae:
            methods[name] = vae[name]
            continue
        module = PoolStep(policy.transformer, action_mode=(name == "action_step"), kv_pool=kv_pool,
                          shared_pools=shared).eval()
        pred = "noise_pred" if name == "video_step" else "action_noise_pred"
        outputs = [pred, "k_pool_next", "v_pool_next"] if kv_pool == "io" else [pred]
        methods[name] = MethodSpec(name=name, module=module,
                                   inputs=_method_inputs(name, policy, layout, dtype, kv_pool),
                                   output_names=outputs)
    settings = _host_settings(policy, layout, recipe)
    if vae:
        settings["vae"] = _vae_settings(policy, vae)
    return ExportUnit(family=FAMILY, methods=methods, host_settings=settings,
                      host_files=_host_files(checkpoint_dir), reference=lambda: LeRobotSteps(policy))


# ----------------------------------------------------------------------------------------------------------
# the deploy side's counterparts (zoo.runner): LeRobot's whole policy, and prompt embeddings


def lerobot_policy(checkpoint_dir: Path, recipe: Recipe, device: str = "cpu"):
    """LeRobot's own policy as a control loop builds it: ``(policy, preprocessor, postprocessor)`` on
    ``device``, with its VAE, UMT5 and tokenizer loaded now. LeRobot loads them lazily on the first call; up
    front, an episode's use of the global generator is the noise alone, whatever a loader might draw."""
    from lerobot.policies.factory import make_pre_post_processors

    policy = load_policy(checkpoint_dir, recipe)
    policy.config.device = device
    policy.to(device)
    policy._ensure_frozen_modules()
    pre, post = make_pre_post_processors(policy.config, pretrained_path=str(checkpoint_dir),
                                         preprocessor_overrides={"device_processor": {"device": device}})
    return policy, pre, post


@contextlib.contextmanager
def float32_reference_noise(low_dtype: torch.dtype) -> Iterator[None]:
    """While LeRobot's float32 policy runs the reference episode for a ``low_dtype`` unit, draw its noise as the
    ``low_dtype`` policy does: each ``torch.randn`` asking for float32 (or the float32 default dtype) draws in
    ``low_dtype`` from the same generator and returns that draw upcast to float32 (exact).

    Why: LeRobot's LingBot-VA draws its latent and action noise in the policy's dtype
    (modeling_lingbot_va.py:756-758, ``torch.randn(..., dtype=self.dtype)``), and torch's bf16 and float32
    normal draws from one seed are different numbers (cosine ~0.03 for 100 values), consuming the generator
    differently too. Without this, the float32 reference samples from other noise, and the bf16 rule measures
    a different sample rather than precision. (Fast-WAM draws in float32 and casts, so it needs no hook.)
    ``torch.randn`` is restored on exit, also on error."""
    original = torch.randn

    def randn(*size, dtype=None, **kwargs):
        wants_float32 = (dtype or torch.get_default_dtype()) == torch.float32
        if not wants_float32 or kwargs.get("out") is not None:
            return original(*size, dtype=dtype, **kwargs)
        return original(*size, dtype=low_dtype, **kwargs).to(torch.float32)

    torch.randn = randn
    try:
        yield
    finally:
        torch.randn = original


def embed_prompt(policy: LingBotVAPolicy, task: str):
    """What ``python -m zoo prompt`` writes for LingBot-VA: LeRobot's own ``_encode_prompt`` of the task
    (UMT5, padded to max_sequence_length) and, when the policy runs CFG, of the empty negative prompt."""
    policy._ensure_frozen_modules()
    with torch.no_grad():
        prompt, negative = policy._encode_prompt(task or "")
    tensors = {"prompt_embeds": prompt}
    if negative is not None:
        tensors["negative_prompt_embeds"] = negative
    return PromptEmbedding(task, POLICY_TYPE, tensors)


# ----------------------------------------------------------------------------------------------------------
# fabricated checkpoints (tiny recipes)


def _fabricated_config(recipe: Recipe, policy_config: Dict[str, Any]) -> LingBotVAConfig:
    from lerobot.configs.types import FeatureType, PolicyFeature

    kwargs: Dict[str, Any] = {}
    defaults = {f.name: f.default for f in dataclasses.fields(LingBotVAConfig)}
    for key, value in policy_config.items():
        # YAML has no tuples; draccus-typed tuple fields (patch_size, betas) need them back.
        kwargs[key] = tuple(value) if isinstance(defaults.get(key), tuple) else value
    kwargs.setdefault("dtype", recipe.unit.dtype)
    kwargs["device"] = "cpu"
    config = LingBotVAConfig(**kwargs)
    # LingBot-VA needs a VISUAL feature per camera; the policy validates them when it is built.
    config.input_features = {key: PolicyFeature(type=FeatureType.VISUAL, shape=(3, config.height, config.width))
                             for key in config.obs_cam_keys}
    return config


def _save_policy_repo(config: LingBotVAConfig, seed: int, repo_dir: Path) -> None:
    from lerobot.policies.lingbot_va import make_lingbot_va_pre_post_processors

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        policy = LingBotVAPolicy(config)
    policy.save_pretrained(repo_dir)
    g = torch.Generator().manual_seed(seed + 1)
    n_used = len(config.used_action_channel_ids)
    q01 = -1.0 - torch.rand(n_used, generator=g)
    stats = {"action": {"q01": q01, "q99": q01 + 0.5 + 2.0 * torch.rand(n_used, generator=g)}}
    pre, post = make_lingbot_va_pre_post_processors(config, dataset_stats=stats)
    pre.save_pretrained(repo_dir)
    post.save_pretrained(repo_dir)


def _save_frozen_repo(config: LingBotVAConfig, seed: int, repo_dir: Path) -> None:
    """Tiny stand-ins for ``wan_pretrained_path``'s vae/, text_encoder/, tokenizer/ (diffusers layout).

    LeRobot loads them lazily on the first select_action, by Hub id, with diffusers/transformers' own loaders,
    so they must exist under the real id for an offline run of the policy's full inference path.
    """
    from transformers import T5TokenizerFast, UMT5Config, UMT5EncoderModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 2)
        vae = tiny_wan22_vae()  # the latent arithmetic LeRobot assumes: height // 16, 4 frames, 48 channels
        # UMT5's width is the DiT's text_dim: its last_hidden_state feeds the text projection.
        encoder = UMT5EncoderModel(UMT5Config(vocab_size=64, d_model=config.text_dim, d_kv=16, d_ff=64,
                                              num_layers=1, num_heads=2, relative_attention_num_buckets=8))
    vae.save_pretrained(repo_dir / "vae")
    encoder.save_pretrained(repo_dir / "text_encoder")
    # transformers 5 rebuilds T5's Unigram model from (piece, score) pairs; ids stay below vocab_size 64.
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -3.0 - 0.01 * i) for i, c in enumerate("abcdefghijklmnopqrstuvwxyz")]
    pieces += [("\u2581" + w, -2.5) for w in ("pick", "place", "put", "the", "bowl", "plate", "on", "in")]
    T5TokenizerFast(vocab=pieces, extra_ids=0).save_pretrained(repo_dir / "tokenizer")


def fabricate_checkpoint(recipe: Recipe, work_dir: Path) -> Dict[str, Path]:
    """Seeded random LingBot-VA checkpoint at the recipe's size, in LeRobot's real repo layout.

    Returns {repo_id: folder} for the recipe's repo and for ``wan_pretrained_path`` (VAE, UMT5, tokenizer),
    which LeRobot loads by Hub id.
    """
    policy_config = _validate_recipe(recipe)
    config = _fabricated_config(recipe, policy_config)
    work_dir = Path(work_dir)
    repos: Dict[str, Path] = {}
    policy_dir = work_dir / recipe.source.repo_id.replace("/", "--")
    _save_policy_repo(config, recipe.source.seed, policy_dir)
    repos[recipe.source.repo_id] = policy_dir
    if not Path(config.wan_pretrained_path).exists():  # a local folder is the user's own; a Hub id needs a stand-in
        frozen_dir = work_dir / config.wan_pretrained_path.replace("/", "--")
        _save_frozen_repo(config, recipe.source.seed, frozen_dir)
        repos[config.wan_pretrained_path] = frozen_dir
    return repos

