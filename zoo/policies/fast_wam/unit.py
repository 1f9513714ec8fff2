"""Fast-WAM (LeRobot 0.6.1 policy type ``fastwam``): the export unit, and tiny checkpoints in the real layout.

Fast-WAM is a mixture of a Wan2.2 video expert and an action expert. One action chunk is a video prefill on
the first-frame VAE latent (per-layer video K/V) followed by ``num_inference_steps`` Euler steps of the
action expert against that K/V (``FastWAM.infer_action``). The unit reuses LeRobot's own model code and
replaces only what blocks ``torch.export``:

* the video rope reads its grid with ``grid_sizes.tolist()`` (unbacked SymInts, export fails): the unit hands
  LeRobot's own ``rope_apply`` a grid object whose ``.tolist()`` returns static ints from the config;
* the noise is drawn with an in-graph RNG: the host draws it (same generator and seed as LeRobot) and passes
  it in, since RNG kernels would be ATen fallbacks the ExecuTorch CUDA backend refuses;
* the Python Euler loop is unrolled in-graph (``action_chunk``), or left to the host (``prefill`` plus
  ``action_step``), chosen by the recipe's ``unit.methods``.

The UMT5 text encoder stays outside the unit (a prompt is embedded once, on a workstation). The Wan2.2 VAE
encode of the first frame is the optional method ``vae_encode`` (listed first in ``unit.methods``); without it
the host encodes the frame itself.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from safetensors import SafetensorError
from torch import nn

from lerobot.configs import PreTrainedConfig
from lerobot.policies.fastwam.configuration_fastwam import FastWAMConfig
from lerobot.policies.fastwam.modeling_fastwam import FastWAMPolicy
from lerobot.policies.fastwam.processor_fastwam import make_fastwam_pre_post_processors
from lerobot.policies.fastwam.wan import ActionDiT, WanVideoDiT, WanVideoVAE38
from lerobot.policies.fastwam.wan.components import WAN22_DIFFUSERS_MODEL_ID

from zoo.core.errors import ExportError, PullError, RecipeError
from zoo.export.hub_cache import hub_environment, put_in_cache
from zoo.contract.recipes import Recipe
from zoo.runner.prompt import PromptEmbedding
from zoo.policies.base import ExportUnit, InputSpec, MethodSpec, feature_record
from zoo.policies.fast_init import built_on_meta
from zoo.policies.tiny_wan import tiny_wan22_vae

FAMILY = "fast_wam"
POLICY_TYPE = "fastwam"  # the "type" key of a Fast-WAM checkpoint's config.json

CHUNK_METHODS = ("action_chunk",)
SPLIT_METHODS = ("prefill", "action_step")
# Optional, listed first: the Wan2.2 VAE encode of the observed first frame, so no PyTorch model code is
# left for the deploy side (zoo.runner); without it the host must run the VAE itself.
VAE_METHOD = "vae_encode"

_INPUT_KEYS = ("context_len",)
_UNIT_DTYPES = ("float32", "bfloat16")

# Files the deploy side needs besides the .pte: LeRobot's normalisation processors (MEAN_STD stats for the
# state it feeds as proprio and for the actions the unit returns normalised).
_PROCESSOR_GLOB = "policy_*processor*"

_TINY_WORDS = (
    "a video recorded from robot's point of view executing the following instruction: pick up put place "
    "open close the bowl plate drawer cabinet on in of and to black white red top left right"
).split()


# --------------------------------------------------------------------------------------------------------
# Recipe knobs


@dataclass
class Options:
    """What a Fast-WAM recipe sets, read and checked: the layout its methods choose, ``unit.options``
    (FastWamOptions, zoo/policies/fast_wam_options.py: keys, types and ranges checked when the recipe loads)
    and ``inputs``."""

    layout: str  # "chunk" (one method, Euler loop unrolled) or "split" (prefill + action_step)
    with_vae: bool  # the unit also has the first-frame VAE encode (VAE_METHOD)
    num_inference_steps: Optional[int]  # None: the checkpoint's config value
    sigma_shift: Optional[float]  # None: the checkpoint's config value (itself None: scheduler infer_shift)
    context_len: Optional[int]  # None: the checkpoint's tokenizer_max_len
    fabricate_config: Dict[str, Any]


def parse_options(recipe: Recipe) -> Options:
    """Read and check the recipe's Fast-WAM knobs; a bad one raises ``RecipeError`` naming it."""
    name = recipe.name
    if recipe.family != FAMILY:
        raise RecipeError(f"recipe {name!r} has family {recipe.family!r}, not {FAMILY!r}",
                          f"build it with zoo.policies.{recipe.family}")
    methods = tuple(recipe.unit.methods)
    with_vae = methods[:1] == (VAE_METHOD,)
    if with_vae:
        methods = methods[1:]
    if methods == CHUNK_METHODS:
        layout = "chunk"
    elif methods == SPLIT_METHODS:
        layout = "split"
    else:
        raise RecipeError(f"recipe {name!r}: unit.methods={list(methods)} is not a Fast-WAM layout",
                          f"use {list(CHUNK_METHODS)} (whole chunk, loop unrolled) or {list(SPLIT_METHODS)} "
                          f"(the host runs the Euler loop), optionally preceded by {VAE_METHOD!r} (the "
                          "first-frame VAE encode)")
    if recipe.unit.dtype not in _UNIT_DTYPES:
        raise RecipeError(f"recipe {name!r}: unit.dtype={recipe.unit.dtype!r} is not supported by Fast-WAM",
                          f"use one of: {', '.join(_UNIT_DTYPES)} (LeRobot builds Fast-WAM only in these)")
    options = recipe.unit.options
    inputs = dict(recipe.inputs)
    for key in inputs:
        if key not in _INPUT_KEYS:
            raise RecipeError(f"recipe {name!r}: unknown Fast-WAM input size inputs.{key}",
                              f"known input sizes: {', '.join(_INPUT_KEYS)}")
    context_len = inputs.get("context_len")
    if context_len is not None and not (
        isinstance(context_len, int) and not isinstance(context_len, bool) and context_len >= 1
    ):
        raise RecipeError(f"recipe {name!r}: inputs.context_len={context_len!r}",
                          "give the number of UMT5 context tokens (the checkpoint's tokenizer_max_len)")
    return Options(layout, with_vae, options.num_inference_steps, options.sigma_shift, context_len,
                   dict(options.fabricate_config))


