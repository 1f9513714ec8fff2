"""Hand-written host settings and io specs, one per family, with the JSON each must be written as.

The values are made up (small, distinct numbers) and the JSON beside each is typed out by hand, so a test that
round-trips them checks the on-disk shape against an independent statement of it, not against zoo's own output.
"""

from __future__ import annotations

from typing import Any, Dict

from zoo.contract.host_settings import (ActionStream, Cameras, FastWAMHostSettings, FastWAMNoise, Guidance,
                                        ImageResize, KvPool, LingBotNoise, LingBotVAHostSettings, LlamaHostSettings,
                                        ObservationFeature, ScheduleTables, Scheduler, StreamingVae, TextEncoder,
                                        VideoStream)
from zoo.contract.io_spec import DynamicDim, InputSpec, IoSpec, MethodIo


def llama_settings() -> LlamaHostSettings:
    return LlamaHostSettings(vocab_size=256, max_seq_len=64, logits_dtype="float32", bos_token_id=1,
                             eos_token_id=[2, 7], rope_theta=500000.0)


LLAMA_JSON: Dict[str, Any] = {"format": 1, "family": "llama", "vocab_size": 256, "max_seq_len": 64,
                              "logits_dtype": "float32", "bos_token_id": 1, "eos_token_id": [2, 7],
                              "rope_theta": 500000.0}


def lingbot_va_settings() -> LingBotVAHostSettings:
    return LingBotVAHostSettings(
        dtype="bfloat16",
        kv_pool=KvPool(layout="io", shape=[2, 2, 96, 1, 128], tokens=96, video_slots_per_step=32,
                       action_slots_per_step=16),
        batch=2,
        cfg=Guidance(enabled=True, rows=["prompt", "negative_prompt"], video_guidance_scale=5.0,
                     action_guidance_scale=1.5),
        video=VideoStream(num_inference_steps=3, snr_shift=5.0, exec_step=1, latent_shape=[48, 2, 4, 8],
                          patch_size=[1, 2, 2], tokens_per_step=32),
        action=ActionStream(num_inference_steps=2, snr_shift=0.05, action_dim=30, used_action_channel_ids=[0, 1, 2],
                            action_per_frame=8, tokens_per_step=16),
        scheduler=Scheduler(num_train_timesteps=1000, sigma_min=0.0, sigma_max=1.0, extra_one_step=True,
                            video_shift=5.0, action_shift=0.05, append_zero_step=True,
                            video=ScheduleTables(sigmas=[1.0, 0.5, 0.25], timesteps=[1000.0, 500.0, 250.0]),
                            action=ScheduleTables(sigmas=[1.0, 0.5], timesteps=[1000.0, 500.0])),
        noise=LingBotNoise(generator="global", dtype="bfloat16", video_shape=[1, 48, 2, 4, 8],
                           action_shape=[1, 30, 2, 8, 1]),
        frame_chunk_size=2,
        chunk_size=16,
        attn_window=4,
        text=TextEncoder(max_sequence_length=12, text_dim=64, frozen_components="org/wan-parts"),
        observation_features={"observation.images.cam_high": ObservationFeature(type="VISUAL", shape=[3, 16, 16]),
                              "observation.state": ObservationFeature(type="STATE", shape=[14])},
        cameras=Cameras(keys=["observation.images.cam_high"], layout="width_concat", height=16, width=16,
                        image_hflip=False),
        vae=StreamingVae(first_method="vae_encode_first", step_method="vae_encode", frames_per_call=4,
                         cache=["vae_cache_0", "vae_cache_1"], keyframe_stride=2),
        prompt_method="prompt_kv",
    )


LINGBOT_VA_JSON: Dict[str, Any] = {
    "format": 1, "family": "lingbot_va", "dtype": "bfloat16",
    "kv_pool": {"layout": "io", "shape": [2, 2, 96, 1, 128], "tokens": 96, "video_slots_per_step": 32,
                "action_slots_per_step": 16},
    "batch": 2,
    "cfg": {"enabled": True, "rows": ["prompt", "negative_prompt"], "video_guidance_scale": 5.0,
            "action_guidance_scale": 1.5},
    "video": {"num_inference_steps": 3, "snr_shift": 5.0, "exec_step": 1, "latent_shape": [48, 2, 4, 8],
              "patch_size": [1, 2, 2], "tokens_per_step": 32},
    "action": {"num_inference_steps": 2, "snr_shift": 0.05, "action_dim": 30, "used_action_channel_ids": [0, 1, 2],
               "action_per_frame": 8, "tokens_per_step": 16},
    "scheduler": {"num_train_timesteps": 1000, "sigma_min": 0.0, "sigma_max": 1.0, "extra_one_step": True,
                  "video_shift": 5.0, "action_shift": 0.05, "append_zero_step": True,
                  "video": {"sigmas": [1.0, 0.5, 0.25], "timesteps": [1000.0, 500.0, 250.0]},
                  "action": {"sigmas": [1.0, 0.5], "timesteps": [1000.0, 500.0]}},
    "noise": {"generator": "global", "dtype": "bfloat16", "video_shape": [1, 48, 2, 4, 8],
              "action_shape": [1, 30, 2, 8, 1]},
    "frame_chunk_size": 2, "chunk_size": 16, "attn_window": 4,
    "text": {"max_sequence_length": 12, "text_dim": 64, "frozen_components": "org/wan-parts"},
    "observation_features": {"observation.images.cam_high": {"type": "VISUAL", "shape": [3, 16, 16]},
                             "observation.state": {"type": "STATE", "shape": [14]}},
    "cameras": {"keys": ["observation.images.cam_high"], "layout": "width_concat", "height": 16, "width": 16,
                "image_hflip": False},
    "vae": {"first_method": "vae_encode_first", "step_method": "vae_encode", "frames_per_call": 4,
            "cache": ["vae_cache_0", "vae_cache_1"], "keyframe_stride": 2},
    "prompt_method": "prompt_kv",
}


