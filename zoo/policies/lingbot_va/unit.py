"""LingBot-VA (LeRobot 0.6.1): the family's entry points and ``build_unit``, one DiT step per stream over an
explicit KV pool (``pool.py``) plus the streaming VAE encode (``vae.py``).

The host keeps what LeRobot's ``_infer`` loop does around those calls: slot bookkeeping (``HostSlotAllocator``),
the two flow-matching schedulers, CFG, grid ids and the UMT5 text encoder; ``host_settings`` carries the numbers
it needs.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from zoo.contract.host_settings import (ActionStream, Cameras, Guidance, KvPool, LingBotNoise, LingBotVAHostSettings,
                                        ScheduleTables, Scheduler, StreamingVae, TextEncoder, VideoStream)
from zoo.contract.recipes import Recipe
from zoo.core.errors import ExportError, PullError
from zoo.policies.base import ExportUnit, InputSpec, MethodSpec, feature_record
from zoo.policies.lingbot_va import vae as vae_stream
from zoo.policies.lingbot_va.checkpoint import fabricate_checkpoint, fabricated_config, save_frozen_repo
from zoo.policies.lingbot_va.loading import load_policy
from zoo.policies.lingbot_va.pool import PoolStep, PromptFreePoolStep, zero_pools
from zoo.policies.lingbot_va.prompt_kv import PromptKv
from zoo.policies.lingbot_va.recipe import DIT_METHODS, FAMILY, PROMPT_METHOD, VAE_METHODS, validate_recipe
from zoo.policies.lingbot_va.reference import LeRobotSteps, embed_prompt, float32_reference_noise, lerobot_policy
from zoo.policies.tiny_wan import Z_DIM

# lerobot is the policies extra: zoo.policies.load_family turns a failed import into an ExportError with a hint.
from lerobot.policies.lingbot_va import LingBotVAPolicy

# The family contract (zoo/policies/__init__.py), the policy check's noise hook, and what the real-size scripts
# call on the family module (benchmarks/bench_chunk.py, bench_real_size.py).
__all__ = ["build_unit", "check_recipe", "fabricate_checkpoint", "lerobot_policy", "embed_prompt",
           "float32_reference_noise", "load_policy", "DIT_METHODS"]
_validate_recipe = validate_recipe
_fabricated_config = fabricated_config
_save_frozen_repo = save_frozen_repo

LATENT_CHANNELS = Z_DIM  # Wan2.2 VAE z_dim; LeRobot hard-codes it (modeling_lingbot_va.py:756)


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


def _prompt_kv_specs(policy: LingBotVAPolicy, layout: _Layout, dtype: str) -> List[InputSpec]:
    """``text_k`` and ``text_v``: every block's cross-attention K (normed) and V of the prompt, heads split."""
    cfg = policy.config
    shape = [cfg.num_layers, layout.batch, layout.text_len, cfg.num_attention_heads, cfg.attention_head_dim]
    return [InputSpec("text_k", dtype, shape), InputSpec("text_v", dtype, shape)]


def _method_inputs(method: str, policy: LingBotVAPolicy, layout: _Layout, dtype: str,
                   kv_pool: str, prompt_kv: bool = False) -> List[InputSpec]:
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
        *(_prompt_kv_specs(policy, layout, dtype) if prompt_kv else [_text_emb_spec(policy, layout, dtype)]),
        InputSpec("slots", "int64", [tokens], f"randperm:{layout.pool_tokens}"),
        InputSpec("visible", "bool", [layout.pool_tokens], "bernoulli:0.5"),
    ]
    if kv_pool == "io":
        specs += [InputSpec("k_pool", dtype, list(layout.pool)), InputSpec("v_pool", dtype, list(layout.pool))]
    return specs


def _text_emb_spec(policy: LingBotVAPolicy, layout: _Layout, dtype: str) -> InputSpec:
    return InputSpec("text_emb", dtype, [layout.batch, layout.text_len, policy.config.text_dim])


