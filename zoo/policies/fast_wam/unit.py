"""Fast-WAM (LeRobot 0.6.1 policy type ``fastwam``): the family's entry points and ``build_unit``, which cuts a
checkpoint's GPU work into the recipe's methods (``steps``) and records what the host needs to drive them.

Fast-WAM is a mixture of a Wan2.2 video expert and an action expert; the unit reuses LeRobot's own model code
and replaces only what blocks ``torch.export`` (see ``zoo.policies.fast_wam.steps``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from lerobot.policies.fastwam.configuration_fastwam import FastWAMConfig
from lerobot.policies.fastwam.wan import WanVideoVAE38
from lerobot.policies.fastwam.wan.components import WAN22_DIFFUSERS_MODEL_ID

from zoo.contract.host_settings import FastWAMHostSettings, FastWAMNoise, ImageResize
from zoo.contract.recipes import Recipe
from zoo.core.errors import ExportError, PullError
from zoo.policies.base import ExportUnit, InputSpec, MethodSpec, feature_record
from zoo.policies.fast_wam.checkpoint import fabricate_checkpoint, write_tokenizer, write_wan_components
from zoo.policies.fast_wam.loading import load_policy
from zoo.policies.fast_wam.recipe import FAMILY, VAE_METHOD, Options, parse_options
from zoo.policies.fast_wam.reference import InferActionReference, embed_prompt, lerobot_policy
from zoo.policies.fast_wam.steps import (FastWAMActionChunk, FastWAMActionStep, FastWAMPrefill, FastWAMUnitBase,
                                         FastWAMVaeEncode)

# The family contract (zoo/policies/__init__.py) and what the real-size scripts call on the family module
# (benchmarks/bench_chunk.py builds its stand-in Wan2.2 repos from the fabrication's own pieces).
__all__ = ["build_unit", "check_recipe", "fabricate_checkpoint", "lerobot_policy", "embed_prompt", "load_policy",
           "parse_options", "WAN22_DIFFUSERS_MODEL_ID"]
_write_tokenizer = write_tokenizer
_write_wan_components = write_wan_components

# Files the deploy side needs besides the .pte: LeRobot's normalisation processors (MEAN_STD stats for the
# state it feeds as proprio and for the actions the unit returns normalised).
_PROCESSOR_GLOB = "policy_*processor*"


def check_recipe(recipe: Recipe) -> None:
    """What the pipeline asks before fabricating or downloading anything: can this recipe be built?"""
    parse_options(recipe)


@dataclass(frozen=True)
class _Sizes:
    """The static sizes one checkpoint's methods run at, and the schedule the recipe asks for."""

    dtype: str
    image: Tuple[int, int]
    latent_shape: List[int]
    grid: Tuple[int, int, int]
    steps: int
    shift: Optional[float]
    context_len: int
    text_dim: int
    horizon: int
    action_dim: int
    proprio_dim: int
    num_layers: int
    attn_dim: int


def build_unit(checkpoint_dir: Path, recipe: Recipe) -> ExportUnit:
    """Load the checkpoint with LeRobot's classes and cut out the GPU part as the recipe's methods."""
    opts = parse_options(recipe)
    checkpoint_dir = Path(checkpoint_dir)
    policy = load_policy(checkpoint_dir, recipe.unit.dtype)
    config: FastWAMConfig = policy.config
    fw = policy.model
    host_files = _checked_model(fw, checkpoint_dir)
    sizes = _sizes(fw, config, opts, recipe.unit.dtype)
    methods = _methods(fw, opts, sizes)
    dit_method = next(m.module for m in methods.values() if isinstance(m.module, FastWAMUnitBase))
    return ExportUnit(
        family=FAMILY,
        methods=methods,
        host_settings=_host_settings(fw, config, opts, sizes, dit_method),
        host_files=host_files,
        reference=InferActionReference(fw, sizes.horizon, sizes.steps, sizes.shift, sizes.image, sizes.latent_shape),
        policy=policy,
    )


