"""LeRobot's own side of Fast-WAM: ``infer_action`` run for one unit method (verification's reference), the
whole policy as a control loop builds it (the policy check's reference) and its prompt embedding."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Tuple

import torch
from torch import nn

from lerobot.configs import PreTrainedConfig
from lerobot.policies.fastwam.modeling_fastwam import FastWAMPolicy
from lerobot.policies.fastwam.wan import ActionDiT, WanVideoDiT

from zoo.contract.recipes import Recipe
from zoo.core.errors import ExportError
from zoo.policies.fast_init import built_on_meta
from zoo.policies.fast_wam.loading import read_policy_type
from zoo.policies.fast_wam.recipe import POLICY_TYPE
from zoo.runner.prompt import PromptEmbedding

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


class InferActionReference:
    """``reference(method, *inputs) -> outputs``: LeRobot's own ``FastWAM.infer_action`` run for one method.

    infer_action VAE-encodes an image, draws its own noise, prefills and builds its schedule itself. Each
    method's reference substitutes only what the method takes as inputs for those calls (instance
    attributes, removed afterwards), so every other line that runs is LeRobot's, rope ``.tolist()``
    included: ``action_chunk`` gives the latents and noise; ``prefill`` records the K/V that LeRobot's
    prefill returns; ``action_step`` gives the noisy actions, the video K/V and a one-entry schedule.
    """

    METHODS = ("vae_encode", "action_chunk", "prefill", "action_step")

    def __init__(self, fw: nn.Module, horizon: int, steps: int, sigma_shift: Optional[float],
                 image_size: Tuple[int, int], latent_shape: Sequence[int]):
        self.fw, self.horizon, self.steps, self.sigma_shift = fw, horizon, steps, sigma_shift
        self.latent_shape = latent_shape
        self.policy_image = torch.zeros(1, 3, *image_size)

    def __call__(self, method: str, *inputs: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        if method not in self.METHODS:
            raise ExportError(f"Fast-WAM has no method {method!r}", f"methods: {', '.join(self.METHODS)}")
        with torch.no_grad():
            return getattr(self, method)(*inputs)

    def _infer(self, proprio, context, context_mask, num_steps):
        out = self.fw.infer_action(prompt=None, input_image=self.policy_image, action_horizon=self.horizon,
                                   proprio=proprio, context=context, context_mask=context_mask,
                                   num_inference_steps=num_steps, sigma_shift=self.sigma_shift)
        return out["action"].unsqueeze(0)

    def _given(self, latents, noise):
        """infer_action with ``latents`` as its image encode and ``noise`` as its action noise."""
        return _substituted(self.fw, _encode_input_image_latents_tensor=lambda input_image, **_: latents,
                            _make_action_latents=lambda *_: noise)

    def vae_encode(self, image):
        return (self.fw._encode_input_image_latents_tensor(image),)

    def action_chunk(self, first_frame_latents, context, context_mask, proprio, noise):
        with self._given(first_frame_latents, noise):
            return (self._infer(proprio, context, context_mask, self.steps).to(noise.device),)

    def prefill(self, first_frame_latents, context, context_mask, proprio):
        fw, recorded = self.fw, []

        def record(*args, **kwargs):
            recorded.append(type(fw.mot).prefill_video_cache(fw.mot, *args, **kwargs))
            return recorded[-1]

        noise = torch.zeros(1, self.horizon, fw.action_expert.action_dim, dtype=context.dtype)
        with self._given(first_frame_latents, noise), _substituted(fw.mot, prefill_video_cache=record):
            self._infer(proprio, context, context_mask, 1)
        (kv_cache,) = recorded
        return torch.stack([layer["k"] for layer in kv_cache]), torch.stack([layer["v"] for layer in kv_cache])

    def action_step(self, noisy_actions, timestep, delta, context, context_mask, proprio, video_k, video_v):
        fw = self.fw
        kv_cache = [{"k": video_k[i], "v": video_v[i]} for i in range(video_k.shape[0])]
        latents = torch.zeros(*self.latent_shape, dtype=torch.float32, device=noisy_actions.device)
        with self._given(latents, noisy_actions), \
                _substituted(fw, infer_action_scheduler=_GivenSchedule(fw.infer_action_scheduler, timestep, delta)), \
                _substituted(fw.mot, prefill_video_cache=lambda *args, **kwargs: kv_cache):
            out = self._infer(proprio, context, context_mask, 1)
        # infer_action hands back float32 on the CPU; the step's own dtype converts back exactly.
        return (out.to(device=noisy_actions.device, dtype=noisy_actions.dtype),)


# --------------------------------------------------------------------------------------------------------
# The deploy side's counterparts (zoo.runner): LeRobot's whole policy, and prompt embeddings


def lerobot_policy(checkpoint_dir: Path, recipe: Recipe, device: str = "cpu"):
    """LeRobot's own policy as a control loop builds it: ``(policy, preprocessor, postprocessor)`` on
    ``device`` in the recipe's dtype, with its text encoder (it embeds the task itself). The policy check's
    reference."""
    dtype = recipe.unit.dtype
    from lerobot.policies.factory import make_pre_post_processors

    checkpoint_dir = Path(checkpoint_dir)
    read_policy_type(checkpoint_dir)
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