def _host_settings(policy: LingBotVAPolicy, layout: _Layout, recipe: Recipe,
                   vae: Optional[StreamingVae]) -> LingBotVAHostSettings:
    """What zoo.runner's LingBot-VA loop needs (docs/host-loops.md describes the loop)."""
    cfg = policy.config
    return LingBotVAHostSettings(
        dtype=recipe.unit.dtype,
        kv_pool=KvPool(layout=recipe.lowering.kv_pool, shape=list(layout.pool), tokens=layout.pool_tokens,
                       video_slots_per_step=layout.video_tokens, action_slots_per_step=layout.action_tokens),
        batch=layout.batch,
        # _repeat_input_for_cfg: row 0 is the prompt, row 1 the empty (negative) prompt; the guided
        # prediction is pred[1] + scale * (pred[0] - pred[1]) when scale > 1, else pred[0].
        cfg=Guidance(enabled=bool(policy._use_cfg),
                     rows=["prompt", "negative_prompt"] if policy._use_cfg else ["prompt"],
                     video_guidance_scale=cfg.guidance_scale, action_guidance_scale=cfg.action_guidance_scale),
        video=VideoStream(num_inference_steps=cfg.num_inference_steps, snr_shift=cfg.snr_shift,
                          exec_step=cfg.video_exec_step,
                          latent_shape=[LATENT_CHANNELS, layout.frames, layout.latent_h, layout.latent_w],
                          patch_size=list(cfg.patch_size), tokens_per_step=layout.video_tokens),
        action=ActionStream(num_inference_steps=cfg.action_num_inference_steps, snr_shift=cfg.action_snr_shift,
                            action_dim=cfg.action_dim, used_action_channel_ids=list(cfg.used_action_channel_ids),
                            action_per_frame=cfg.action_per_frame, tokens_per_step=layout.action_tokens),
        scheduler=_scheduler_settings(policy),
        # _infer (modeling_lingbot_va.py:756-759) draws both per chunk from the global generator, on the
        # policy's device, directly in the model dtype: the video latents first, then the actions.
        noise=LingBotNoise(generator="global", dtype=recipe.unit.dtype,
                           video_shape=[1, LATENT_CHANNELS, layout.frames, layout.latent_h, layout.latent_w],
                           action_shape=[1, cfg.action_dim, layout.frames, cfg.action_per_frame, 1]),
        frame_chunk_size=cfg.frame_chunk_size,
        chunk_size=cfg.chunk_size,
        attn_window=cfg.attn_window,
        text=TextEncoder(max_sequence_length=layout.text_len, text_dim=cfg.text_dim,
                         frozen_components=cfg.wan_pretrained_path),
        # What the policy reads from an observation batch (its config's input_features): the runner's
        # observation keys, and what the policy check draws its synthetic observations from.
        observation_features=feature_record(cfg.input_features),
        cameras=Cameras(keys=list(cfg.obs_cam_keys), layout=cfg.camera_layout, height=cfg.height, width=cfg.width,
                        image_hflip=cfg.image_hflip),
        vae=vae,
        prompt_method=PROMPT_METHOD if PROMPT_METHOD in recipe.unit.methods else None,
    )


def _scheduler_settings(policy: LingBotVAPolicy) -> Scheduler:
    """The flow-matching schedulers LingBotVAPolicy.reset builds (one per stream, LeRobot's FlowMatchScheduler),
    read off the objects."""
    video, action = policy._scheduler, policy._action_scheduler
    return Scheduler(
        num_train_timesteps=video.num_train_timesteps, sigma_min=video.sigma_min, sigma_max=video.sigma_max,
        extra_one_step=video.extra_one_step, video_shift=video.shift, action_shift=action.shift,
        # _infer pads each stream's schedule with one t=0 step; that last call is the one that commits
        # (update_cache=1), and its prediction is not used for an update.
        append_zero_step=True,
        # The tables _infer steps with (set_timesteps(num_inference_steps) on each scheduler), float32 values:
        # FlowMatchScheduler.step takes sigma[i] and sigma[i + 1] (0 after the last) at argmin |timesteps - t|.
        video=_scheduler_tables(video, policy.config.num_inference_steps),
        action=_scheduler_tables(action, policy.config.action_num_inference_steps),
    )