# --------------------------------------------------------------------------------------------------------
# The export unit


class _StaticGrid:
    """Stands in for the ``grid_sizes`` tensor that ``WanVideoDiT.pre_dit`` hands LeRobot's ``rope_apply``.

    ``rope_apply`` only calls ``grid_sizes.tolist()``; on a tensor that yields data-dependent SymInts under
    ``torch.export`` (GuardOnDataDependentSymNode). Returning the static grid instead keeps LeRobot's own
    rope code (and its autocast region) while nothing global is patched.
    """

    def __init__(self, grid: Sequence[int], batch: int):
        self._rows = [[int(g) for g in grid] for _ in range(batch)]

    def tolist(self) -> List[List[int]]:
        return [list(row) for row in self._rows]


class _FastWAMUnitBase(nn.Module):
    """Shared state of the unit's methods: LeRobot's ``FastWAM`` core and the static sizes it runs at.

    Only the trainable parts (``mot``: both experts; ``proprio_encoder``) are registered, so moving or
    exporting the unit never touches the frozen VAE and UMT5 that ``FastWAM`` keeps beside them.
    """

    def __init__(self, fw: nn.Module, grid: Tuple[int, int, int], action_horizon: int,
                 num_inference_steps: int, sigma_shift: Optional[float]):
        super().__init__()
        self.mot = fw.mot
        self.proprio_encoder = fw.proprio_encoder
        object.__setattr__(self, "fw", fw)  # unregistered: its VAE/UMT5 are not part of the unit
        self.grid = tuple(int(g) for g in grid)
        self.video_seq_len = self.grid[0] * self.grid[1] * self.grid[2]
        self.tokens_per_frame = self.grid[1] * self.grid[2]
        self.action_horizon = int(action_horizon)
        self.num_inference_steps = int(num_inference_steps)
        self.sigma_shift = sigma_shift
        # LeRobot's schedule comes from numpy in float64 and is cast to float32 before anything else; keep
        # those float32 values as Python floats so the graph holds no float64 constant (ExecuTorch's CUDA
        # runtime cannot load one) and a cast to the model dtype happens in-graph exactly as in eager.
        timesteps, deltas = fw.infer_action_scheduler.build_inference_schedule(
            num_inference_steps=self.num_inference_steps, device=torch.device("cpu"), dtype=torch.float32,
            shift_override=sigma_shift,
        )
        self._timesteps_f32 = [float(t) for t in timesteps.tolist()]
        self._deltas_f32 = [float(d) for d in deltas.tolist()]

    def _apply(self, fn, *args, **kwargs):
        # FastWAM reads its device from the plain attribute ``fw.device`` (not from its parameters), e.g.
        # to place the proprio token: keep it on the parameters' device after .to()/.cuda()/.cpu().
        super()._apply(fn, *args, **kwargs)
        self.fw.device = next(self.mot.parameters()).device
        return self

    def _check_latents(self, first_frame_latents: torch.Tensor) -> None:
        patch = self.fw.video_expert.patch_size
        f, h, w = (int(s) // int(p) for s, p in zip(first_frame_latents.shape[2:], patch))
        if (f, h, w) != self.grid:
            raise ExportError(
                f"Fast-WAM first_frame_latents of shape {tuple(first_frame_latents.shape)} make the video grid "
                f"{(f, h, w)}, but the unit was built for {self.grid}",
                "feed latents of the shape in io_spec.json (the checkpoint's image_size / 16)",
            )

    def _context(self, context, context_mask, proprio):
        # LeRobot appends the encoded proprio as one extra context token (always attended).
        return self.fw._append_proprio_to_context(context=context, context_mask=context_mask, proprio=proprio)

    def _attention_mask(self, device) -> torch.Tensor:
        return self.fw._build_mot_attention_mask(
            video_seq_len=self.video_seq_len,
            action_seq_len=self.action_horizon,
            video_tokens_per_frame=self.tokens_per_frame,
            device=device,
        )

    def _prefill(self, first_frame_latents, context, context_mask):
        """``infer_action``'s video prefill: per-layer video K/V of the first frame (t = 0)."""
        fw = self.fw
        self._check_latents(first_frame_latents)
        timestep_video = torch.zeros(
            (first_frame_latents.shape[0],), dtype=first_frame_latents.dtype, device=first_frame_latents.device
        )
        video_pre = fw.video_expert.pre_dit(
            x=first_frame_latents,
            timestep=timestep_video,
            context=context,
            context_mask=context_mask,
            action=None,
            fuse_vae_embedding_in_latents=bool(getattr(fw.video_expert, "fuse_vae_embedding_in_latents", False)),
        )
        video_pre["freqs"]["grid_sizes"] = _StaticGrid(self.grid, int(video_pre["tokens"].shape[0]))
        attention_mask = self._attention_mask(video_pre["tokens"].device)
        kv_cache = fw.mot.prefill_video_cache(
            video_tokens=video_pre["tokens"],
            video_freqs=video_pre["freqs"],
            video_t_mod=video_pre["t_mod"],
            video_context_payload={"context": video_pre["context"], "mask": video_pre["context_mask"]},
            video_attention_mask=attention_mask[: self.video_seq_len, : self.video_seq_len],
        )
        return kv_cache, attention_mask

    def _action_velocity(self, latents, timestep, context, context_mask, kv_cache, attention_mask):
        return self.fw._predict_action_noise_with_cache(
            latents_action=latents,
            timestep_action=timestep,
            context=context,
            context_mask=context_mask,
            video_kv_cache=kv_cache,
            attention_mask=attention_mask,
            video_seq_len=self.video_seq_len,
        )

    def schedule(self, dtype: torch.dtype, device=None) -> Tuple[torch.Tensor, torch.Tensor]:
        """LeRobot's inference schedule (timesteps, Euler deltas) at the unit's steps and shift, in ``dtype``.

        Equal to ``build_inference_schedule(..., dtype=dtype)``: float32 values cast to ``dtype``.
        """
        timesteps = torch.tensor(self._timesteps_f32, dtype=torch.float32, device=device)
        deltas = torch.tensor(self._deltas_f32, dtype=torch.float32, device=device)
        return timesteps.to(dtype), deltas.to(dtype)


class FastWAMVaeEncode(nn.Module):
    """``vae_encode``: LeRobot's own first-frame encode (``FastWAM._encode_input_image_latents_tensor``).

    Pixels in [0, 1] at the policy's image size, in the unit's dtype, as ``infer_action`` hands them over; out
    come the normalised float32 latents ``(mu - latents_mean) / latents_std`` that ``prefill`` takes. diffusers'
    encode of a single frame runs the causal encoder with an empty feature cache, so nothing is carried from
    one call to the next.
    """

    def __init__(self, fw: nn.Module):
        super().__init__()
        self.vae = fw.vae
        object.__setattr__(self, "fw", fw)  # unregistered: only the VAE belongs to this method

    def forward(self, image):
        return self.fw._encode_input_image_latents_tensor(image)


class FastWAMActionChunk(_FastWAMUnitBase):
    """``action_chunk``: video prefill plus the whole Euler loop, unrolled; returns the normalised chunk."""

    def forward(self, first_frame_latents, context, context_mask, proprio, noise):
        fw = self.fw
        context, context_mask = self._context(context, context_mask, proprio)
        kv_cache, attention_mask = self._prefill(first_frame_latents, context, context_mask)
        latents = noise
        timesteps, deltas = self.schedule(latents.dtype, latents.device)
        for step_t, step_delta in zip(timesteps, deltas):
            timestep = step_t.unsqueeze(0).to(dtype=latents.dtype, device=latents.device)
            velocity = self._action_velocity(latents, timestep, context, context_mask, kv_cache, attention_mask)
            latents = fw.infer_action_scheduler.step(velocity, step_delta, latents)
        # predict_action_chunk's contract: [B, horizon, action_dim] in float32, still normalised.
        return latents.to(torch.float32)


class FastWAMPrefill(_FastWAMUnitBase):
    """``prefill``: the video expert once per chunk; returns every layer's video K and V, stacked."""

    def forward(self, first_frame_latents, context, context_mask, proprio):
        context, context_mask = self._context(context, context_mask, proprio)
        kv_cache, _ = self._prefill(first_frame_latents, context, context_mask)
        return torch.stack([layer["k"] for layer in kv_cache]), torch.stack([layer["v"] for layer in kv_cache])


class FastWAMActionStep(_FastWAMUnitBase):
    """``action_step``: one Euler step of the action expert against the prefilled video K/V."""

    def forward(self, noisy_actions, timestep, delta, context, context_mask, proprio, video_k, video_v):
        fw = self.fw
        context, context_mask = self._context(context, context_mask, proprio)
        kv_cache = [{"k": video_k[i], "v": video_v[i]} for i in range(video_k.shape[0])]
        attention_mask = self._attention_mask(noisy_actions.device)
        velocity = self._action_velocity(noisy_actions, timestep, context, context_mask, kv_cache, attention_mask)
        return fw.infer_action_scheduler.step(velocity, delta, noisy_actions)


# --------------------------------------------------------------------------------------------------------
# Loading a checkpoint


def _read_policy_type(checkpoint_dir: Path) -> str:
    config_file = checkpoint_dir / "config.json"
    if not config_file.is_file():
        raise PullError(f"{checkpoint_dir} has no config.json, so it is not a LeRobot policy checkpoint",
                        "point the recipe's source at a LeRobot Fast-WAM checkpoint (config.json + model.safetensors)")
    try:
        policy_type = json.loads(config_file.read_text()).get("type")
    except (ValueError, AttributeError) as exc:
        raise PullError(f"{config_file} is not a JSON object: {exc}",
                        "re-download the checkpoint (a partial download leaves a truncated file)") from None
    if policy_type != POLICY_TYPE:
        raise PullError(f"{checkpoint_dir} holds a {policy_type!r} policy, not Fast-WAM ({POLICY_TYPE!r})",
                        "use a Fast-WAM checkpoint (e.g. ZibinDong/fastwam_libero_uncond_2cam224) or pick the "
                        "recipe family that matches this checkpoint")
    return policy_type


def load_policy(checkpoint_dir: Path, dtype: str) -> FastWAMPolicy:
    """LeRobot's own ``FastWAMPolicy.from_pretrained(strict=True)`` on CPU at ``dtype``, without the UMT5.

    Any failure to load becomes a ``PullError`` saying what was wrong.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise PullError(f"Fast-WAM checkpoint folder {checkpoint_dir} does not exist",
                        "pull the checkpoint first (python -m zoo.export pulls it) or fix source.local_dir")
    _read_policy_type(checkpoint_dir)
    try:
        config = PreTrainedConfig.from_pretrained(checkpoint_dir)
    except Exception as exc:  # draccus/JSON errors of many types: all mean an unreadable config
        raise PullError(f"{checkpoint_dir}/config.json is not a valid Fast-WAM config: {exc}",
                        "re-download the checkpoint; a config from another LeRobot version may need "
                        "converting") from None
    if not isinstance(config, FastWAMConfig):
        raise PullError(f"{checkpoint_dir}/config.json parsed as {type(config).__name__}, not FastWAMConfig",
                        "use a Fast-WAM checkpoint")
    config.device = "cpu"  # zoo exports on the CPU; the GPU verification moves the unit itself
    config.torch_dtype = dtype
    # The unit takes the UMT5 context as an input; loading UMT5-XXL (5.7 B parameters) would be waste.
    config.load_text_encoder = False
    if not (checkpoint_dir / "model.safetensors").is_file():
        raise PullError(f"{checkpoint_dir} has no model.safetensors",
                        "LeRobot policies load one unsharded model.safetensors; re-download the checkpoint")
    try:
        # The experts' parameters are built on meta and take the file's tensors by assignment: LeRobot's
        # constructor would initialise the Wan backbone's blocks twice (WanModel, then WanVideoDiT) in float32
        # before the file overwrites them (zoo.policies.fast_init). The VAE, loaded by diffusers inside the
        # constructor, is built as before.
        with built_on_meta(FastWAMPolicy, [WanVideoDiT, ActionDiT]):
            policy = FastWAMPolicy.from_pretrained(checkpoint_dir, config=config, strict=True)
    except SafetensorError as exc:
        raise PullError(f"{checkpoint_dir}/model.safetensors is not a readable safetensors file: {exc}",
                        "the file is truncated or corrupt: re-download the checkpoint") from None
    except OSError as exc:
        raise PullError(
            f"Fast-WAM could not load its frozen parts or weights: {exc}",
            f"the policy loads the Wan2.2 VAE from {WAN22_DIFFUSERS_MODEL_ID!r} and the tokenizer from "
            f"{config.tokenizer_model_id!r} by Hub id: make them reachable (online, or in the Hub cache when "
            "offline)",
        ) from None
    except Exception as exc:  # load_state_dict and the Fast-WAM loader: missing, unexpected, mis-shaped tensors
        raise PullError(f"Fast-WAM weights in {checkpoint_dir}/model.safetensors do not fit the config: "
                        f"{_first_lines(exc)}",
                        "the checkpoint is incomplete or corrupt, or config.json does not match its weights: "
                        "re-download it") from None
    policy.eval()
    if dtype == "bfloat16":
        # LeRobot computes the video time embedding inside torch.amp.autocast("cuda", dtype=float32): on
        # CUDA that runs these two layers in float32 (bf16 weights widened exactly). Autocast is off on the
        # CPU (eager bf16 fails there) and gone after export, so hold them in float32 explicitly.
        video = policy.model.video_expert
        video.time_embedding.float()
        video.time_projection.float()
    return policy


def _first_lines(exc: BaseException, n: int = 3) -> str:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    text = " ".join(lines[:n])
    return text if len(text) < 600 else text[:600] + " ..."


# --------------------------------------------------------------------------------------------------------
# build_unit


def check_recipe(recipe: Recipe) -> None:
    """What the pipeline asks before fabricating or downloading anything: can this recipe be built?"""
    parse_options(recipe)


def build_unit(checkpoint_dir: Path, recipe: Recipe) -> ExportUnit:
    """Load the checkpoint with LeRobot's classes and cut out the GPU part as the recipe's methods."""
    opts = parse_options(recipe)
    checkpoint_dir = Path(checkpoint_dir)
    policy = load_policy(checkpoint_dir, recipe.unit.dtype)
    config: FastWAMConfig = policy.config
    fw = policy.model
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

    dtype = recipe.unit.dtype
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
    grid = tuple(s // p for s, p in zip(latent_shape[2:], patch))
    steps = opts.num_inference_steps or int(config.num_inference_steps)
    shift = opts.sigma_shift if opts.sigma_shift is not None else config.sigma_shift
    context_len = opts.context_len or int(config.tokenizer_max_len)
    text_dim = int(fw.text_dim)
    horizon = int(config.action_horizon)
    action_dim = int(config.action_dim)
    proprio_dim = int(config.proprio_dim)
    num_layers = int(fw.mot.num_layers)
    attn_dim = int(fw.mot.num_heads) * int(fw.mot.attn_head_dim)
    args = (fw, grid, horizon, steps, shift)

    latents = InputSpec("first_frame_latents", "float32", latent_shape, "normal")
    context = InputSpec("context", dtype, [1, context_len, text_dim], "normal")
    # encode_prompt always returns an all-true mask; verification draws sparse holes too (the proprio token
    # keeps every row attending to something).
    context_mask = InputSpec("context_mask", "bool", [1, context_len], "bernoulli:0.9")
    proprio = InputSpec("proprio", dtype, [1, proprio_dim], "normal")
    methods: Dict[str, MethodSpec] = {}
    if opts.with_vae:
        methods[VAE_METHOD] = MethodSpec(
            VAE_METHOD, FastWAMVaeEncode(fw).eval(),
            [InputSpec("image", dtype, [1, 3, image_h, image_w], "uniform:0:1")], ["first_frame_latents"],
        )
    if opts.layout == "chunk":
        methods["action_chunk"] = MethodSpec(
            "action_chunk", FastWAMActionChunk(*args).eval(),
            [latents, context, context_mask, proprio, InputSpec("noise", dtype, [1, horizon, action_dim])],
            ["actions"],
        )
    else:
        # video K leaves LeRobot's rope in float32 whatever the model dtype; V keeps the model dtype.
        video_k = InputSpec("video_k", "float32", [num_layers, 1, grid[0] * grid[1] * grid[2], attn_dim])
        video_v = InputSpec("video_v", dtype, [num_layers, 1, grid[0] * grid[1] * grid[2], attn_dim])
        methods["prefill"] = MethodSpec(
            "prefill", FastWAMPrefill(*args).eval(), [latents, context, context_mask, proprio],
            ["video_k", "video_v"],
        )
        methods["action_step"] = MethodSpec(
            "action_step", FastWAMActionStep(*args).eval(),
            [
                InputSpec("noisy_actions", dtype, [1, horizon, action_dim]),
                InputSpec("timestep", dtype, [1], "uniform:0:1000"),
                InputSpec("delta", dtype, [1], "uniform:-0.5:0"),
                context, context_mask, proprio, video_k, video_v,
            ],
            ["actions"],
        )
    dit_method = next(m.module for m in methods.values() if isinstance(m.module, _FastWAMUnitBase))
    timesteps, deltas = dit_method.schedule(getattr(torch, dtype))
    host_settings = {
        "policy_type": POLICY_TYPE,
        "layout": opts.layout,
        "num_inference_steps": steps,
        "sigma_shift": shift,
        "effective_sigma_shift": float(shift if shift is not None else fw.infer_action_scheduler.shift),
        # What the host feeds action_step, in order (split layout), and what action_chunk has baked in.
        "timesteps": [float(t) for t in timesteps.tolist()],
        "deltas": [float(d) for d in deltas.tolist()],
        "action_horizon": horizon,
        "n_action_steps": int(config.n_action_steps),
        "action_dim": action_dim,
        "proprio_dim": proprio_dim,
        "image_size": [image_h, image_w],
        # What the policy reads from an observation batch (its config's input_features): the runner's
        # observation keys, and what the policy check draws its synthetic observations from.
        "observation_features": feature_record(config.input_features),
        "image_features": {k: list(v.shape) for k, v in sorted(config.image_features.items())},
        "image_layout": "cameras resized and concatenated on width in sorted key order, pixels in [0, 1]; "
                        "the VAE input is 2 * image - 1",
        # The model's own input resize (modeling_fastwam._resize_frames), applied when a camera is not at size.
        "image_resize": {"mode": "bilinear", "align_corners": False, "antialias": True},
        "vae_method": VAE_METHOD if opts.with_vae else None,
        "first_frame_latent_shape": latent_shape,
        "video_grid": list(grid),
        "context_len": context_len,
        "text_dim": text_dim,
        "prompt_template": config.prompt_template,
        "tokenizer_model_id": config.tokenizer_model_id,
        "tokenizer_max_len": int(config.tokenizer_max_len),
        "text_encoder_model_id": config.text_encoder_model_id,
        "vae_model_id": WAN22_DIFFUSERS_MODEL_ID,
        "noise": {"shape": [1, horizon, action_dim], "dtype": "float32", "generator_device": config.rand_device,
                  "seed": config.inference_seed, "cast_to": dtype},
        "normalization_mapping": {k: getattr(v, "value", str(v)) for k, v in config.normalization_mapping.items()},
        "toggle_action_dimensions": list(config.toggle_action_dimensions),
        "outputs": "normalised actions [1, horizon, action_dim]; unnormalise with the postprocessor",
    }
    return ExportUnit(
        family=FAMILY,
        methods=methods,
        host_settings=host_settings,
        host_files=host_files,
        reference=make_reference(fw, horizon, steps, shift, (image_h, image_w), latent_shape),
    )


_UNSET = object()


@contextlib.contextmanager
def _substituted(obj: Any, **attrs: Any) -> Iterator[None]:
    """Set instance attributes on ``obj`` for the block, then put back exactly what was there before."""
    saved = {name: obj.__dict__.get(name, _UNSET) for name in attrs}
    try:
        for name, value in attrs.items():
            setattr(obj, name, value)
        yield
    finally:
        for name, value in saved.items():
            if value is _UNSET:
                delattr(obj, name)
            else:
                setattr(obj, name, value)


class _GivenSchedule:
    """An ``infer_action_scheduler`` whose schedule is one given (timestep, delta); steps are LeRobot's."""

    def __init__(self, scheduler: Any, timestep: torch.Tensor, delta: torch.Tensor):
        self._scheduler, self._timestep, self._delta = scheduler, timestep, delta

    def build_inference_schedule(self, **_: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        return self._timestep.reshape(1), self._delta.reshape(1)

    def step(self, *args: Any) -> torch.Tensor:
        return self._scheduler.step(*args)


def make_reference(fw: nn.Module, horizon: int, steps: int, sigma_shift: Optional[float],
                   image_size: Tuple[int, int], latent_shape: Sequence[int]) -> Callable[..., Tuple[torch.Tensor, ...]]:
    """``reference(method, *inputs) -> outputs``: LeRobot's own ``FastWAM.infer_action`` run for one method.

    infer_action VAE-encodes an image, draws its own noise, prefills and builds its schedule itself. Each
    method's reference substitutes only what the method takes as inputs for those calls (instance
    attributes, removed afterwards), so every other line that runs is LeRobot's, rope ``.tolist()``
    included: ``action_chunk`` gives the latents and noise; ``prefill`` records the K/V that LeRobot's
    prefill returns; ``action_step`` gives the noisy actions, the video K/V and a one-entry schedule.
    """
    policy_image = torch.zeros(1, 3, *image_size)

    def infer(proprio, context, context_mask, num_steps):
        out = fw.infer_action(prompt=None, input_image=policy_image, action_horizon=horizon, proprio=proprio,
                              context=context, context_mask=context_mask, num_inference_steps=num_steps,
                              sigma_shift=sigma_shift)
        return out["action"].unsqueeze(0)

    def action_chunk(first_frame_latents, context, context_mask, proprio, noise):
        with _substituted(fw, _encode_input_image_latents_tensor=lambda input_image, **_: first_frame_latents,
                          _make_action_latents=lambda *_: noise):
            return (infer(proprio, context, context_mask, steps).to(noise.device),)

    def prefill(first_frame_latents, context, context_mask, proprio):
        recorded = []

        def record(*args, **kwargs):
            recorded.append(type(fw.mot).prefill_video_cache(fw.mot, *args, **kwargs))
            return recorded[-1]

        noise = torch.zeros(1, horizon, fw.action_expert.action_dim, dtype=context.dtype)
        with _substituted(fw, _encode_input_image_latents_tensor=lambda input_image, **_: first_frame_latents,
                          _make_action_latents=lambda *_: noise), _substituted(fw.mot, prefill_video_cache=record):
            infer(proprio, context, context_mask, 1)
        (kv_cache,) = recorded
        return torch.stack([layer["k"] for layer in kv_cache]), torch.stack([layer["v"] for layer in kv_cache])

    def action_step(noisy_actions, timestep, delta, context, context_mask, proprio, video_k, video_v):
        kv_cache = [{"k": video_k[i], "v": video_v[i]} for i in range(video_k.shape[0])]
        latents = torch.zeros(*latent_shape, dtype=torch.float32, device=noisy_actions.device)
        with _substituted(fw, _encode_input_image_latents_tensor=lambda input_image, **_: latents,
                          _make_action_latents=lambda *_: noisy_actions,
                          infer_action_scheduler=_GivenSchedule(fw.infer_action_scheduler, timestep, delta)), \
                _substituted(fw.mot, prefill_video_cache=lambda *args, **kwargs: kv_cache):
            out = infer(proprio, context, context_mask, 1)
        # infer_action hands back float32 on the CPU; the step's own dtype converts back exactly.
        return (out.to(device=noisy_actions.device, dtype=noisy_actions.dtype),)

    def vae_encode(image):
        return (fw._encode_input_image_latents_tensor(image),)

    methods = {"vae_encode": vae_encode, "action_chunk": action_chunk, "prefill": prefill,
               "action_step": action_step}

    def reference(method: str, *inputs: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        if method not in methods:
            raise ExportError(f"Fast-WAM has no method {method!r}", f"methods: {', '.join(methods)}")
        with torch.no_grad():
            return methods[method](*inputs)

    return reference


# --------------------------------------------------------------------------------------------------------
# The deploy side's counterparts (zoo.runner): LeRobot's whole policy, and prompt embeddings


def lerobot_policy(checkpoint_dir: Path, recipe: Recipe, device: str = "cpu"):
    """LeRobot's own policy as a control loop builds it: ``(policy, preprocessor, postprocessor)`` on
    ``device`` in the recipe's dtype, with its text encoder (it embeds the task itself). The policy check's
    reference."""
    dtype = recipe.unit.dtype
    from lerobot.policies.factory import make_pre_post_processors

    checkpoint_dir = Path(checkpoint_dir)
    _read_policy_type(checkpoint_dir)
    config = PreTrainedConfig.from_pretrained(checkpoint_dir)
    config.device = device
    config.torch_dtype = dtype
    # As load_policy: the experts built on meta, then loaded from the file by fast_init.load_weights, or, inside
    # fast_init.seeded_weights (bench_chunk's real-size policy check, whose checkpoint is a placeholder with an
    # empty model.safetensors), filled with the seeded values the unit was built with.
    with built_on_meta(FastWAMPolicy, [WanVideoDiT, ActionDiT]):
        policy = FastWAMPolicy.from_pretrained(checkpoint_dir, config=config, strict=True).eval()
    pre, post = make_pre_post_processors(policy.config, pretrained_path=str(checkpoint_dir),
                                         preprocessor_overrides={"device_processor": {"device": device}})
    return policy, pre, post


def embed_prompt(policy: FastWAMPolicy, task: str):
    """What ``python -m zoo prompt`` writes for Fast-WAM: LeRobot's ``encode_prompt`` of the task in the
    policy's prompt template (modeling_fastwam._prompt_from_batch), as a ``zoo.runner.PromptEmbedding``."""
    text = policy.config.prompt_template.format(task=task)
    with torch.no_grad():
        context, mask = policy.model.encode_prompt(text)
    return PromptEmbedding(task, POLICY_TYPE, {"context": context, "context_mask": mask}, text=text)


# --------------------------------------------------------------------------------------------------------
# Fabricating a tiny checkpoint


def fabricate_checkpoint(recipe: Recipe, work_dir: Path) -> Dict[str, Path]:
    """Seeded random Fast-WAM weights at the recipe's size, in the real file layout.

    Returns ``{repo_id: folder}`` for the policy repo (config.json, model.safetensors, processors) and for
    the two repos Fast-WAM loads by Hub id: the Wan2.2 VAE and UMT5 encoder (``vae/``, ``text_encoder/``)
    and the UMT5 tokenizer (with the config.json transformers' AutoTokenizer resolves first).
    """
    opts = parse_options(recipe)
    if not opts.fabricate_config:
        raise RecipeError(f"recipe {recipe.name!r} has no unit.options.fabricate_config",
                          "fabricating needs the tiny FastWAMConfig fields (image_size, video_dit_config, ...)")
    work_dir = Path(work_dir)
    seed = int(recipe.source.seed)
    config = _tiny_config(opts.fabricate_config, recipe.unit.dtype, recipe.name)
    text_dim = int(config.video_dit_config["text_dim"])
    wan_dir = work_dir / _folder_name(WAN22_DIFFUSERS_MODEL_ID)
    tokenizer_dir = work_dir / _folder_name(config.tokenizer_model_id)
    policy_dir = work_dir / _folder_name(recipe.source.repo_id)
    for folder in (wan_dir, tokenizer_dir, policy_dir):
        shutil.rmtree(folder, ignore_errors=True)

    # Module constructors draw from the global RNG: keep the caller's RNG state untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        generator = torch.Generator().manual_seed(seed)
        vocab_size = _write_tokenizer(tokenizer_dir, text_dim)
        _write_wan_components(wan_dir, text_dim, vocab_size, generator)
        # FastWAMPolicy's constructor loads the VAE and tokenizer by Hub id: serve the folders just written
        # from a private cache while it runs.
        cache = work_dir / ".fabricate-hub-cache"
        put_in_cache(WAN22_DIFFUSERS_MODEL_ID, wan_dir, cache)
        put_in_cache(config.tokenizer_model_id, tokenizer_dir, cache)
        with hub_environment(cache, offline=True):
            policy = FastWAMPolicy(config)
        _randomise(policy, generator)
        policy.save_pretrained(policy_dir)
        pre, post = make_fastwam_pre_post_processors(config, dataset_stats=_fake_stats(config, generator))
        pre.save_pretrained(policy_dir)
        post.save_pretrained(policy_dir)
    shutil.rmtree(cache, ignore_errors=True)
    return {recipe.source.repo_id: policy_dir, WAN22_DIFFUSERS_MODEL_ID: wan_dir,
            config.tokenizer_model_id: tokenizer_dir}


def _folder_name(repo_id: str) -> str:
    return repo_id.replace("/", "--")


def _tiny_config(fields: Dict[str, Any], dtype: str, recipe_name: str) -> FastWAMConfig:
    fields = dict(fields)
    for key in ("video_dit_config", "action_dit_config"):
        if key in fields:
            fields[key] = dict(fields[key])  # FastWAMConfig writes into these
    # Without an explicit base_model_id=None, default-sized dims make FastWAMConfig point pretrained_path at
    # lerobot/fastwam_base (a 12 GB download) behind the caller's back.
    fields.setdefault("base_model_id", None)
    fields.update(torch_dtype=dtype, device="cpu")
    try:
        config = FastWAMConfig(**fields)
    except (TypeError, ValueError) as exc:
        raise RecipeError(f"recipe {recipe_name!r}: unit.options.fabricate_config is not a valid FastWAMConfig: "
                          f"{exc}", "use FastWAMConfig field names and values LeRobot accepts") from None
    video, action = config.video_dit_config, config.action_dit_config
    if video.get("num_layers") != action.get("num_layers") or video.get("num_heads") != action.get("num_heads"):
        raise RecipeError(f"recipe {recipe_name!r}: fabricate_config video and action experts differ in "
                          "num_layers or num_heads", "MoT pairs the experts layer by layer: make them equal")
    return config


def _write_tokenizer(folder: Path, text_dim: int) -> int:
    """A small Unigram T5 tokenizer under the UMT5 id, plus the config.json AutoTokenizer reads first."""
    from transformers import T5TokenizerFast, UMT5Config

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [("\u2581" + w, -3.0 - i * 0.01) for i, w in enumerate(dict.fromkeys(_TINY_WORDS))]
    pieces += [(c, -8.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789'.,:"]
    tokenizer = T5TokenizerFast(vocab=pieces, extra_ids=0)
    tokenizer.save_pretrained(folder)
    vocab_size = 8 * math.ceil(len(tokenizer) / 8)
    UMT5Config(vocab_size=vocab_size, d_model=text_dim, num_layers=1, num_heads=2, d_kv=8,
               d_ff=2 * text_dim).save_pretrained(folder)
    return vocab_size


def _write_wan_components(folder: Path, text_dim: int, vocab_size: int, generator: torch.Generator) -> None:
    """Tiny ``vae/`` (AutoencoderKLWan) and ``text_encoder/`` (UMT5EncoderModel) in diffusers' repo layout."""
    from transformers import UMT5Config, UMT5EncoderModel

    vae = tiny_wan22_vae()
    _randomise(vae, generator)
    vae.save_pretrained(folder / "vae")
    encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=vocab_size, d_model=text_dim, num_layers=1, num_heads=2, d_kv=8, d_ff=2 * text_dim,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, feed_forward_proj="gated-gelu",
    ))
    _randomise(encoder, generator)
    encoder.save_pretrained(folder / "text_encoder")


@torch.no_grad()
def _randomise(module: nn.Module, generator: torch.Generator) -> None:
    """Redraw every floating tensor from ``generator`` (in state_dict order), none left at 0 or 1.

    Default inits zero biases and output heads; a zero tensor would hide any error on its path.
    """
    for name, tensor in module.state_dict().items():
        if not tensor.is_floating_point():
            continue
        noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
        if tensor.ndim >= 2:
            value = noise / math.sqrt(max(1, math.prod(tensor.shape[1:])))
        elif "norm" in name or name.endswith("gamma"):
            value = 1.0 + 0.1 * noise
        else:
            value = 0.1 * noise
        tensor.copy_(value.to(tensor.dtype))


def _fake_stats(config: FastWAMConfig, generator: torch.Generator) -> Dict[str, Dict[str, torch.Tensor]]:
    def stats(dim: int) -> Dict[str, torch.Tensor]:
        return {"mean": 0.1 * torch.randn(dim, generator=generator),
                "std": 0.5 + torch.rand(dim, generator=generator)}

    out = {"action": stats(int(config.action_dim))}
    if config.proprio_dim is not None:
        out["observation.state"] = stats(int(config.proprio_dim))
    return out
