"""LingBot-VA's streaming VAE methods (zoo/policies/lingbot_va/vae.py) against LeRobot's own
``WanVAEStreamingWrapper.encode_chunk`` over an episode: the first frame, then 12 and 16 buffered keyframes in
one call each (LeRobot) against 3 and 4 calls of 4 frames with the cache passed through (zoo).

The VAE is diffusers' ``AutoencoderKLWan`` in the Wan2.2 layout at toy width, every weight redrawn (none left
at its init), with non-trivial latents_mean/std so the normalisation is checked too.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lerobot")

from zoo.export.pipeline import apply_rewrites  # noqa: E402
from zoo.export.lower.preflight import check_kernels  # noqa: E402
from zoo.contract.recipes import load_recipe  # noqa: E402

vae_stream = pytest.importorskip("zoo.policies.lingbot_va.vae")

pytestmark = pytest.mark.policies

H = W = 64
CAMS = 2


@pytest.fixture(scope="module")
def vae():
    from diffusers import AutoencoderKLWan

    g = torch.Generator().manual_seed(1)
    model = AutoencoderKLWan(
        base_dim=4, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=1, temperal_downsample=[False, True, True],
        is_residual=True, in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
        scale_factor_temporal=4, latents_mean=torch.randn(48, generator=g).tolist(),
        latents_std=(0.5 + torch.rand(48, generator=g)).tolist()).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / max(1, p[0].numel()) ** 0.5)
    return model


@pytest.fixture(scope="module")
def methods(vae):
    conv, shapes = vae_stream.cache_layout(vae, [CAMS, 3, 1, H, W], torch.float32)
    first = vae_stream.StreamingVaeEncode(vae, True, conv).eval()
    step = vae_stream.StreamingVaeEncode(vae, False, conv).eval()
    return first, step, conv, shapes


def lerobot_episode(vae, clips):
    """What LingBotVAPolicy._encode_frames computes, with LeRobot's own streaming wrapper."""
    from lerobot.policies.lingbot_va.utils import WanVAEStreamingWrapper

    wrapper = WanVAEStreamingWrapper(vae)
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    inv_std = (1.0 / torch.tensor(vae.config.latents_std)).view(1, -1, 1, 1, 1)
    out = []
    with torch.no_grad():
        for clip in clips:
            mu = torch.chunk(wrapper.encode_chunk(clip), 2, dim=1)[0]
            norm = ((mu.float() - mean) * inv_std).to(mu)
            out.append(torch.cat(norm.split(1, dim=0), dim=-1))
    return out


def zoo_episode(first, step, clips):
    with torch.no_grad():
        latent, *cache = first(clips[0])
        out = [latent]
        for clip in clips[1:]:
            parts = []
            for start in range(0, clip.shape[2], vae_stream.FRAMES_PER_CALL):
                part, *cache = step(clip[:, :, start:start + vae_stream.FRAMES_PER_CALL], *cache)
                parts.append(part)
            out.append(torch.cat(parts, dim=2))
    return out, cache


def clips():
    g = torch.Generator().manual_seed(2)
    return [torch.rand(CAMS, 3, n, H, W, generator=g) * 2 - 1 for n in (1, 12, 16, 16)]


def test_cache_layout(methods):
    _, _, conv, shapes = methods
    # conv_in, 2 per residual block (4 down blocks x 1 + mid block 2), conv_out; two temporal downsamplers.
    assert len(conv) == 16 and conv.count(False) == 2
    assert all(s[2] == (2 if c else 1) for c, s in zip(conv, shapes))
    assert all(s[0] == CAMS for s in shapes)


def test_streaming_methods_match_lerobot(vae, methods):
    first, step, _, shapes = methods
    data = clips()
    want = lerobot_episode(vae, data)
    got, cache = zoo_episode(first, step, data)
    assert [list(c.shape) for c in cache] == shapes
    for a, b, frames in zip(got, want, (1, 3, 4, 4)):
        assert a.shape == b.shape == (1, 48, frames, H // 16, CAMS * W // 16)
        assert float((a - b).norm() / b.norm()) <= 1e-6


def test_first_call_is_not_a_later_call(vae, methods):
    """The first call has its own program: a later call with an all-zero cache gives another latent."""
    first, step, _, shapes = methods
    frame = clips()[0]
    with torch.no_grad():
        a = first(frame)[0]
        zero = [torch.zeros(s) for s in shapes]
        b = step(frame.repeat(1, 1, 4, 1, 1), *zero)[0]
    assert float((a - b).norm() / a.norm()) > 1e-2


@pytest.mark.e2e  # the default run exports, rewrites and preflights these methods in the shared lingbot-va-tiny run
def test_methods_export_rewrite_and_need_no_fallback_kernel(vae, methods):
    first, step, _, shapes = methods
    data = clips()
    with torch.no_grad():
        cache = first(data[0])[1:]
        ep_first = torch.export.export(first, (data[0],), strict=False)
        ep_step = torch.export.export(step, (data[1][:, :, :4], *cache), strict=False)
    recipe = load_recipe("lingbot-va-tiny")
    programs = {}
    for name, ep in (("vae_encode_first", ep_first), ("vae_encode", ep_step)):
        programs[name], _ = apply_rewrites(ep, recipe, name)
    with torch.no_grad():
        want = step(data[1][:, :, :4], *cache)
        got = programs["vae_encode"].module()(data[1][:, :, :4], *cache)
    for a, b in zip(got, want):
        # The middle block's attention is written out (replace_triton_unsafe_sdpa_with_math): the same math in
        # another order of float32 operations; everything else is bit for bit.
        assert float((a.double() - b.double()).norm() / b.double().norm()) < 1e-6
    # conv3d goes to Inductor's conv3d Triton template; the chunk()s became views (replace_view_copies).
    result = check_kernels(programs, "1.2", triton_kernel_mode="OFF")
    assert result.ok, result.table()