def _scheduler_tables(scheduler: Any, steps: int) -> ScheduleTables:
    import copy

    scheduler = copy.deepcopy(scheduler)  # the policy's own instance keeps its state
    scheduler.set_timesteps(steps)
    return ScheduleTables(sigmas=[float(x) for x in scheduler.sigmas.tolist()],
                          timesteps=[float(x) for x in scheduler.timesteps.tolist()])


def _vae_settings(policy: LingBotVAPolicy, methods: Dict[str, MethodSpec]) -> StreamingVae:
    """What the host does around the streaming VAE methods (modeling_lingbot_va.py:526-576)."""
    return StreamingVae(
        first_method=vae_stream.FIRST_METHOD, step_method=vae_stream.STEP_METHOD,
        frames_per_call=vae_stream.FRAMES_PER_CALL,
        cache=[s.name for s in methods[vae_stream.STEP_METHOD].inputs[1:]],
        # select_action buffers an observation every keyframe_stride executed actions (reset(), :167).
        keyframe_stride=max(1, policy.config.action_per_frame // 4),
    )


def _host_files(checkpoint_dir: Path) -> List[Path]:
    names = ("policy_preprocessor*.json", "policy_preprocessor*.safetensors",
             "policy_postprocessor*.json", "policy_postprocessor*.safetensors")
    files = sorted({p for pattern in names for p in checkpoint_dir.glob(pattern) if p.is_file()})
    return files


def check_recipe(recipe: Recipe) -> None:
    """What the pipeline asks before fabricating or downloading anything: can this recipe be built?"""
    validate_recipe(recipe)


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
    """Load the checkpoint with LeRobot's classes and cut out the recipe's methods: each DiT step over the KV
    pool, and the streaming VAE encode when the recipe lists it."""
    checkpoint_dir = Path(checkpoint_dir)
    policy = load_policy(checkpoint_dir, recipe)
    layout = _layout(policy)
    _check_inputs(recipe, layout, checkpoint_dir)
    dtype = recipe.unit.dtype
    kv_pool = recipe.lowering.kv_pool  # "io": the pool passed in and returned; "buffer": a mutable buffer
    shared = zero_pools(layout.pool, getattr(torch, dtype)) if kv_pool == "buffer" else None
    vae = _vae_methods(policy, dtype) if set(VAE_METHODS) & set(recipe.unit.methods) else {}
    prompt_kv = PROMPT_METHOD in recipe.unit.methods
    step = PromptFreePoolStep if prompt_kv else PoolStep
    methods: Dict[str, MethodSpec] = {}
    for name in recipe.unit.methods:
        if name in vae:
            methods[name] = vae[name]
            continue
        if name == PROMPT_METHOD:
            methods[name] = MethodSpec(name=name, module=PromptKv(policy.transformer).eval(),
                                       inputs=[_text_emb_spec(policy, layout, dtype)],
                                       output_names=["text_k", "text_v"])
            continue
        module = step(policy.transformer, action_mode=(name == "action_step"), kv_pool=kv_pool,
                      shared_pools=shared).eval()
        pred = "noise_pred" if name == "video_step" else "action_noise_pred"
        outputs = [pred, "k_pool_next", "v_pool_next"] if kv_pool == "io" else [pred]
        methods[name] = MethodSpec(name=name, module=module,
                                   inputs=_method_inputs(name, policy, layout, dtype, kv_pool, prompt_kv),
                                   output_names=outputs)
    settings = _host_settings(policy, layout, recipe, _vae_settings(policy, vae) if vae else None)
    return ExportUnit(family=FAMILY, methods=methods, host_settings=settings,
                      host_files=_host_files(checkpoint_dir), reference=lambda: LeRobotSteps(policy), policy=policy)
