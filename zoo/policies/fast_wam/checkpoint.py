"""Tiny Fast-WAM checkpoints: seeded random weights at a recipe's size, in the real file layout."""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any, Dict

import torch
from torch import nn

from lerobot.policies.fastwam.configuration_fastwam import FastWAMConfig
from lerobot.policies.fastwam.modeling_fastwam import FastWAMPolicy
from lerobot.policies.fastwam.processor_fastwam import make_fastwam_pre_post_processors
from lerobot.policies.fastwam.wan.components import WAN22_DIFFUSERS_MODEL_ID

from zoo.contract.recipes import Recipe
from zoo.core.errors import RecipeError
from zoo.export.hub_cache import hub_environment, put_in_cache
from zoo.policies.fast_wam.recipe import parse_options
from zoo.policies.tiny_wan import tiny_wan22_vae

_TINY_WORDS = (
    "a video recorded from robot's point of view executing the following instruction: pick up put place "
    "open close the bowl plate drawer cabinet on in of and to black white red top left right"
).split()


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
        vocab_size = write_tokenizer(tokenizer_dir, text_dim)
        write_wan_components(wan_dir, text_dim, vocab_size, generator)
        # FastWAMPolicy's constructor loads the VAE and tokenizer by Hub id: serve the folders just written
        # from a private cache while it runs.
        cache = work_dir / ".fabricate-hub-cache"
        put_in_cache(WAN22_DIFFUSERS_MODEL_ID, wan_dir, cache)
        put_in_cache(config.tokenizer_model_id, tokenizer_dir, cache)
        with hub_environment(cache, offline=True):
            policy = FastWAMPolicy(config)
        _randomise(policy, generator)
        policy.save_pretrained(policy_dir)
        pre, post = make_fastwam_pre_post_processors(config, dataset_stats=_fake_stats(config, generator, opts.fabricate_stats))
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


def write_tokenizer(folder: Path, text_dim: int) -> int:
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


def write_wan_components(folder: Path, text_dim: int, vocab_size: int, generator: torch.Generator) -> None:
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


def _fake_stats(config: FastWAMConfig, generator: torch.Generator,
                given: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, torch.Tensor]]:
    """Seeded statistics (drawn for every feature, so a recipe's given ones leave the others' draws as they
    were), replaced by the recipe's ``fabricate_stats`` where it names a feature."""
    def stats(dim: int) -> Dict[str, torch.Tensor]:
        return {"mean": 0.1 * torch.randn(dim, generator=generator),
                "std": 0.5 + torch.rand(dim, generator=generator)}

    out = {"action": stats(int(config.action_dim))}
    if config.proprio_dim is not None:
        out["observation.state"] = stats(int(config.proprio_dim))
    unknown = sorted(set(given) - set(out))
    if unknown:
        raise RecipeError(f"unit.options.fabricate_stats names {unknown}, which the checkpoint does not normalise",
                          f"name some of: {', '.join(sorted(out))}")
    for key, value in given.items():
        tensors = {name: torch.tensor([float(v) for v in value[name]]) for name in ("mean", "std")}
        if tensors["mean"].shape != out[key]["mean"].shape:
            raise RecipeError(f"unit.options.fabricate_stats.{key} has {tensors['mean'].numel()} values; the "
                              f"feature has {out[key]['mean'].numel()}", "give one mean and std per dimension")
        out[key] = tensors
    return out
