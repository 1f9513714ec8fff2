"""``host_settings.json``: what the deploy side needs besides the ``.pte`` to drive a run's methods, one typed
dataclass per policy family (the numbers of its host loop: schedules, shifts, guidance, slots, cameras).

The file is ``{"format": 1, "family": NAME, ...the family's fields}``; ``read_host_settings_json`` picks the
family's dataclass by ``family`` and refuses any other format, an unknown family, and a missing, unexpected or
ill-typed key with a ``ContractError``. docs/host-loops.md describes the loops these numbers drive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Type, Union

from zoo.contract.typed_json import FORMAT_KEY, check_format, decode, encode, reexport_hint
from zoo.core.errors import ContractError

HOST_SETTINGS_FORMAT = 1  # bump when a key changes meaning or shape; readers refuse every other value
FAMILY_KEY = "family"


@dataclass
class ObservationFeature:
    """One key of the observation batch the policy reads (its config's ``input_features``)."""

    type: str  # LeRobot's FeatureType value: VISUAL, STATE, ...
    shape: List[int]


@dataclass
class _Settings:
    """What every family's settings share: the format, and the family and LeRobot policy type they are for."""

    family: ClassVar[str] = "?"  # the zoo family (zoo/policies/NAME), the file's "family" key
    policy_type: ClassVar[Optional[str]] = None  # LeRobot's config "type", which zoo.runner picks a host loop by

    def to_json(self) -> Dict[str, Any]:
        data = encode(self)
        return {FORMAT_KEY: data.pop(FORMAT_KEY), FAMILY_KEY: self.family, **data}


@dataclass
class NoHostSettings(_Settings):
    """A unit with no host loop (synthetic and toy units): nothing to drive besides its inputs."""

    family: ClassVar[str] = "none"
    format: int = HOST_SETTINGS_FORMAT


@dataclass
class LlamaHostSettings(_Settings):
    """A causal language model's prefill: next-token logits at every position, no KV cache."""

    family: ClassVar[str] = "llama"
    vocab_size: int
    max_seq_len: int
    logits_dtype: str
    bos_token_id: Optional[int]
    eos_token_id: Union[int, List[int], None]  # Hugging Face configs hold one id or several
    rope_theta: float
    format: int = HOST_SETTINGS_FORMAT


# --- LingBot-VA ------------------------------------------------------------------------------------------------


def pool_buffer_names(layers: int) -> List[str]:
    """The mutable buffers that hold LingBot-VA's KV pool in the "buffer" layout: one K and one V per layer, the
    same names in every DiT method, which is how the runtimes give all of them one copy (by name)."""
    return [f"{kind}_pool_{layer}" for layer in range(int(layers)) for kind in ("k", "v")]


@dataclass
class KvPool:
    """The explicit K/V pool both DiT methods read and write, and how many slots each call fills."""

    # "io": passed in and returned by each call; "buffer": mutable buffers inside the methods (``buffer_names``),
    # one copy shared by every method that holds them
    layout: str
    shape: List[int]  # [layers, batch, tokens, heads, head_dim], zero-initialised
    tokens: int
    video_slots_per_step: int
    action_slots_per_step: int

    def buffer_names(self) -> List[str]:
        """Layout "buffer": the names of the per-layer K and V buffers, each ``shape[1:]``."""
        return pool_buffer_names(self.shape[0])


@dataclass
class Guidance:
    """Classifier-free guidance: the rows of a CFG batch and the two streams' scales."""

    enabled: bool
    rows: List[str]  # ["prompt", "negative_prompt"] with CFG, ["prompt"] without
    video_guidance_scale: float
    action_guidance_scale: float


@dataclass
class VideoStream:
    num_inference_steps: int
    snr_shift: float
    exec_step: int
    latent_shape: List[int]  # [channels, frames, height, width]
    patch_size: List[int]
    tokens_per_step: int


@dataclass
class ActionStream:
    num_inference_steps: int
    snr_shift: float
    action_dim: int
    used_action_channel_ids: List[int]
    action_per_frame: int
    tokens_per_step: int


@dataclass
class ScheduleTables:
    """One stream's flow-matching schedule, float32 values as the policy's scheduler computed them."""

    sigmas: List[float]
    timesteps: List[float]


@dataclass
class Scheduler:
    """The flow-matching schedulers LingBot-VA builds, one per stream."""

    num_train_timesteps: int
    sigma_min: float
    sigma_max: float
    extra_one_step: bool
    video_shift: float
    action_shift: float
    append_zero_step: bool  # each stream's schedule ends with one extra t=0 call, the one that commits
    video: ScheduleTables
    action: ScheduleTables


@dataclass
class LingBotNoise:
    """The initial noise of each chunk, drawn from the global generator in the model dtype, video first."""

    generator: str
    dtype: str
    video_shape: List[int]
    action_shape: List[int]


@dataclass
class TextEncoder:
    max_sequence_length: int
    text_dim: int
    frozen_components: str  # the repo holding vae/, text_encoder/ (UMT5) and tokenizer/


@dataclass
class Cameras:
    keys: List[str]  # in the order the cameras are stacked
    layout: str  # "width_concat" or "robotwin_tshape"
    height: int
    width: int
    image_hflip: bool


@dataclass
class StreamingVae:
    """The streaming VAE encode methods and the causal caches they hand from call to call."""

    first_method: str
    step_method: str
    frames_per_call: int
    cache: List[str]  # the cache inputs of step_method, each returned under its own name
    keyframe_stride: int  # an observation is buffered every this many executed actions


@dataclass
class LingBotVAHostSettings(_Settings):
    family: ClassVar[str] = "lingbot_va"
    policy_type: ClassVar[Optional[str]] = "lingbot_va"
    dtype: str
    kv_pool: KvPool
    batch: int
    cfg: Guidance
    video: VideoStream
    action: ActionStream
    scheduler: Scheduler
    noise: LingBotNoise
    frame_chunk_size: int
    chunk_size: int
    attn_window: int
    text: TextEncoder
    observation_features: Dict[str, ObservationFeature]
    cameras: Cameras
    vae: Optional[StreamingVae] = None  # None when the recipe exports no streaming VAE methods
    # The method that computes the prompt's cross-attention K/V once per prompt, whose outputs the DiT steps take
    # in place of text_emb; None when the steps take text_emb (zoo/policies/lingbot_va/prompt_kv.py).
    prompt_method: Optional[str] = None
    format: int = HOST_SETTINGS_FORMAT


# --- Fast-WAM --------------------------------------------------------------------------------------------------


@dataclass
class ImageResize:
    """The model's own input resize (torch.nn.functional.interpolate's arguments)."""

    mode: str
    align_corners: bool
    antialias: bool


@dataclass
class FastWAMNoise:
    """The action noise of each chunk: drawn in float32 on ``generator_device`` from ``seed``, then cast."""

    shape: List[int]
    dtype: str
    generator_device: str
    seed: Optional[int]
    cast_to: str


@dataclass
class FastWAMHostSettings(_Settings):
    family: ClassVar[str] = "fast_wam"
    policy_type: ClassVar[Optional[str]] = "fastwam"
    layout: str  # "chunk": one action_chunk method; "split": prefill, then action_step per timestep
    num_inference_steps: int
    sigma_shift: Optional[float]  # as the recipe asked; None for the scheduler's own
    effective_sigma_shift: float
    timesteps: List[float]  # what the host feeds action_step, in order (and what action_chunk has baked in)
    deltas: List[float]
    action_horizon: int
    n_action_steps: int
    action_dim: int
    proprio_dim: int
    image_size: List[int]  # [height, width] of the VAE input
    observation_features: Dict[str, ObservationFeature]
    image_features: Dict[str, List[int]]
    image_resize: ImageResize
    vae_method: Optional[str]
    first_frame_latent_shape: List[int]
    video_grid: List[int]
    context_len: int
    text_dim: int
    prompt_template: str
    tokenizer_model_id: str
    tokenizer_max_len: int
    text_encoder_model_id: str
    vae_model_id: str
    noise: FastWAMNoise
    normalization_mapping: Dict[str, str]
    toggle_action_dimensions: List[int]
    format: int = HOST_SETTINGS_FORMAT


HostSettings = Union[NoHostSettings, LlamaHostSettings, LingBotVAHostSettings, FastWAMHostSettings]
FAMILIES: Dict[str, Type[Any]] = {cls.family: cls for cls in
                                  (NoHostSettings, LlamaHostSettings, LingBotVAHostSettings, FastWAMHostSettings)}


def host_settings_from_json(data: Any, file: str) -> HostSettings:
    """Parsed ``host_settings.json`` as its family's dataclass; a ``ContractError`` for anything else. ``file`` (the
    path it was read from) names it in error messages."""
    check_format(data, file, HOST_SETTINGS_FORMAT)
    body = {k: v for k, v in data.items() if k != FAMILY_KEY}
    family = data.get(FAMILY_KEY)
    if family not in FAMILIES:
        raise ContractError(f"{file} is for family {family!r}, which this zoo does not know "
                            f"(it knows {', '.join(sorted(FAMILIES))})", reexport_hint(file))
    return decode(FAMILIES[family], body, file)


def host_settings_record(settings: HostSettings) -> Dict[str, Any]:
    """The family's fields as plain data, without the file's format and family keys (for the model card)."""
    return {k: v for k, v in settings.to_json().items() if k not in (FORMAT_KEY, FAMILY_KEY)}
