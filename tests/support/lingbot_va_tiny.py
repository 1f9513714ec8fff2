"""The fabricated tiny LingBot-VA checkpoint and the step sequence its policy tests share: fabricated once per
test module (seeded, LeRobot's real repo layout), put into a private Hub cache and pulled offline, exactly as the
pipeline does for tiny recipes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from huggingface_hub import snapshot_download

from lerobot.policies.lingbot_va.utils import get_mesh_id
from zoo.contract.recipes import load_recipe
from zoo.export.hub_cache import hub_environment, put_in_cache
from zoo.policies import load_family

lingbot_va = load_family("lingbot_va")
RECIPE = "lingbot-va-tiny"
# The recipe's methods without prompt_kv: DiT steps that take the prompt's UMT5 embedding and compute its
# cross-attention K/V in every call, as LeRobot's transformer does (the recipe hoists them into prompt_kv).
TEXT_EMB_STEPS = ["unit.methods=[vae_encode_first,vae_encode,video_step,action_step]"]


def fabricated_hub(root: Path, overrides=()):
    """Fabricate -> put_in_cache -> offline snapshot_download: returns (cache dir, checkpoint dir, repos)."""
    recipe = load_recipe(RECIPE, list(overrides))
    repos = lingbot_va.fabricate_checkpoint(recipe, root / "fabricated")
    cache = root / "cache"
    for repo_id, folder in repos.items():
        put_in_cache(repo_id, folder, cache)
    with hub_environment(cache, offline=True):
        checkpoint = Path(snapshot_download(recipe.source.repo_id))
    return cache, checkpoint, repos


def step_inputs(method, frame_st_id, generator):
    """One stream's inputs as LingBotVAPolicy._prepare_latent_input + _repeat_input_for_cfg build them."""
    frames = 4
    if method == "video_step":
        latents = torch.randn(2, 48, frames, 4, 8, generator=generator)
        grid = get_mesh_id(frames, 2, 4, 0, 1, frame_st_id)
    else:
        latents = torch.randn(2, 30, frames, 4, 1, generator=generator)
        grid = get_mesh_id(frames, 4, 1, 1, 1, frame_st_id, action=True)
    t = float(torch.rand((), generator=generator)) * 1000.0
    timesteps = torch.full((frames,), t)
    return latents, timesteps[None].repeat(2, 1), grid[None].repeat(2, 1, 1)


# (method | "clear", update_cache, frame_st_id): _infer's video(0..0,1) -> action(0..0,1) per chunk, with
# _compute_kv_cache's clear_pred_cache + update_cache=2 feedback between chunks. By the third chunk the
# 96-slot pool overflows, so slots are evicted (oldest first), also by steps that do not commit.
SEQUENCE = [
    ("video_step", 0, 0), ("video_step", 0, 0), ("video_step", 1, 0), ("action_step", 0, 0), ("action_step", 1, 0),
    ("clear", None, None), ("video_step", 2, 0), ("action_step", 2, 0),
    ("video_step", 0, 4), ("video_step", 1, 4), ("action_step", 0, 4), ("action_step", 1, 4),
    ("clear", None, None), ("video_step", 2, 4), ("action_step", 2, 4),
    ("video_step", 0, 8), ("video_step", 1, 8), ("action_step", 0, 8), ("action_step", 1, 8),
]


@dataclass
class Step:
    """One DiT call of ``SEQUENCE``: its inputs, LeRobot's prediction, and the slots the host allocator chose."""

    method: str
    update: int
    latents: torch.Tensor
    timesteps: torch.Tensor
    grid: torch.Tensor
    ref: torch.Tensor
    slots: torch.Tensor
    visible: torch.Tensor
    evicted: bool  # the allocator freed committed slots to make room


def lerobot_sequence(eager, alloc, pool, generator, text) -> Iterator[Step]:
    """``SEQUENCE`` as LeRobot's own transformer calls run it (``eager``, with its own KV cache), the host
    allocator choosing the slots beside it; the caller runs its unit on each step, then ``alloc.finish``."""
    for method, update, frame_st_id in SEQUENCE:
        if method == "clear":
            eager.clear_predictions()
            alloc.clear_predictions()
            continue
        latents, timesteps, grid = step_inputs(method, frame_st_id, generator)
        ref = eager(method, latents, timesteps, grid, text, update)
        before = int(alloc.mask.sum())
        per_step = pool.video_slots_per_step if method == "video_step" else pool.action_slots_per_step
        slots, visible = alloc.begin(per_step)
        yield Step(method, update, latents, timesteps, grid, ref, slots, visible, int(visible.sum()) < before)
