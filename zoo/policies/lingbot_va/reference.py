"""LeRobot's own side of LingBot-VA: its stateful transformer calls (verification's reference), the whole policy
as a control loop builds it (the policy check's reference), its noise for a float32 reference, its prompts."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Dict, Iterator

import torch

from lerobot.policies.lingbot_va import LingBotVAPolicy

from zoo.contract.recipes import Recipe
from zoo.policies.lingbot_va.loading import load_policy
from zoo.policies.lingbot_va.recipe import POLICY_TYPE
from zoo.runner.prompt import PromptEmbedding


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