def _checked_model(fw: nn.Module, checkpoint_dir: Path) -> List[Path]:
    """Refuse a model LeRobot's ``infer_action`` (so the unit) cannot run; return its processor files."""
    if fw.proprio_encoder is None:
        raise ExportError("this Fast-WAM checkpoint has proprio_dim=None (no proprio token)",
                          "the Fast-WAM unit takes proprio as an input; export a checkpoint trained with proprio")
    if str(fw.video_expert.video_attention_mask_mode) != "first_frame_causal":
        raise ExportError(f"Fast-WAM video_attention_mask_mode is {fw.video_expert.video_attention_mask_mode!r}",
                          "LeRobot's infer_action (and so this unit) needs 'first_frame_causal'")
    host_files = sorted(p for p in checkpoint_dir.glob(_PROCESSOR_GLOB) if p.is_file())
    if not host_files:
        raise PullError(f"{checkpoint_dir} has no normalisation processor files ({_PROCESSOR_GLOB})",
                        "the unit's proprio input and action output are normalised; use a checkpoint that ships "
                        "policy_preprocessor.json / policy_postprocessor.json with their .safetensors stats")
    return host_files


def _sizes(fw: nn.Module, config: FastWAMConfig, opts: Options, dtype: str) -> _Sizes:
    image_h, image_w = (int(s) for s in config.image_size)
    up = WanVideoVAE38.upsampling_factor
    if image_h % up or image_w % up:
        raise ExportError(f"Fast-WAM image_size {config.image_size} is not a multiple of the VAE's {up}x",
                          "this checkpoint's config cannot run infer_action")
    latent_shape = [1, WanVideoVAE38.z_dim, 1, image_h // up, image_w // up]
    patch = [int(p) for p in fw.video_expert.patch_size]
    if any(s % p for s, p in zip(latent_shape[2:], patch)):
        raise ExportError(f"Fast-WAM latent grid {latent_shape[2:]} is not divisible by the patch size {patch}",
                          "this checkpoint's image_size and patch_size do not fit together")
    return _Sizes(
        dtype=dtype,
        image=(image_h, image_w),
        latent_shape=latent_shape,
        grid=tuple(s // p for s, p in zip(latent_shape[2:], patch)),
        steps=opts.num_inference_steps or int(config.num_inference_steps),
        shift=opts.sigma_shift if opts.sigma_shift is not None else config.sigma_shift,
        context_len=opts.context_len or int(config.tokenizer_max_len),
        text_dim=int(fw.text_dim),
        horizon=int(config.action_horizon),
        action_dim=int(config.action_dim),
        proprio_dim=int(config.proprio_dim),
        num_layers=int(fw.mot.num_layers),
        attn_dim=int(fw.mot.num_heads) * int(fw.mot.attn_head_dim),
    )


def _methods(fw: nn.Module, opts: Options, s: _Sizes) -> Dict[str, MethodSpec]:
    """The recipe's methods: the optional first-frame VAE encode, then the chunk or the split layout."""
    dtype, args = s.dtype, (fw, s.grid, s.horizon, s.steps, s.shift)
    latents = InputSpec("first_frame_latents", "float32", s.latent_shape, "normal")
    context = InputSpec("context", dtype, [1, s.context_len, s.text_dim], "normal")
    # encode_prompt always returns an all-true mask; verification draws sparse holes too (the proprio token
    # keeps every row attending to something).
    context_mask = InputSpec("context_mask", "bool", [1, s.context_len], "bernoulli:0.9")
    proprio = InputSpec("proprio", dtype, [1, s.proprio_dim], "normal")
    methods: Dict[str, MethodSpec] = {}
    if opts.with_vae:
        methods[VAE_METHOD] = MethodSpec(
            VAE_METHOD, FastWAMVaeEncode(fw).eval(),
            [InputSpec("image", dtype, [1, 3, *s.image], "uniform:0:1")], ["first_frame_latents"],
        )
    if opts.layout == "chunk":
        methods["action_chunk"] = MethodSpec(
            "action_chunk", FastWAMActionChunk(*args).eval(),
            [latents, context, context_mask, proprio, InputSpec("noise", dtype, [1, s.horizon, s.action_dim])],
            ["actions"],
        )
        return methods
    # video K leaves LeRobot's rope in float32 whatever the model dtype; V keeps the model dtype.
    video_tokens = s.grid[0] * s.grid[1] * s.grid[2]
    video_k = InputSpec("video_k", "float32", [s.num_layers, 1, video_tokens, s.attn_dim])
    video_v = InputSpec("video_v", dtype, [s.num_layers, 1, video_tokens, s.attn_dim])
    methods["prefill"] = MethodSpec(
        "prefill", FastWAMPrefill(*args).eval(), [latents, context, context_mask, proprio], ["video_k", "video_v"],
    )
    methods["action_step"] = MethodSpec(
        "action_step", FastWAMActionStep(*args).eval(),
        [
            InputSpec("noisy_actions", dtype, [1, s.horizon, s.action_dim]),
            InputSpec("timestep", dtype, [1], "uniform:0:1000"),
            InputSpec("delta", dtype, [1], "uniform:-0.5:0"),
            context, context_mask, proprio, video_k, video_v,
        ],
        ["actions"],
    )
    return methods


def _host_settings(fw: nn.Module, config: FastWAMConfig, opts: Options, s: _Sizes,
                   dit_method: FastWAMUnitBase) -> FastWAMHostSettings:
    """host_settings.json: what the deploy side needs to drive the methods, and what they have baked in
    (docs/host-loops.md describes the loop)."""
    timesteps, deltas = dit_method.schedule(getattr(torch, s.dtype))
    return FastWAMHostSettings(
        layout=opts.layout,
        num_inference_steps=s.steps,
        sigma_shift=s.shift,
        effective_sigma_shift=float(s.shift if s.shift is not None else fw.infer_action_scheduler.shift),
        # What the host feeds action_step, in order (split layout), and what action_chunk has baked in.
        timesteps=[float(t) for t in timesteps.tolist()],
        deltas=[float(d) for d in deltas.tolist()],
        action_horizon=s.horizon,
        n_action_steps=int(config.n_action_steps),
        action_dim=s.action_dim,
        proprio_dim=s.proprio_dim,
        image_size=list(s.image),
        # What the policy reads from an observation batch (its config's input_features): the runner's
        # observation keys, and what the policy check draws its synthetic observations from.
        observation_features=feature_record(config.input_features),
        image_features={k: list(v.shape) for k, v in sorted(config.image_features.items())},
        # The model's own input resize (modeling_fastwam._resize_frames), applied when a camera is not at size.
        image_resize=ImageResize(mode="bilinear", align_corners=False, antialias=True),
        vae_method=VAE_METHOD if opts.with_vae else None,
        first_frame_latent_shape=s.latent_shape,
        video_grid=list(s.grid),
        context_len=s.context_len,
        text_dim=s.text_dim,
        prompt_template=config.prompt_template,
        tokenizer_model_id=config.tokenizer_model_id,
        tokenizer_max_len=int(config.tokenizer_max_len),
        text_encoder_model_id=config.text_encoder_model_id,
        vae_model_id=WAN22_DIFFUSERS_MODEL_ID,
        noise=FastWAMNoise(shape=[1, s.horizon, s.action_dim], dtype="float32", generator_device=config.rand_device,
                           seed=config.inference_seed, cast_to=s.dtype),
        normalization_mapping={k: getattr(v, "value", str(v)) for k, v in config.normalization_mapping.items()},
        toggle_action_dimensions=list(config.toggle_action_dimensions),
    )
