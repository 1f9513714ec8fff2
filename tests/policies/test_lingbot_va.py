"""LingBot-VA's export unit against LeRobot's own stateful eager code, on a fabricated tiny checkpoint.

The checkpoint is fabricated once per module (tests/support/lingbot_va_tiny.py: seeded, LeRobot's real repo
layout), put into a private Hub cache and pulled offline, exactly as the pipeline does for tiny recipes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("lerobot")
pytestmark = pytest.mark.policies

from safetensors.torch import load_file, save_file  # noqa: E402

from zoo.contract.host_settings import Guidance  # noqa: E402
from zoo.core.errors import PullError, RecipeError, ZooError  # noqa: E402
from zoo.export.hub_cache import folder_commit, hub_environment  # noqa: E402
from zoo.core.numerics import compare  # noqa: E402
from zoo.policies.lingbot_va.checkpoint import fabricated_config  # noqa: E402
from zoo.policies.lingbot_va.pool import PoolStep  # noqa: E402
from zoo.policies.lingbot_va.recipe import validate_recipe  # noqa: E402
from zoo.runner.slots import HostSlotAllocator  # noqa: E402
from zoo.contract.recipes import load_recipe  # noqa: E402

from support.lingbot_va_tiny import (RECIPE, TEXT_EMB_STEPS, fabricated_hub as _fabricated_hub,  # noqa: E402
                                     lerobot_sequence, lingbot_va, step_inputs as _step_inputs)

LAYOUTS = ("io", "buffer")


# The tiny recipe has one head (a small bundle); the head axis of the pool and attention is checked at two.
TWO_HEADS = ["unit.options.policy_config.num_attention_heads=2"]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return _fabricated_hub(tmp_path_factory.mktemp("lingbot_hub"))


def build(hub, checkpoint, recipe):
    """build_unit as the pipeline runs it: the repos the policy loads by Hub id (the VAE its streaming encode
    methods take, UMT5, tokenizer) served from the fabricated cache, offline."""
    with hub_environment(hub[0], offline=True):
        return lingbot_va.build_unit(checkpoint, recipe)


@pytest.fixture(scope="module")
def two_head_unit(tmp_path_factory):
    cache, checkpoint, _ = _fabricated_hub(tmp_path_factory.mktemp("lingbot_hub_2h"), TWO_HEADS)
    with hub_environment(cache, offline=True):
        return lingbot_va.build_unit(checkpoint, load_recipe(RECIPE, TWO_HEADS + TEXT_EMB_STEPS))


@pytest.fixture(scope="module")
def units(hub):
    """The recipe's units in both pool layouts, with DiT steps that take the prompt's embedding (LeRobot's own
    transformer call; the steps that take prompt_kv's K/V instead: test_lingbot_va_prompt_kv.py)."""
    cache, checkpoint, _ = hub
    built = {}
    with hub_environment(cache, offline=True):
        for layout in LAYOUTS:
            recipe = load_recipe(RECIPE, [f"lowering.kv_pool={layout}"] + TEXT_EMB_STEPS)
            built[layout] = lingbot_va.build_unit(checkpoint, recipe)
    return built


@pytest.fixture(scope="module")
def exported(units):
    """The DiT steps of both layouts, exported (the VAE methods have their own tests: test_lingbot_va_vae.py)."""
    programs = {}
    for layout, unit in units.items():
        if layout == "buffer":
            _zero_pools(unit)  # the artifact's pool starts empty, whatever earlier tests wrote
        for name in lingbot_va.DIT_METHODS:
            method = unit.methods[name]
            with torch.no_grad():
                programs[layout, name] = torch.export.export(method.module, method.example_inputs({}, seed=0),
                                                             strict=False)
    return programs


def _zero_pools(unit):
    """Empty the KV pool buffers of the DiT steps (the VAE methods have none)."""
    for method in unit.methods.values():
        if isinstance(method.module, PoolStep):
            for layer in [*method.module.pool_layers()[0], *method.module.pool_layers()[1]]:
                layer.zero_()


def _stacked(module):
    """A "buffer"-layout step's per-layer K and V buffers, stacked as the "io" layout's pools ``[layers, ...]``."""
    k_layers, v_layers = module.pool_layers()
    return torch.stack(k_layers), torch.stack(v_layers)


# ---------------------------------------------------------------------------------------------- pulling


def test_fabricated_checkpoint_is_deterministic_and_in_the_real_layout(hub, tmp_path):
    _, checkpoint, repos = hub
    recipe = load_recipe(RECIPE)
    assert set(repos) == {recipe.source.repo_id, "robbyant/lingbot-va-base"}
    again = lingbot_va.fabricate_checkpoint(recipe, tmp_path)
    assert {k: folder_commit(v) for k, v in again.items()} == {k: folder_commit(v) for k, v in repos.items()}
    names = {p.name for p in checkpoint.iterdir()}
    assert {"config.json", "model.safetensors", "policy_preprocessor.json", "policy_postprocessor.json",
            "policy_postprocessor_step_0_unnormalizer_processor.safetensors"} <= names
    assert json.loads((checkpoint / "config.json").read_text())["type"] == "lingbot_va"
    frozen = repos["robbyant/lingbot-va-base"]
    assert {p.name for p in frozen.iterdir()} == {"vae", "text_encoder", "tokenizer"}


def test_offline_load_gives_the_file_weights_and_the_cached_frozen_models(hub, units):
    cache, checkpoint, _ = hub
    unit = units["io"]
    policy = unit.reference().policy
    on_file = load_file(str(checkpoint / "model.safetensors"))
    state = policy.state_dict()
    assert set(on_file) == set(state)
    assert all(torch.equal(state[k], on_file[k]) for k in on_file)
    # The frozen VAE/UMT5/tokenizer come by Hub id through diffusers/transformers; offline they must resolve
    # from the cache hub_environment points at (the tiny UMT5 is recognisable by its width).
    with hub_environment(cache, offline=True):
        policy._ensure_frozen_modules()
    assert policy._frozen["text_encoder"].config.d_model == policy.config.text_dim == 64
    assert policy._frozen["vae"].config.z_dim == 48
    assert [p.name for p in unit.host_files] == [
        "policy_postprocessor.json", "policy_postprocessor_step_0_unnormalizer_processor.safetensors",
        "policy_preprocessor.json", "policy_preprocessor_step_2_normalizer_processor.safetensors"]


def _copy_checkpoint(checkpoint: Path, dest: Path) -> Path:
    shutil.copytree(checkpoint, dest)
    return dest


def test_wrong_policy_type_raises_pull_error(hub, tmp_path):
    ckpt = _copy_checkpoint(hub[1], tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    config["type"] = "act"
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(PullError, match="'act' policy"):
        build(hub, ckpt, load_recipe(RECIPE))


@pytest.mark.parametrize("damage", ["missing", "mis-shaped", "truncated"])
def test_damaged_weights_raise_pull_error(hub, tmp_path, damage):
    ckpt = _copy_checkpoint(hub[1], tmp_path / "ckpt")
    path = ckpt / "model.safetensors"
    tensors = load_file(str(path))
    name = "transformer.blocks.1.attn1.to_k.weight"
    if damage == "missing":
        del tensors[name]
        save_file(tensors, str(path))
    elif damage == "mis-shaped":
        tensors[name] = tensors[name][:, :-1].contiguous()
        save_file(tensors, str(path))
    else:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(PullError, match="do not load into LingBot-VA") as info:
        build(hub, ckpt, load_recipe(RECIPE))
    if damage != "truncated":
        assert name in str(info.value)


def test_checkpoint_that_does_not_match_the_recipe_raises_pull_error(hub):
    recipe = load_recipe(RECIPE, ["unit.options.policy_config.attn_window=30"])
    with pytest.raises(PullError, match="attn_window=4"):
        build(hub, hub[1], recipe)
    recipe = load_recipe(RECIPE, ["inputs.pool_tokens=100"])
    with pytest.raises(PullError, match="pool_tokens=100 \\(the checkpoint gives 96\\)"):
        build(hub, hub[1], recipe)


@pytest.mark.parametrize("override, message", [
    ("unit.options.kv_pool_tokens=8", "Key 'kv_pool_tokens' not in 'LingbotVaOptions'"),  # refused at load
    ("unit.options.policy_config.num_layer=2", "unknown field"),
    ("inputs.seq_len=8", "unknown inputs"),
    ("inputs.batch=0", "not a positive integer"),
    ("unit.methods=[video_step,prefill]", "not valid for LingBot-VA"),
    ("unit.dtype=float64", "not supported by LingBot-VA"),
    ("dynamic.frames={min: 2, max: 8}", "only static shapes"),
])
def test_bad_recipe_raises_recipe_error(hub, override, message):
    with pytest.raises(RecipeError, match=message):
        build(hub, hub[1], load_recipe(RECIPE, [override]))


def test_attn_mode_from_the_checkpoint_is_overridden_to_torch(hub, tmp_path):
    from lerobot.policies.lingbot_va.utils import custom_sdpa

    ckpt = _copy_checkpoint(hub[1], tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    config["attn_mode"] = "flex"  # what fine-tuned checkpoints carry: training needs flex attention
    (ckpt / "config.json").write_text(json.dumps(config))
    unit = build(hub, ckpt, load_recipe(RECIPE))
    transformer = unit.methods["video_step"].module.transformer
    assert all(block.attn2.attn_op is custom_sdpa for block in transformer.blocks)


def test_real_recipe_states_the_sizes_of_its_policy_config_and_the_tiny_one_keeps_its_structure():
    real, tiny = load_recipe("lingbot-va"), load_recipe(RECIPE)
    config = fabricated_config(real, validate_recipe(real))
    with torch.device("meta"):  # 5.09 B parameters: build the real-size policy without memory
        policy = lingbot_va.LingBotVAPolicy(config)
    layout = lingbot_va._layout(policy)
    # LIBERO (policies.md 2.1): 128 video + 16 action tokens per step, pool 15*128 + 15*16, CFG batch 2.
    assert (layout.video_tokens, layout.action_tokens, layout.pool_tokens, layout.batch) == (128, 16, 2160, 2)
    assert layout.pool == [30, 2, 2160, 24, 128]
    lingbot_va._check_inputs(real, layout, Path("lerobot/lingbot_va_libero_long"))  # raises on a mismatch
    same = ("attention_head_dim", "patch_size", "in_channels", "out_channels", "action_dim", "camera_layout",
            "frame_chunk_size", "action_per_frame")
    real_config, tiny_config = real.unit.options.policy_config, tiny.unit.options.policy_config
    assert {k: real_config[k] for k in same} == {k: tiny_config[k] for k in same}
    # The same rewrites but for the float64 treatment: float32 pairs narrow all float64 math, float64 pairs
    # keep it and only split the float64 constants.
    assert real.rotary_pairs == "float32" and tiny.rotary_pairs == "float64"
    swap = {"split_float64_constants": "narrow_float64"}
    assert real.rewrites == [swap.get(r, r) for r in tiny.rewrites] and real.unit.methods == tiny.unit.methods
    assert real.lowering.kv_pool == tiny.lowering.kv_pool == "io"
    assert tiny.lowering.triton_kernel_mode == "OFF" and tiny.source.fabricate


# ---------------------------------------------------------------------------------------------- the unit


def test_unit_shapes_and_host_settings_follow_the_checkpoint(units):
    unit = units["io"]
    # The recipe's five methods: the prompt's cross-attention K/V, the streaming VAE encode (first call, later
    # calls) and one DiT step per stream; these units leave prompt_kv out (the fixture says why).
    assert load_recipe(RECIPE).unit.methods == ["prompt_kv", "vae_encode_first", "vae_encode", "video_step",
                                                "action_step"]
    assert list(unit.methods) == ["vae_encode_first", "vae_encode", "video_step", "action_step"]
    settings = unit.host_settings
    json.dumps(settings.to_json())  # must be plain JSON
    # Tiny: 2 layers, CFG batch 2, pool = (attn_window // 2) * (32 video + 16 action tokens), 2 heads x 128.
    assert settings.kv_pool.shape == [2, 2, 96, 1, 128]
    assert settings.kv_pool.layout == "io"
    assert (settings.video.num_inference_steps, settings.action.num_inference_steps) == (20, 50)
    assert (settings.video.snr_shift, settings.action.snr_shift) == (5.0, 0.05)
    assert settings.cfg == Guidance(enabled=True, rows=["prompt", "negative_prompt"], video_guidance_scale=5.0,
                                    action_guidance_scale=1.0)
    assert settings.action.used_action_channel_ids == list(range(7))
    video = {s.name: s for s in unit.methods["video_step"].inputs}
    action = {s.name: s for s in unit.methods["action_step"].inputs}
    assert video["noisy_latents"].shape == [2, 48, 4, 4, 8]  # 64x64 per camera, two cameras side by side
    assert video["slots"].shape == [32] and action["slots"].shape == [16]
    assert (video["grid_id"].dtype, action["grid_id"].dtype) == ("int64", "float32")
    assert unit.methods["video_step"].output_names == ["noise_pred", "k_pool_next", "v_pool_next"]
    assert units["buffer"].methods["action_step"].output_names == ["action_noise_pred"]
    # The eager cache LeRobot creates has exactly the pool's size.
    steps = unit.reference()
    assert tuple(steps.cache(0)["k"].shape) == (2, 96, 1, 128)


def test_host_slot_allocator_hand_worked_case():
    alloc = HostSlotAllocator(6)
    slots, visible = alloc.begin(2)
    assert slots.tolist() == [0, 1] and not visible.any()
    alloc.finish(slots, 2)  # feedback: kept, id 0
    slots, visible = alloc.begin(3)
    assert slots.tolist() == [2, 3, 4] and visible.tolist() == [True, True, False, False, False, False]
    alloc.finish(slots, 1)  # last denoising step: kept as a prediction, id 1
    # 3 tokens, 1 free slot: the two oldest entries (id 0, slots 0 and 1) are evicted, lowest free first.
    slots, visible = alloc.begin(3)
    assert slots.tolist() == [0, 1, 5] and visible.tolist() == [False, False, True, True, True, False]
    alloc.finish(slots, 0)  # not kept; the eviction stands (LeRobot's restore_cache only unmarks the new slots)
    assert alloc.mask.tolist() == [False, False, True, True, True, False]
    alloc.clear_predictions()  # slots 2-4 were predictions
    assert not alloc.mask.any()
    with pytest.raises(ZooError, match="pool too small"):
        alloc.begin(7)
    with pytest.raises(ZooError, match="update_cache must be 0, 1 or 2"):
        alloc.finish(slots, 3)




@pytest.mark.parametrize("layout", [*LAYOUTS, "io, 2 heads"])
def test_unit_matches_lerobot_stateful_calls_over_a_sequence(units, layout, request):
    unit = units[layout] if layout in units else request.getfixturevalue("two_head_unit")
    layout = layout.split(",")[0]
    eager = unit.reference()  # LeRobot's own transformer calls with its own KV cache
    pool = unit.host_settings.kv_pool
    alloc = HostSlotAllocator(pool.tokens)
    shape = pool.shape
    k_pool, v_pool = torch.zeros(shape), torch.zeros(shape)
    if layout == "buffer":
        _zero_pools(unit)
    g = torch.Generator().manual_seed(7)
    text = torch.randn(2, 16, 64, generator=g)  # [prompt; negative prompt] UMT5 embeddings
    evicted = False
    for step in lerobot_sequence(eager, alloc, pool, g, text):
        latents, timesteps, grid, slots, visible = step.latents, step.timesteps, step.grid, step.slots, step.visible
        method, update, ref = step.method, step.update, step.ref
        evicted |= step.evicted
        module = unit.methods[method].module
        with torch.no_grad():
            if layout == "io":
                got, k_pool, v_pool = module(latents, timesteps, grid, text, slots, visible, k_pool, v_pool)
            else:
                got = module(latents, timesteps, grid, text, slots, visible)
                k_pool, v_pool = _stacked(module)
        alloc.finish(slots, update)
        result = compare(f"{method} u={update}", got, ref)
        assert result.rel_l2 < 1e-5, result
        for layer in range(shape[0]):
            cache = eager.cache(layer)
            assert torch.equal(cache["mask"], alloc.mask)  # the host allocator made LeRobot's choices
            valid = alloc.mask
            assert torch.equal(cache["k"][:, valid], k_pool[layer][:, valid])
            assert torch.equal(cache["v"][:, valid], v_pool[layer][:, valid])
    assert evicted, "the sequence was meant to overflow the pool"
    # The pool is really read: hiding one committed slot changes the prediction.
    latents, timesteps, grid = _step_inputs("action_step", 12, g)
    ref = eager("action_step", latents, timesteps, grid, text, 0)
    slots, visible = alloc.begin(16)
    hidden = visible.clone()
    hidden[visible.nonzero()[0]] = False
    with torch.no_grad():
        args = (k_pool.clone(), v_pool.clone()) if layout == "io" else ()
        got = unit.methods["action_step"].module(latents, timesteps, grid, text, slots, hidden, *args)
    got = got[0] if layout == "io" else got
    assert compare("hidden slot", got, ref).rel_l2 > 1e-4


def test_bf16_unit_is_cast_as_lerobot_casts_and_matches_its_eager_calls(hub):
    recipe = load_recipe(RECIPE, ["unit.dtype=bfloat16"] + TEXT_EMB_STEPS)
    unit = build(hub, hub[1], recipe)
    eager = unit.reference()
    # LingBotVAPolicy casts the whole transformer, fp32-kept modules included (modeling_lingbot_va.py:95).
    assert {p.dtype for p in eager.policy.transformer.parameters()} == {torch.bfloat16}
    specs = {s.name: s.dtype for s in unit.methods["video_step"].inputs}
    assert specs == {"noisy_latents": "bfloat16", "timesteps": "float32", "grid_id": "int64", "text_emb": "bfloat16",
                     "slots": "int64", "visible": "bool", "k_pool": "bfloat16", "v_pool": "bfloat16"}
    alloc = HostSlotAllocator(96)
    k_pool = torch.zeros(unit.host_settings.kv_pool.shape, dtype=torch.bfloat16)
    v_pool = torch.zeros_like(k_pool)
    g = torch.Generator().manual_seed(3)
    text = torch.randn(2, 16, 64, generator=g).bfloat16()
    for method, update, tokens in (("video_step", 1, 32), ("action_step", 0, 16)):
        latents, timesteps, grid = _step_inputs(method, 0, g)
        latents = latents.bfloat16()
        ref = eager(method, latents, timesteps, grid, text, update)
        slots, visible = alloc.begin(tokens)
        with torch.no_grad():
            got, k_pool, v_pool = unit.methods[method].module(latents, timesteps, grid, text, slots, visible,
                                                              k_pool, v_pool)
        alloc.finish(slots, update)
        assert got.dtype == torch.bfloat16
        # Same bf16 arithmetic as LeRobot's; a unit left in float32 would differ by bf16 rounding (~1e-2).
        assert compare(method, got, ref).rel_l2 < 1e-3


# ---------------------------------------------------------------------------------------------- export


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("method", ["video_step", "action_step"])
def test_method_exports_and_matches_eager(units, exported, layout, method):
    unit = units[layout]
    program = exported[layout, method]
    hops = [n for n in program.graph.nodes if n.op == "call_function" and "wrap_with" in str(n.target)]
    assert not hops  # exported under no_grad: rope's inner no_grad leaves no grad-mode HOP
    writes = [n for n in program.graph.nodes if n.op == "call_function"
              and n.target in (torch.ops.aten.index_copy.default, torch.ops.aten.index_copy_.default)]
    assert len(writes) == 1 + 2 * 2  # the mask's new slots + K and V of each of the 2 layers
    spec = unit.methods[method]
    inputs = spec.example_inputs({}, seed=11)  # fresh valid values drawn from the InputSpecs alone
    module = program.module()
    if layout == "io":
        with torch.no_grad():
            ref = spec.module(*inputs)
            got = module(*inputs)
        for name, a, b in zip(spec.output_names, got, ref):
            assert compare(name, a, b).rel_l2 < 1e-5
        return
    _zero_pools(unit)
    with torch.no_grad():
        ref = spec.module(*inputs)
    ref_k, ref_v = _stacked(spec.module)
    # Both pools empty again before the exported call (whether or not it holds its own copy of the buffers).
    _zero_pools(unit)
    names = unit.host_settings.kv_pool.buffer_names()
    assert sorted(name for name, _ in module.named_buffers()) == sorted(names)  # one K and one V per layer
    for name in names:
        module.get_buffer(name).zero_()
    with torch.no_grad():
        got = module(*inputs)
    assert compare(method, got, ref).rel_l2 < 1e-5
    # The exported program writes the step's K/V into its pool buffers, as the eager unit does.
    assert bool(ref_k.abs().sum() > 0)
    assert compare("k_pool", torch.stack([module.get_buffer(n) for n in names[0::2]]), ref_k).rel_l2 < 1e-5
    assert compare("v_pool", torch.stack([module.get_buffer(n) for n in names[1::2]]), ref_v).rel_l2 < 1e-5


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("method", ["video_step", "action_step"])
def test_complex_rewrite_leaves_no_complex_and_matches_eager(units, exported, layout, method):
    pytest.importorskip("zoo.rewrites.complex_to_real")
    from zoo.rewrites import get

    before = [n for n in exported[layout, method].graph.nodes
              if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dtype.is_complex]
    assert before  # polar, view_as_complex, complex mul of the rope
    result = get("replace_complex_with_real")(exported[layout, method], complex128_as="float64")
    assert result.declined is None and result.changed
    program = result.program
    left = [n.name for n in program.graph.nodes
            if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dtype.is_complex]
    assert left == []
    state = list(program.state_dict.values()) + list(program.constants.values())
    assert not [t for t in state if isinstance(t, torch.Tensor) and t.dtype.is_complex]
    spec = units[layout].methods[method]
    inputs = spec.example_inputs({}, seed=12)
    if layout == "buffer":
        _zero_pools(units[layout])
    with torch.no_grad():
        ref = spec.module(*inputs)
        got = program.module()(*inputs)
    pairs = zip(got, ref) if layout == "io" else [(got, ref)]
    for a, b in pairs:
        # polar is rebuilt as (cos, sin) of eager's float32 angle and widened: float64 pairs track eager's
        # complex128 rotation to float32 rounding.
        assert compare(method, a, b).rel_l2 < 1e-6