def fast_wam_settings() -> FastWAMHostSettings:
    return FastWAMHostSettings(
        layout="split", num_inference_steps=2, sigma_shift=None, effective_sigma_shift=3.0,
        timesteps=[1000.0, 600.0], deltas=[-0.4, -0.6], action_horizon=8, n_action_steps=4, action_dim=7,
        proprio_dim=9, image_size=[32, 64],
        observation_features={"observation.images.image": ObservationFeature(type="VISUAL", shape=[3, 4, 6]),
                              "observation.state": ObservationFeature(type="STATE", shape=[8])},
        image_features={"observation.images.image": [3, 32, 64]},
        image_resize=ImageResize(mode="bilinear", align_corners=False, antialias=True),
        vae_method="vae_encode", first_frame_latent_shape=[1, 48, 1, 2, 4], video_grid=[1, 1, 2], context_len=10,
        text_dim=32, prompt_template="{task}", tokenizer_model_id="org/tok", tokenizer_max_len=10,
        text_encoder_model_id="org/enc", vae_model_id="org/vae",
        noise=FastWAMNoise(shape=[1, 8, 7], dtype="float32", generator_device="cpu", seed=42, cast_to="bfloat16"),
        normalization_mapping={"ACTION": "MEAN_STD"}, toggle_action_dimensions=[6],
    )


FAST_WAM_JSON: Dict[str, Any] = {
    "format": 1, "family": "fast_wam", "layout": "split", "num_inference_steps": 2, "sigma_shift": None,
    "effective_sigma_shift": 3.0, "timesteps": [1000.0, 600.0], "deltas": [-0.4, -0.6], "action_horizon": 8,
    "n_action_steps": 4, "action_dim": 7, "proprio_dim": 9, "image_size": [32, 64],
    "observation_features": {"observation.images.image": {"type": "VISUAL", "shape": [3, 4, 6]},
                             "observation.state": {"type": "STATE", "shape": [8]}},
    "image_features": {"observation.images.image": [3, 32, 64]},
    "image_resize": {"mode": "bilinear", "align_corners": False, "antialias": True},
    "vae_method": "vae_encode", "first_frame_latent_shape": [1, 48, 1, 2, 4], "video_grid": [1, 1, 2],
    "context_len": 10, "text_dim": 32, "prompt_template": "{task}", "tokenizer_model_id": "org/tok",
    "tokenizer_max_len": 10, "text_encoder_model_id": "org/enc", "vae_model_id": "org/vae",
    "noise": {"shape": [1, 8, 7], "dtype": "float32", "generator_device": "cpu", "seed": 42, "cast_to": "bfloat16"},
    "normalization_mapping": {"ACTION": "MEAN_STD"}, "toggle_action_dimensions": [6],
}


def io_spec_case() -> IoSpec:
    return IoSpec(
        dtype="bfloat16",
        methods={"video_step": MethodIo(inputs=[InputSpec("latent", "bfloat16", [2, 48, "frames", 8]),
                                                InputSpec("slots", "int64", [32], "randperm:96")],
                                        outputs=["noise_pred", "k_pool_next"])},
        dynamic={"frames": DynamicDim(min=1, max=4)},
        example_sizes={"frames": 2},
    )


IO_SPEC_JSON: Dict[str, Any] = {
    "format": 1, "dtype": "bfloat16",
    "methods": {"video_step": {
        "inputs": [{"name": "latent", "dtype": "bfloat16", "shape": [2, 48, "frames", 8], "sampler": "normal"},
                   {"name": "slots", "dtype": "int64", "shape": [32], "sampler": "randperm:96"}],
        "outputs": ["noise_pred", "k_pool_next"]}},
    "dynamic": {"frames": {"min": 1, "max": 4}},
    "example_sizes": {"frames": 2},
}
