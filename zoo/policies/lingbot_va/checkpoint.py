"""Tiny LingBot-VA checkpoints: seeded random weights at a recipe's size, in LeRobot's real repo layout."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Dict

import torch

from lerobot.policies.lingbot_va import LingBotVAConfig, LingBotVAPolicy

from zoo.contract.recipes import Recipe
from zoo.policies.lingbot_va.recipe import validate_recipe
from zoo.policies.tiny_wan import tiny_wan22_vae


def fabricated_config(recipe: Recipe, policy_config: Dict[str, Any]) -> LingBotVAConfig:
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


def save_frozen_repo(config: LingBotVAConfig, seed: int, repo_dir: Path) -> None:
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
    policy_config = validate_recipe(recipe)
    config = fabricated_config(recipe, policy_config)
    work_dir = Path(work_dir)
    repos: Dict[str, Path] = {}
    policy_dir = work_dir / recipe.source.repo_id.replace("/", "--")
    _save_policy_repo(config, recipe.source.seed, policy_dir)
    repos[recipe.source.repo_id] = policy_dir
    if not Path(config.wan_pretrained_path).exists():  # a local folder is the user's own; a Hub id needs a stand-in
        frozen_dir = work_dir / config.wan_pretrained_path.replace("/", "--")
        save_frozen_repo(config, recipe.source.seed, frozen_dir)
        repos[config.wan_pretrained_path] = frozen_dir
    return repos

