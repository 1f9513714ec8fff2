"""Fast-WAM's host loop: LeRobot's ``FastWAMPolicy.select_action`` / ``predict_action_chunk`` and
``FastWAM.infer_action`` (LeRobot 0.6.1), around the artifact's methods.

Per chunk: the first frame's VAE latent (method ``vae_encode``), the noise drawn as LeRobot draws it, the
video prefill (``prefill``) and the Euler steps (``action_step`` per entry of the schedule the export wrote,
or the unrolled ``action_chunk``). There is no state across chunks besides the action queue. References are
to ``lerobot/policies/fastwam/``: modeling_fastwam.py (mf) and wan/modular.py (wm).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from zoo.contract.host_settings import FastWAMHostSettings
from zoo.core.errors import RunnerError
from zoo.runner.base import Batch, PolicyRunner
from zoo.runner.processors import OBS_IMAGES_PREFIX, OBS_STATE


class FastWAMRunner(PolicyRunner):
    policy_type = "fastwam"
    family = "fast_wam"

    @classmethod
    def device_state(cls, settings: FastWAMHostSettings) -> Dict[str, Dict[str, str]]:
        # The prefill's video K/V, read by every action step of the chunk.
        return {"prefill": {"video_k": "video_k", "video_v": "video_v"}}

    @classmethod
    def episode_steps(cls, settings: FastWAMHostSettings, chunks: int) -> int:
        return int(chunks) * settings.n_action_steps + 1  # every chunk is n_action_steps long

    def _configure(self) -> None:
        s: FastWAMHostSettings = self.settings
        run = self.run
        self.horizon = s.action_horizon
        self.n_action_steps = s.n_action_steps
        self.action_dim = s.action_dim
        self.image_size = tuple(s.image_size)
        self.layout = s.layout
        self.vae_method = s.vae_method
        if not self.vae_method:
            raise RunnerError(f"the run in {run.path} has no vae_encode method, so the first frame's VAE latent "
                              "would need PyTorch model code on this side",
                              "export the recipe with unit.methods starting with vae_encode")
        # The schedule the export computed with LeRobot's scheduler, already cast to the unit's dtype.
        self.timesteps = list(s.timesteps)
        self.deltas = list(s.deltas)
        self.noise = s.noise

    # --- LeRobot's FastWAMPolicy -----------------------------------------------------------------------------

    def _reset(self) -> None:
        self._queue: deque = deque([], maxlen=self.n_action_steps)  # mf:151-152

    def _select_action(self, batch: Batch) -> torch.Tensor:  # mf:236-242
        if len(self._queue) == 0:
            actions = self._predict_action_chunk(batch)[:, : self.n_action_steps]
            self._queue.extend(actions.transpose(0, 1))
        return self._queue.popleft()

    def _predict_action_chunk(self, batch: Optional[Batch]) -> torch.Tensor:  # mf:205-234
        if batch is None:
            raise RunnerError("Fast-WAM predicts from an observation; got none", "pass the observation batch")
        image = self._input_image(batch)
        size = 1 if image.ndim == 3 else int(image.shape[0])
        chunks = [self._infer_action(batch, image if size == 1 else image[i:i + 1], i, size) for i in range(size)]
        action = chunks[0] if size == 1 else torch.cat(chunks, dim=0)
        self.chunks_predicted += 1
        return action.to(device=_batch_device(batch), dtype=torch.float32)

    # --- FastWAM.infer_action (wm:1786-1871) -----------------------------------------------------------------

    def _infer_action(self, batch: Batch, image: torch.Tensor, index: int, size: int) -> torch.Tensor:
        self._refuse_unsupported(batch)
        if image.ndim == 3:
            image = image.unsqueeze(0)
        if image.ndim != 4 or image.shape[0] != 1 or image.shape[1] != 3:
            raise RunnerError(f"the input image must be [1, 3, H, W] or [3, H, W], got {tuple(image.shape)}",
                              "pass one camera frame per environment")
        proprio = _sliced(batch.get("proprio", batch.get(OBS_STATE)), index, size)
        if proprio is None:
            raise RunnerError("the batch has no observation.state (proprio)",
                              "Fast-WAM conditions on the robot state: add observation.state to the batch")
        if proprio.ndim == 1:
            proprio = proprio.unsqueeze(0)
        proprio = proprio.to(device=self.device, dtype=self.dtype)  # wm:1604-1619
        noise = self._noise(batch)  # wm:1655-1662, drawn before the encode, as LeRobot does
        latents = self.call(self.vae_method, image=image.to(device=self.device, dtype=self.dtype))
        context, context_mask = self._context(batch, index, size)
        # The prompt's context is the same for every call of the chunk (and of the episode).
        conditions = {"context": self.backend.hold("context", context),
                      "context_mask": self.backend.hold("context_mask", context_mask), "proprio": proprio}
        first_frame = latents["first_frame_latents"]
        if self.layout == "chunk":
            actions = self.call("action_chunk", first_frame_latents=first_frame, noise=noise, **conditions)["actions"]
        else:
            kv = self.call("prefill", first_frame_latents=first_frame, **conditions)
            actions = noise
            for t, d in zip(self.timesteps, self.deltas):  # wm:1854-1867
                actions = self.call("action_step", noisy_actions=actions,
                                    timestep=torch.tensor([t], dtype=self.dtype),
                                    delta=torch.tensor([d], dtype=self.dtype), video_k=kv["video_k"],
                                    video_v=kv["video_v"], **conditions)["actions"]
        return actions[0].to(device="cpu", dtype=torch.float32).unsqueeze(0)  # wm:1870, mf:332-336

    def _noise(self, batch: Batch) -> torch.Tensor:
        """``_make_action_latents``: float32 normal noise from ``Generator(rand_device).manual_seed(seed)`` (or
        the global generator when the seed is None), then cast to the model's dtype."""
        seed = _scalar(batch.get("seed", self.noise.seed))
        rand_device = batch.get("rand_device", self.noise.generator_device)
        generator = None if seed is None else torch.Generator(device=rand_device).manual_seed(int(seed))
        noise = torch.randn(tuple(self.noise.shape), generator=generator, device=rand_device, dtype=torch.float32)
        return noise.to(device=self.device, dtype=self.dtype)

    def _context(self, batch: Batch, index: int, size: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``_prepare_infer_context`` (wm:1621-1638) without the proprio token, which the unit appends: the
        embedding of the batch's prompt or task (mf:317-329) from a ``zoo prompt`` file, or a precomputed
        context in the batch."""
        context, mask = batch.get("context"), batch.get("context_mask")
        text, task = batch.get("prompt"), batch.get("task")
        use_prompt, use_context = text is not None or task is not None, context is not None or mask is not None
        if use_prompt and use_context:
            raise RunnerError("`prompt`/`task` and `context/context_mask` are mutually exclusive",
                              "pass one of them (LeRobot refuses both as well)")
        if not use_prompt and not use_context:
            raise RunnerError("the batch has neither a task nor a precomputed context",
                              "add the task text to the observation batch, as LeRobot's environments do")
        if use_prompt:
            embedding = (self.prompt_for(text=_sliced(text, index, size)) if text is not None
                         else self.prompt_for(task=_sliced(task, index, size)))
            context, mask = embedding.tensors["context"], embedding.tensors["context_mask"]
        elif context is None or mask is None:
            raise RunnerError("`context` and `context_mask` must be both provided together", "pass both")
        else:
            context, mask = _sliced(context, index, size), _sliced(mask, index, size)
        if context.ndim == 2:
            context = context.unsqueeze(0)
        if mask.ndim == 1:
            mask = mask.unsqueeze(0)
        return context.to(device=self.device, dtype=self.dtype), mask.to(device=self.device, dtype=torch.bool)

    def _refuse_unsupported(self, batch: Batch) -> None:
        """Per-call options LeRobot reads from the batch (mf:299-314) that would need another export."""
        steps, shift = batch.get("num_inference_steps"), batch.get("sigma_shift")
        exported_steps, exported_shift = self.settings.num_inference_steps, self.settings.effective_sigma_shift
        if (steps is not None and int(_scalar(steps)) != int(exported_steps)) or \
                (shift is not None and float(_scalar(shift)) != float(exported_shift)):
            raise RunnerError(f"this artifact was exported for {exported_steps} steps at shift {exported_shift}; the "
                              f"batch asks for {steps} steps at shift {shift}",
                              "export with unit.options.num_inference_steps / sigma_shift set to the values wanted")
        if bool(batch.get("tiled", False)):
            raise RunnerError("tiled VAE encoding is not supported (LeRobot's Fast-WAM refuses it too)",
                              "leave `tiled` unset")

    # --- the input image (mf:379-440) ------------------------------------------------------------------------

    def _input_image(self, batch: Batch) -> torch.Tensor:
        if "input_image" in batch:
            return self._prepare_image(batch["input_image"])
        video = batch.get("video")
        if video is None:
            keys = sorted(k for k in batch if k.startswith(OBS_IMAGES_PREFIX) and not k.endswith("_is_pad"))
            if not keys:
                raise RunnerError("the batch has no camera image (observation.images.*, video or input_image)",
                                  f"expected cameras: {', '.join(self.settings.image_features)}")
            per_cam = (self.image_size[0], self.image_size[1] // len(keys))
            frames = [self._resize(batch[k], per_cam) for k in keys]
            image = torch.cat(frames, dim=-1) if len(frames) > 1 else frames[0]
            if image.ndim == 4:
                return self._prepare_image(image)  # LeRobot repeats it over time, then takes frame 0
            if image.ndim == 5:
                return self._prepare_image(image[:, 0])
            raise RunnerError(f"camera batch of shape {tuple(image.shape)}", "expected [B,C,H,W] or [B,T,C,H,W]")
        if video.ndim == 5:
            return self._prepare_image(video[:, :, 0])
        if video.ndim == 4:
            return self._prepare_image(video)
        raise RunnerError(f"cannot build an input image from a video of shape {tuple(video.shape)}",
                          "pass [B,C,T,H,W] or [B,C,H,W]")

    def _prepare_image(self, image: torch.Tensor) -> torch.Tensor:
        if image.ndim == 3:
            image = image.unsqueeze(0)
        if image.ndim != 4:
            raise RunnerError(f"expected an image [B,C,H,W] or [C,H,W], got {tuple(image.shape)}", "")
        return self._resize(image, self.image_size)

    def _resize(self, frames: torch.Tensor, size: Tuple[int, int]) -> torch.Tensor:
        if tuple(frames.shape[-2:]) == tuple(size):
            return frames
        lead = frames.shape[:-3]
        flat = frames.reshape(-1, *frames.shape[-3:])
        resize = self.settings.image_resize
        flat = F.interpolate(flat, size=tuple(size), mode=resize.mode, align_corners=resize.align_corners,
                             antialias=resize.antialias)
        return flat.reshape(*lead, *flat.shape[-3:])


def _scalar(value: Any) -> Any:
    return value.item() if isinstance(value, torch.Tensor) else value


def _sliced(value: Any, index: int, size: int) -> Any:
    """mf:357-362: per-environment slices of a batched value."""
    if size == 1:
        return value
    if isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape[0] == size:
        return value[index:index + 1]
    if isinstance(value, (list, tuple)) and len(value) == size:
        return value[index]
    return value


def _batch_device(batch: Dict[str, Any]) -> torch.device:
    for value in batch.values():
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")
