"""LingBot-VA's streaming Wan2.2 VAE encode as two exportable methods, the causal feature cache passed in and out
(explicit tensors, like LingBot's KV pool), so the deploy side runs no PyTorch model code."""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
from torch import nn

# LeRobot encodes observations with ``WanVAEStreamingWrapper.encode_chunk`` (lingbot_va/utils.py:1110-1137):
# diffusers' causal encoder (``WanEncoder3d.forward(x, feat_cache, feat_idx)``) keeps, per causal conv, the last
# frames it saw in a Python list that persists across calls (reset per episode).
# The episode's first call: one frame per camera, every cache entry empty; out come the latent and the cache.
FIRST_METHOD = "vae_encode_first"
# A later call: FRAMES_PER_CALL frames per camera, cache in, latent and new cache out. LeRobot encodes 12 or 16
# buffered keyframes in one call; the host calls this 3 or 4 times instead, which is the same computation: each
# causal conv sees the same frame windows (its cache carries the 2 frames before them), the stride-2 time
# convolutions start on the same frames (4 is a multiple of the whole temporal downsample), and the attention in
# the middle block is per frame. It is also how diffusers' own ``AutoencoderKLWan._encode`` chunks a video
# (autoencoder_kl_wan.py:1143-1153).
STEP_METHOD = "vae_encode"
FRAMES_PER_CALL = 4  # the Wan2.2 VAE's temporal downsample


class StreamingVaeEncode(nn.Module):
    """One ``encode_chunk`` call with the feature cache as tensors (``first``: the episode's first call).

    It also does what LeRobot does around ``encode_chunk``: the 2x2 pixel patchify (inside ``encode_chunk``),
    the posterior mean, the latent normalisation ``(mu - latents_mean) * (1 / latents_std)``
    (``_normalize_vae_latent``, modeling_lingbot_va.py:545-552) and the cameras side by side on width
    (``_encode_frames``, :574-575). The host hands it the frames as ``_camera_frame`` makes them: resized, in
    [-1, 1], in the model's dtype, cameras stacked on the batch axis.
    """

    def __init__(self, vae: nn.Module, first: bool, conv_cache: Sequence[bool]):
        super().__init__()
        from lerobot.policies.lingbot_va.utils import _vae_patchify

        self.encoder = vae.encoder
        self.quant_conv = vae.quant_conv
        self.patch_size = vae.config.patch_size
        self.first = bool(first)
        # Per cache entry: True for a causal conv (kept at 2 frames), False for a temporal downsampler (1 frame).
        self.conv_cache = [bool(c) for c in conv_cache]
        object.__setattr__(self, "_patchify", _vae_patchify)
        # As _normalize_vae_latent builds them: float32 tensors from the config lists, and 1 / std.
        mean = torch.tensor(vae.config.latents_mean)
        self.register_buffer("latents_mean", mean.view(1, -1, 1, 1, 1), persistent=False)
        self.register_buffer("latents_inv_std", (1.0 / torch.tensor(vae.config.latents_std)).view(1, -1, 1, 1, 1),
                             persistent=False)

    def forward(self, frames: torch.Tensor, *cache: torch.Tensor):
        feat_cache: List = [None] * len(self.conv_cache) if self.first else list(cache)
        x = self._patchify(frames, self.patch_size)
        enc = self.quant_conv(self.encoder(x, feat_cache=feat_cache, feat_idx=[0]))
        mu = torch.chunk(enc, 2, dim=1)[0]
        latent = ((mu.float() - self.latents_mean) * self.latents_inv_std).to(mu)
        cams, channels, frames_out, h, w = latent.shape
        # torch.cat(latent.split(1, dim=0), dim=-1): camera c at columns [c*w, (c+1)*w).
        latent = latent.permute(1, 2, 3, 0, 4).reshape(1, channels, frames_out, h, cams * w)
        out = []
        for entry, is_conv in zip(feat_cache, self.conv_cache):
            # The cache has a fixed shape so it can be an input: every 3x3x3 conv's entry holds 2 frames. After
            # the first call diffusers holds only 1 there; a zero frame in front of it is exactly equivalent,
            # because the conv pads its input with that many zero frames when its cache is short
            # (``WanCausalConv3d.forward``, autoencoder_kl_wan.py:166-173). Temporal downsamplers hold 1 either way.
            if is_conv and entry.shape[2] == 1:
                entry = torch.cat([torch.zeros_like(entry), entry], dim=2)
            out.append(entry)
        return (latent, *out)


def cache_layout(vae: nn.Module, frames_shape: Sequence[int], dtype: torch.dtype) -> Tuple[List[bool], List[List[int]]]:
    """Which cache entries the encoder uses, whether each is a causal conv's, and their shapes in a later call.

    Read off two calls of diffusers' encoder (a first frame, then FRAMES_PER_CALL frames), so the layout
    follows the VAE's real structure: ``frames_shape`` is ``[cameras, 3, 1, H, W]``. The calls run on fake
    tensors (shapes only): at real size the first eager bf16 call of the 0.7 B-parameter encoder alone took 307 s
    of the build on a 2-core CPU; on fake tensors both take about a second."""
    from lerobot.policies.lingbot_va.utils import _vae_patchify
    from torch._subclasses.fake_tensor import FakeTensorMode

    count = sum(1 for m in vae.encoder.modules() if m.__class__.__name__ == "WanCausalConv3d")
    feat_cache: List = [None] * count
    cams, channels, _, height, width = frames_shape
    with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
        first = torch.zeros(cams, channels, 1, height, width, dtype=dtype)
        vae.encoder(_vae_patchify(first, vae.config.patch_size), feat_cache=feat_cache, feat_idx=[0])
        after_first = [None if c is None else int(c.shape[2]) for c in feat_cache]
        later = torch.zeros(cams, channels, FRAMES_PER_CALL, height, width, dtype=dtype)
        vae.encoder(_vae_patchify(later, vae.config.patch_size), feat_cache=feat_cache, feat_idx=[0])
    used = [i for i, c in enumerate(feat_cache) if c is not None]
    if used != list(range(len(used))):
        raise ValueError(f"the VAE encoder uses cache entries {used}, not a prefix: zoo cannot pass them as a list")
    # A temporal downsampler keeps the whole first input (1 frame) and then 1 frame; a conv keeps up to 2.
    conv = [int(feat_cache[i].shape[2]) == 2 for i in used]
    if any(after_first[i] != 1 for i in used):
        raise ValueError("the VAE encoder's first call left a cache entry that is not 1 frame: unexpected layout")
    return conv, [list(feat_cache[i].shape) for i in used]
