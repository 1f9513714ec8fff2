"""Loading a Fast-WAM checkpoint with LeRobot's own classes, every failure a ``PullError`` that says what was wrong."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError

from lerobot.configs import PreTrainedConfig
from lerobot.policies.fastwam.configuration_fastwam import FastWAMConfig
from lerobot.policies.fastwam.modeling_fastwam import FastWAMPolicy
from lerobot.policies.fastwam.wan import ActionDiT, WanVideoDiT
from lerobot.policies.fastwam.wan.components import WAN22_DIFFUSERS_MODEL_ID

from zoo.core.errors import PullError
from zoo.policies.fast_init import built_on_meta
from zoo.policies.fast_wam.recipe import POLICY_TYPE


def read_policy_type(checkpoint_dir: Path) -> str:
    """The checkpoint's config.json "type", refused unless it is Fast-WAM's."""
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
    read_policy_type(checkpoint_dir)
    config = _export_config(checkpoint_dir, dtype)
    if not (checkpoint_dir / "model.safetensors").is_file():
        raise PullError(f"{checkpoint_dir} has no model.safetensors",
                        "LeRobot policies load one unsharded model.safetensors; re-download the checkpoint")
    policy = _from_pretrained(checkpoint_dir, config).eval()
    if dtype == "bfloat16":
        # LeRobot computes the video time embedding inside torch.amp.autocast("cuda", dtype=float32): on
        # CUDA that runs these two layers in float32 (bf16 weights widened exactly). Autocast is off on the
        # CPU (eager bf16 fails there) and gone after export, so hold them in float32 explicitly.
        video = policy.model.video_expert
        video.time_embedding.float()
        video.time_projection.float()
    return policy


def _export_config(checkpoint_dir: Path, dtype: str) -> FastWAMConfig:
    """The checkpoint's config, set for export: the CPU, ``dtype``, no text encoder."""
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
    return config


def _from_pretrained(checkpoint_dir: Path, config: FastWAMConfig) -> FastWAMPolicy:
    try:
        # The experts' parameters are built on meta and take the file's tensors by assignment: LeRobot's
        # constructor would initialise the Wan backbone's blocks twice (WanModel, then WanVideoDiT) in float32
        # before the file overwrites them (zoo.policies.fast_init). The VAE, loaded by diffusers inside the
        # constructor, is built as before.
        with built_on_meta(FastWAMPolicy, [WanVideoDiT, ActionDiT]):
            return FastWAMPolicy.from_pretrained(checkpoint_dir, config=config, strict=True)
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


def _first_lines(exc: BaseException, n: int = 3) -> str:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    text = " ".join(lines[:n])
    return text if len(text) < 600 else text[:600] + " ..."
