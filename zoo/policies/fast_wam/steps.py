"""The Fast-WAM unit's methods: LeRobot's own ``FastWAM`` code, cut at what blocks ``torch.export``.

Only two things are replaced: the rope's grid (``_StaticGrid``) and the in-graph noise, which the host draws
(same generator and seed as LeRobot) and passes in, since RNG kernels would be ATen fallbacks the ExecuTorch
CUDA backend refuses. The UMT5 text encoder stays outside (a prompt is embedded once, on a workstation).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from zoo.core.errors import ExportError


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


class FastWAMUnitBase(nn.Module):
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


class FastWAMActionChunk(FastWAMUnitBase):
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


class FastWAMPrefill(FastWAMUnitBase):
    """``prefill``: the video expert once per chunk; returns every layer's video K and V, stacked."""

    def forward(self, first_frame_latents, context, context_mask, proprio):
        context, context_mask = self._context(context, context_mask, proprio)
        kv_cache, _ = self._prefill(first_frame_latents, context, context_mask)
        return torch.stack([layer["k"] for layer in kv_cache]), torch.stack([layer["v"] for layer in kv_cache])


class FastWAMActionStep(FastWAMUnitBase):
    """``action_step``: one Euler step of the action expert against the prefilled video K/V."""

    def forward(self, noisy_actions, timestep, delta, context, context_mask, proprio, video_k, video_v):
        fw = self.fw
        context, context_mask = self._context(context, context_mask, proprio)
        kv_cache = [{"k": video_k[i], "v": video_v[i]} for i in range(video_k.shape[0])]
        attention_mask = self._attention_mask(noisy_actions.device)
        velocity = self._action_velocity(noisy_actions, timestep, context, context_mask, kv_cache, attention_mask)
        return fw.infer_action_scheduler.step(velocity, delta, noisy_actions)
