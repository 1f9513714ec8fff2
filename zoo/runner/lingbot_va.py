"""LingBot-VA's host loop: LeRobot 0.6.1's ``LingBotVAPolicy`` around the artifact's methods, its host arithmetic
line for line (the action queue, keyframe buffering, the denoising loops with CFG, KV feedback, slot choice and
eviction). The line references to LeRobot's source are in docs/host-loops.md.
"""

from __future__ import annotations

from collections import deque
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from zoo.contract.host_settings import LingBotVAHostSettings, ScheduleTables
from zoo.core.errors import RunnerError
from zoo.runner.slots import HostSlotAllocator
from zoo.runner.base import Batch, PolicyRunner


# The DiT methods, which read and write the KV pool.
DIT_METHODS = ("video_step", "action_step")


class LingBotVARunner(PolicyRunner):
    policy_type = "lingbot_va"
    family = "lingbot_va"

    @classmethod
    def device_state(cls, settings: LingBotVAHostSettings) -> Dict[str, Dict[str, str]]:
        # The KV pool goes from every DiT call to the next (k_pool_next -> k_pool; in the "buffer" layout it stays
        # inside the methods), the causal caches from every VAE call to the next (each cache output has its
        # input's name).
        state: Dict[str, Dict[str, str]] = {}
        if settings.kv_pool.layout == "io":
            pool = {"k_pool_next": "k_pool", "v_pool_next": "v_pool"}
            state = {"video_step": dict(pool), "action_step": dict(pool)}
        vae = settings.vae
        if vae:
            caches = {name: name for name in vae.cache}
            state.update({vae.first_method: dict(caches), vae.step_method: dict(caches)})
        if settings.prompt_method:  # the prompt's K/V, made once per prompt, read by every DiT call
            state[settings.prompt_method] = {"text_k": "text_k", "text_v": "text_v"}
        return state

    @classmethod
    def episode_steps(cls, settings: LingBotVAHostSettings, chunks: int) -> int:
        # The first chunk drops its conditioning frame's actions ((F - 1) x apf), later ones are F x apf long.
        frames, apf = settings.frame_chunk_size, settings.action.action_per_frame
        return (frames - 1) * apf + (int(chunks) - 1) * frames * apf + 1

    def _configure(self) -> None:
        s: LingBotVAHostSettings = self.settings
        if s.vae is None:
            raise RunnerError(f"the run in {self.run.path} has no streaming VAE methods, so encoding observations "
                              "would need PyTorch model code on this side",
                              "export the recipe with vae_encode_first and vae_encode in unit.methods")
        pool = s.kv_pool
        self.pool_inside = pool.layout == "buffer"
        if self.pool_inside:
            self._require_one_pool(pool.buffer_names())
        elif pool.layout != "io":
            raise RunnerError(f"kv_pool layout {pool.layout!r} is not one zoo.runner knows", "export the run again")
        cams = s.cameras
        if cams.layout != "width_concat":
            raise RunnerError(f"camera layout {cams.layout!r} is not supported by zoo.runner yet",
                              "only width_concat (cameras side by side) is reproduced")
        self.frames = s.frame_chunk_size
        self.apf = s.action.action_per_frame
        self.action_dim = s.action.action_dim
        self.used = list(s.action.used_action_channel_ids)
        self.chunk_size = s.chunk_size
        self.patch = list(s.video.patch_size)
        _, _, self.latent_h, self.latent_w = s.video.latent_shape
        self.exec_step = s.video.exec_step
        self.use_cfg = s.cfg.enabled
        self.video_scale = s.cfg.video_guidance_scale
        self.action_scale = s.cfg.action_guidance_scale
        self.batch = s.batch
        self.video_sched = _Scheduler(s.scheduler.video)
        self.action_sched = _Scheduler(s.scheduler.action)
        self.cam_keys = list(cams.keys)
        self.size = (cams.height, cams.width)
        self.hflip = cams.image_hflip
        vae = s.vae
        self.vae_first, self.vae_step = vae.first_method, vae.step_method
        self.vae_frames = vae.frames_per_call
        self.vae_cache_names = list(vae.cache)
        self.keyframe_stride = vae.keyframe_stride
        self.pool_shape = list(pool.shape)
        self.video_tokens = pool.video_slots_per_step
        self.action_tokens = pool.action_slots_per_step
        self.allocator = HostSlotAllocator(pool.tokens)
        self.noise_shapes = (tuple(s.noise.video_shape), tuple(s.noise.action_shape))
        mask = torch.zeros([self.action_dim], dtype=torch.bool)  # m:701-705
        mask[self.used] = True
        self.action_mask = mask
        self.prompt_method = s.prompt_method

    def _require_one_pool(self, names: List[str]) -> None:
        """Layout "buffer": the pool is mutable buffers inside both DiT methods, which must be one copy, or
        ``action_step`` would attend over a pool ``video_step`` never wrote into."""
        problem = self.backend.sharing_problem(DIT_METHODS, names)
        if problem:
            raise RunnerError(f"kv_pool layout 'buffer': the {self.backend.name} backend does not give "
                              f"{' and '.join(DIT_METHODS)} one KV pool: {problem}",
                              "run it on a backend that shares it (eager; artifact; executorch with a zoo_runner "
                              "built with weight sharing across methods, scripts/build_runtime.sh, over a run "
                              "lowered by this zoo, which gives both methods one constant table), or export "
                              "with lowering.kv_pool=io")

    # --- per-episode state (m:153-193) -----------------------------------------------------------------------

    def _reset(self) -> None:
        self._queue: deque = deque(maxlen=self.chunk_size)
        self._obs_buffer: List[Dict[str, torch.Tensor]] = []
        self._executed_actions: Optional[torch.Tensor] = None
        self._started = False
        self._exec_step = 0
        self._prev_j = 0
        self._frame_st_id = 0
        self._first_chunk = True
        self._prompt_embeds: Optional[torch.Tensor] = None
        self._negative_prompt_embeds: Optional[torch.Tensor] = None
        self._init_latent: Optional[torch.Tensor] = None
        self._vae_cache: Optional[List[torch.Tensor]] = None
        self.allocator.reset()
        self._pools: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self._prompt_kv: Optional[Tuple[torch.Tensor, Dict[str, torch.Tensor]]] = None  # (prompt embeds, K/V)

    # --- LeRobot's select_action / predict_action_chunk ------------------------------------------------------

    def _select_action(self, batch: Batch) -> torch.Tensor:  # m:403-436
        self._maybe_init_prompt(batch)
        if not self._started:
            self._started = True
            actions = self._predict_action_chunk(batch)
            self._queue.extend(actions.transpose(0, 1))
            self._obs_buffer = []
            self._exec_step = 0
        else:
            if (self._prev_j + 1) % self.keyframe_stride == 0:
                self._obs_buffer.append(self._extract_raw_obs(batch))
            if len(self._queue) == 0:
                actions = self._predict_action_chunk(None)
                self._queue.extend(actions.transpose(0, 1))
                self._exec_step = 0
        self._prev_j = self._exec_step % self.apf
        self._exec_step += 1
        return self._queue.popleft()

    def _predict_action_chunk(self, batch: Optional[Batch]) -> torch.Tensor:  # m:439-476
        self._maybe_init_prompt(batch)
        is_first = self._first_chunk
        if is_first:
            if batch is None:
                raise RunnerError("the first chunk of an episode needs an observation", "pass the observation batch")
            init_latent = self._encode_frames([self._extract_raw_obs(batch)])
            self._init_latent = init_latent
            self._init_streaming_cache()
            self._obs_buffer = []
            actions, _ = self._infer(init_latent, frame_st_id=0)
            self._first_chunk = False
        else:
            self._compute_kv_cache(self._obs_buffer, self._executed_actions)
            self._obs_buffer = []
            actions, _ = self._infer(None, frame_st_id=self._frame_st_id)
        self._executed_actions = actions
        self.chunks_predicted += 1
        a = actions[:, self.used]
        if is_first:
            a = a[:, :, 1:]  # frame 0 is the conditioning frame: its actions are dropped
        a = a.squeeze(-1).flatten(2).transpose(1, 2).contiguous()
        return a.to(torch.float32)

    # --- prompt (m:479-485) ----------------------------------------------------------------------------------

    def _maybe_init_prompt(self, batch: Optional[Batch]) -> None:
        if self._prompt_embeds is not None or batch is None:
            return
        task = batch.get("task")
        prompt = task[0] if isinstance(task, (list, tuple)) else task
        embedding = self.prompt_for(task=prompt or "")
        self._prompt_embeds = embedding.tensors["prompt_embeds"].to(self.device, self.dtype)
        if self.use_cfg:
            if "negative_prompt_embeds" not in embedding.tensors:
                raise RunnerError("this policy runs CFG but the prompt file has no negative (empty) prompt embedding",
                                  "compute the file again with python -m zoo prompt for this run")
            self._negative_prompt_embeds = embedding.tensors["negative_prompt_embeds"].to(self.device, self.dtype)

    # --- observations and the streaming VAE (m:526-576) ------------------------------------------------------

    def _extract_raw_obs(self, batch: Batch) -> Dict[str, torch.Tensor]:
        missing = [k for k in self.cam_keys if k not in batch]
        if missing:
            raise RunnerError(f"the observation lacks camera(s) {missing}", f"LingBot-VA reads {self.cam_keys}")
        return {k: batch[k].detach() for k in self.cam_keys}

    def _camera_frame(self, raw: Dict[str, torch.Tensor], key: str) -> torch.Tensor:
        img = raw[key]
        if img.dim() == 3:
            img = img.unsqueeze(0)
        img = img.to(self.device, torch.float32)
        if self.hflip:
            img = torch.flip(img, dims=[-1])
        img = F.interpolate(img, size=self.size, mode="bilinear", align_corners=False)
        img = img * 2.0 - 1.0
        return img.unsqueeze(2).to(self.dtype)

    def _encode_frames(self, raw_frames: List[Dict[str, torch.Tensor]]) -> torch.Tensor:
        per_cam = [torch.cat([self._camera_frame(fb, k) for fb in raw_frames], dim=2) for k in self.cam_keys]
        videos = torch.cat(per_cam, dim=0).to(self.dtype)  # [cameras, 3, T, H, W]
        count = videos.shape[2]
        if self._vae_cache is None:
            if count != 1:
                raise RunnerError(f"the episode's first VAE call encodes {count} frames; the artifact's first call "
                                  "takes 1", "this is a zoo.runner bug")
            out = self.call(self.vae_first, frames=videos)
        else:
            if count % self.vae_frames:
                raise RunnerError(f"{count} buffered keyframes are not a multiple of {self.vae_frames}, the frames "
                                  "one streaming VAE call takes", "this policy configuration is not supported yet")
            latents = []
            for start in range(0, count, self.vae_frames):
                cache = dict(zip(self.vae_cache_names, self._vae_cache))
                out = self.call(self.vae_step, frames=videos[:, :, start:start + self.vae_frames], **cache)
                latents.append(out["latent"])
                self._vae_cache = [out[n] for n in self.vae_cache_names]
            return torch.cat(latents, dim=2)
        self._vae_cache = [out[n] for n in self.vae_cache_names]
        return out["latent"]

    # --- the KV pool (m:613-628) -----------------------------------------------------------------------------

    def _init_streaming_cache(self) -> None:
        # Every slot is invisible again. A pool inside the methods ("buffer" layout) keeps the last episode's K/V:
        # a masked slot contributes exactly zero to the attention as long as it holds finite values, which K/V
        # computed by the model are, and a slot is always written before it is made visible. So it is not
        # cleared: there is nothing to clear it with in ExecuTorch's runtime, and the backends stay alike.
        self.allocator.reset()
        if self.pool_inside:
            return
        # Made by the backend: the ExecuTorch one zeroes the pool where it lives, without a transfer.
        self._pools = (self.backend.zeros("k_pool", self.pool_shape, self.dtype),
                       self.backend.zeros("v_pool", self.pool_shape, self.dtype))

    def _step(self, method: str, inputs: Dict[str, torch.Tensor], update_cache: int) -> torch.Tensor:
        """One transformer call: slots chosen as LeRobot's cache chooses them, the pool in and out (or, in the
        "buffer" layout, written where it lives, inside the methods)."""
        tokens = self.video_tokens if method == "video_step" else self.action_tokens
        slots, visible = self.allocator.begin(tokens)
        text = self._text_inputs(inputs["text_emb"])  # fixed for the episode
        inputs = {**{k: v for k, v in inputs.items() if k != "text_emb"}, **text}
        pools = {} if self.pool_inside else {"k_pool": self._pools[0], "v_pool": self._pools[1]}
        out = self.call(method, slots=slots, visible=visible, **pools, **inputs)
        self.allocator.finish(slots, update_cache)
        if not self.pool_inside:
            self._pools = (out["k_pool_next"], out["v_pool_next"])
        return out["noise_pred" if method == "video_step" else "action_noise_pred"]

    def _text_inputs(self, text_emb: torch.Tensor) -> Dict[str, torch.Tensor]:
        """What a DiT call takes of the prompt, fixed for the episode: the embedding itself, held by the backend, or,
        when the run computes the prompt's K/V in a method of its own, those, made once per prompt."""
        if not self.prompt_method:
            return {"text_emb": self.backend.hold("text_emb", text_emb)}
        # Keyed by the episode's prompt embedding, which text_emb is made from in every call: comparing the
        # tensors themselves would wait for the GPU in every call.
        if self._prompt_kv is None or self._prompt_kv[0] is not self._prompt_embeds:
            out = self.call(self.prompt_method, text_emb=text_emb)
            self._prompt_kv = (self._prompt_embeds, {"text_k": out["text_k"], "text_v": out["text_v"]})
        return self._prompt_kv[1]

    # --- m:630-699 -------------------------------------------------------------------------------------------

    def _repeat_input_for_cfg(self, d: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        if self.use_cfg:
            d["noisy_latents"] = d["noisy_latents"].repeat(2, 1, 1, 1, 1)
            d["text_emb"] = torch.cat([self._prompt_embeds.to(self.dtype).clone(),
                                       self._negative_prompt_embeds.to(self.dtype).clone()], dim=0)
            d["grid_id"] = d["grid_id"][None].repeat(2, 1, 1)
            d["timesteps"] = d["timesteps"][None].repeat(2, 1)
        else:
            d["grid_id"] = d["grid_id"][None]
            d["timesteps"] = d["timesteps"][None]
        return d

    def _prepare_latent_input(self, latent_in, action_in, latent_t=0, action_t=0, latent_cond=None,
                              action_cond=None, frame_st_id=0) -> Dict[str, Dict[str, torch.Tensor]]:
        p = self.patch
        out: Dict[str, Dict[str, torch.Tensor]] = {}
        if latent_in is not None:
            out["video"] = {
                "noisy_latents": latent_in,
                "timesteps": torch.ones([latent_in.shape[2]], dtype=torch.float32, device=self.device) * latent_t,
                "grid_id": get_mesh_id(latent_in.shape[-3] // p[0], latent_in.shape[-2] // p[1],
                                       latent_in.shape[-1] // p[2], 0, 1, frame_st_id).to(self.device),
                "text_emb": self._prompt_embeds.to(self.dtype).clone(),
            }
            if latent_cond is not None:
                out["video"]["noisy_latents"][:, :, 0:1] = latent_cond[:, :, 0:1]
                out["video"]["timesteps"][0:1] *= 0
        if action_in is not None:
            out["action"] = {
                "noisy_latents": action_in,
                "timesteps": torch.ones([action_in.shape[2]], dtype=torch.float32, device=self.device) * action_t,
                "grid_id": get_mesh_id(action_in.shape[-3], action_in.shape[-2], action_in.shape[-1], 1, 1,
                                       frame_st_id, action=True).to(self.device),
                "text_emb": self._prompt_embeds.to(self.dtype).clone(),
            }
            if action_cond is not None:
                out["action"]["noisy_latents"][:, :, 0:1] = action_cond[:, :, 0:1]
                out["action"]["timesteps"][0:1] *= 0
            out["action"]["noisy_latents"][:, ~self.action_mask] *= 0
        return out

    # --- KV feedback (m:717-746) -----------------------------------------------------------------------------

    def _compute_kv_cache(self, obs_buffer, executed_actions) -> None:
        if not obs_buffer or executed_actions is None:
            return
        self.allocator.clear_predictions()
        latent = self._encode_frames(obs_buffer)
        if self._frame_st_id == 0 and self._init_latent is not None:
            latent = torch.cat([self._init_latent, latent], dim=2)
        if latent.shape[2] != self.frames:
            raise RunnerError(f"{latent.shape[2]} latent frames to feed back, the artifact takes {self.frames}",
                              "this keyframe schedule is not supported yet")
        actions = executed_actions.to(self.device, self.dtype).to(latent)
        d = self._prepare_latent_input(latent, actions, frame_st_id=self._frame_st_id)
        self._step("video_step", self._repeat_input_for_cfg(d["video"]), update_cache=2)
        self._step("action_step", self._repeat_input_for_cfg(d["action"]), update_cache=2)
        self._frame_st_id += latent.shape[2]

    # --- the denoising loops (m:750-834) ---------------------------------------------------------------------

    def _infer(self, init_latent: Optional[torch.Tensor], frame_st_id: int = 0):
        latents = torch.randn(*self.noise_shapes[0], device=self.device, dtype=self.dtype)
        actions = torch.randn(*self.noise_shapes[1], device=self.device, dtype=self.dtype)
        timesteps = F.pad(self.video_sched.timesteps, (0, 1), mode="constant", value=0)
        if self.exec_step != -1:
            timesteps = timesteps[: self.exec_step]
        action_timesteps = F.pad(self.action_sched.timesteps, (0, 1), mode="constant", value=0)

        for i, t in enumerate(timesteps):
            last_step = i == len(timesteps) - 1
            latent_cond = (init_latent[:, :, 0:1].to(self.dtype)
                           if frame_st_id == 0 and init_latent is not None else None)
            d = self._prepare_latent_input(latents, None, t, t, latent_cond, None, frame_st_id=frame_st_id)
            pred = self._step("video_step", self._repeat_input_for_cfg(d["video"]), 1 if last_step else 0)
            if not last_step or self.exec_step != -1:
                pred = data_seq_to_patch(self.patch, pred, self.frames, self.latent_h, self.latent_w, self.batch)
                if self.video_scale > 1:
                    pred = pred[1:] + self.video_scale * (pred[:1] - pred[1:])
                else:
                    pred = pred[:1]
                latents = self.video_sched.step(pred, t, latents)
            if frame_st_id == 0 and latent_cond is not None:
                latents[:, :, 0:1] = latent_cond

        for i, t in enumerate(action_timesteps):
            last_step = i == len(action_timesteps) - 1
            action_cond = (torch.zeros([1, self.action_dim, 1, self.apf, 1], device=self.device, dtype=self.dtype)
                           if frame_st_id == 0 else None)
            d = self._prepare_latent_input(None, actions, t, t, None, action_cond, frame_st_id=frame_st_id)
            pred = self._step("action_step", self._repeat_input_for_cfg(d["action"]), 1 if last_step else 0)
            if not last_step:
                # einops "b (f n) c -> b c f n 1"
                b, length, c = pred.shape
                pred = pred.reshape(b, self.frames, length // self.frames, c).permute(0, 3, 1, 2).unsqueeze(-1)
                if self.action_scale > 1:
                    pred = pred[1:] + self.action_scale * (pred[:1] - pred[1:])
                else:
                    pred = pred[:1]
                actions = self.action_sched.step(pred, t, actions)
            if frame_st_id == 0 and action_cond is not None:
                actions[:, :, 0:1] = action_cond

        actions[:, ~self.action_mask] *= 0
        return actions, latents


class _Scheduler:
    """``FlowMatchScheduler.step`` (u:257-267) over the float32 tables ``set_timesteps`` made at export."""

    def __init__(self, tables: ScheduleTables):
        self.sigmas = torch.tensor(tables.sigmas, dtype=torch.float32)
        self.timesteps = torch.tensor(tables.timesteps, dtype=torch.float32)

    def step(self, model_output: torch.Tensor, timestep: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        if isinstance(timestep, torch.Tensor):
            timestep = timestep.cpu()
        timestep_id = torch.argmin((self.timesteps - timestep).abs())
        sigma = self.sigmas[timestep_id]
        sigma_ = 0 if timestep_id + 1 >= len(self.timesteps) else self.sigmas[timestep_id + 1]
        return sample + model_output * (sigma_ - sigma)


def get_mesh_id(f, h, w, t, f_w=1, f_shift=0, action=False) -> torch.Tensor:
    """u:82-96: the (frame, row, column, stream) ids the rotary embedding is indexed by."""
    f_idx = torch.arange(f_shift, f + f_shift) * f_w
    h_idx = torch.arange(h)
    w_idx = torch.arange(w)
    ff, hh, ww = torch.meshgrid(f_idx, h_idx, w_idx, indexing="ij")
    if action:
        ff_offset = (torch.ones([h]).cumsum(0) / (h + 1)).view(1, -1, 1)
        ff = ff + ff_offset
        hh = torch.ones_like(hh) * -1
        ww = torch.ones_like(ww) * -1
    grid_id = torch.cat([ff.unsqueeze(0), hh.unsqueeze(0), ww.unsqueeze(0)], dim=0).flatten(1)
    return torch.cat([grid_id, torch.full_like(grid_id[:1], t)], dim=0)


def data_seq_to_patch(patch_size, data_seq, frames, height, width, batch_size=1) -> torch.Tensor:
    """u:67-79: a flattened patch sequence back to a ``(B, C, F, H, W)`` latent grid."""
    p_t, p_h, p_w = patch_size
    data = data_seq.reshape(batch_size, frames // p_t, height // p_h, width // p_w, p_t, p_h, p_w, -1)
    data = data.permute(0, 7, 1, 4, 2, 5, 3, 6)
    return data.flatten(6, 7).flatten(4, 5).flatten(2, 3)
