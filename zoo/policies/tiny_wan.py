"""The tiny Wan2.2 VAE both DiT families fabricate under their real Hub ids (LingBot-VA and Fast-WAM), and the
real one's configuration (for real-size stand-ins with seeded random weights: benchmarks/bench_chunk.py).

It keeps the real block structure and the numbers the policies hard-code: 16x spatial and 4x temporal
compression, 48 latent channels, 12 input channels after the 2x2 patchify. Only the width is a toy's
(``base_dim`` 4 against the real 160), so the two copies a tiny bundle carries stay well under a megabyte.
The policies' constructors and full inference paths load it, and both families' VAE encode methods export it.
"""

from __future__ import annotations

Z_DIM = 48  # Wan2.2 VAE latent channels; LeRobot's LingBot-VA and Fast-WAM both hard-code it


def tiny_wan22_vae():
    """A randomly initialised ``AutoencoderKLWan`` in the Wan2.2 TI2V layout at toy width."""
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(
        base_dim=4, z_dim=Z_DIM, dim_mult=[1, 2, 4, 4], num_res_blocks=1, temperal_downsample=[False, True, True],
        is_residual=True, in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
        scale_factor_temporal=4, latents_mean=[0.0] * Z_DIM, latents_std=[1.0] * Z_DIM,
    )


# Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json (the VAE both policies load): a 160-wide encoder, a 256-wide
# decoder. The latent statistics are the checkpoint's; a random-weight stand-in keeps the identity instead.
WAN22_VAE_REAL = dict(base_dim=160, decoder_base_dim=256, z_dim=Z_DIM, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                      temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12,
                      patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4)


def real_size_wan22_vae():
    """A randomly initialised ``AutoencoderKLWan`` of the real Wan2.2 TI2V-5B size (0.7 B parameters)."""
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(**WAN22_VAE_REAL, latents_mean=[0.0] * Z_DIM, latents_std=[1.0] * Z_DIM)
