"""LingBot-VA with the prompt's cross-attention K/V in a method of its own (zoo/policies/lingbot_va/prompt_kv.py),
judged against LeRobot's own stateful transformer calls, which compute them from text_emb in every call.

The sequence and the fabricated checkpoint are test_lingbot_va.py's; here the DiT steps take ``prompt_kv``'s
outputs. The exported programs are judged against the eager modules, and the runner against LeRobot's
``select_action`` by the policy check, in test_runner's and the pipeline's own tests of the option.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lerobot")
pytestmark = pytest.mark.policies

from zoo.contract.recipes import load_recipe  # noqa: E402
from zoo.core.errors import RecipeError  # noqa: E402
from zoo.core.numerics import compare  # noqa: E402
from zoo.export.hub_cache import hub_environment  # noqa: E402
from zoo.runner.slots import HostSlotAllocator  # noqa: E402

from support.lingbot_va_tiny import RECIPE, fabricated_hub, lerobot_sequence, lingbot_va, step_inputs  # noqa: E402

HOISTED = ["unit.methods=[prompt_kv,video_step,action_step]"]


@pytest.fixture(scope="module")
def unit(tmp_path_factory):
    cache, checkpoint, _ = fabricated_hub(tmp_path_factory.mktemp("lingbot_hub_prompt"))
    with hub_environment(cache, offline=True):
        return lingbot_va.build_unit(checkpoint, load_recipe(RECIPE, HOISTED))


def test_the_steps_take_the_prompts_k_and_v_and_the_host_settings_name_the_method(unit):
    cfg = unit.reference().policy.config
    shape = [cfg.num_layers, 2, 16, cfg.num_attention_heads, cfg.attention_head_dim]  # CFG batch 2, 16 tokens
    prompt = unit.methods["prompt_kv"]
    assert [(s.name, s.shape) for s in prompt.inputs] == [("text_emb", [2, 16, 64])]
    assert prompt.output_names == ["text_k", "text_v"]
    for method in ("video_step", "action_step"):
        specs = {s.name: s.shape for s in unit.methods[method].inputs}
        assert "text_emb" not in specs and specs["text_k"] == shape and specs["text_v"] == shape
    assert unit.host_settings.prompt_method == "prompt_kv"


def test_hoisted_steps_equal_lerobots_calls_over_a_sequence(unit):
    """Bitwise in float32: the same ops on the same values, only computed once instead of in every call."""
    eager = unit.reference()
    pool = unit.host_settings.kv_pool
    alloc = HostSlotAllocator(pool.tokens)
    k_pool, v_pool = torch.zeros(pool.shape), torch.zeros(pool.shape)
    g = torch.Generator().manual_seed(7)
    text = torch.randn(2, 16, 64, generator=g)
    with torch.no_grad():
        text_k, text_v = unit.methods["prompt_kv"].module(text)
    for step in lerobot_sequence(eager, alloc, pool, g, text):
        with torch.no_grad():
            got, k_pool, v_pool = unit.methods[step.method].module(step.latents, step.timesteps, step.grid, text_k,
                                                                   text_v, step.slots, step.visible, k_pool, v_pool)
        alloc.finish(step.slots, step.update)
        assert torch.equal(got, step.ref), compare(f"{step.method} u={step.update}", got, step.ref)
    # The given K/V are really read: another prompt's change the prediction.
    with torch.no_grad():
        other_k, other_v = unit.methods["prompt_kv"].module(torch.randn(2, 16, 64, generator=g))
        latents, timesteps, grid = step_inputs("action_step", 12, g)
        slots, visible = alloc.begin(pool.action_slots_per_step)
        same = unit.methods["action_step"].module(latents, timesteps, grid, text_k, text_v, slots, visible,
                                                  k_pool, v_pool)[0]
        other = unit.methods["action_step"].module(latents, timesteps, grid, other_k, text_v, slots, visible,
                                                   k_pool, v_pool)[0]
    assert compare("another prompt's K", other, same).rel_l2 > 1e-3


def test_the_steps_carry_no_prompt_weights_and_lerobots_transformer_is_untouched(unit):
    step = dict(unit.methods["action_step"].module.named_parameters())
    lerobot = unit.reference().policy.transformer
    every = {f"transformer.{name}" for name, _ in lerobot.named_parameters()}
    prompt_only = {n for n in every if ".attn2.to_k." in n or ".attn2.to_v." in n or ".attn2.norm_k." in n
                   or n.startswith("transformer.condition_embedder.text_embedder.")}
    assert prompt_only and set(step) == every - prompt_only
    # Shared, not copied: the step's tensors are LeRobot's.
    name = next(iter(step))
    assert step[name] is dict(lerobot.named_parameters())[name[len("transformer."):]]
    # LeRobot's own modules keep their projections and their class's forward.
    attn = lerobot.blocks[0].attn2
    assert hasattr(attn, "to_k") and "forward" not in vars(attn)
    assert type(lerobot.condition_embedder.text_embedder).__name__ != "Identity"
    prompt = dict(unit.methods["prompt_kv"].module.named_parameters())
    assert len(prompt) == len(prompt_only)


@pytest.mark.parametrize("method", ["prompt_kv", "action_step"])
def test_hoisted_methods_export_and_match_eager(unit, method):
    spec = unit.methods[method]
    inputs = spec.example_inputs({}, seed=5)
    with torch.no_grad():
        program = torch.export.export(spec.module, inputs, strict=False)
        got, ref = program.module()(*inputs), spec.module(*inputs)
    for name, a, b in zip(spec.output_names, got, ref):
        assert compare(name, a, b).rel_l2 < 1e-6


def test_prompt_kv_without_a_dit_step_is_refused():
    recipe = load_recipe(RECIPE, ["unit.methods=[prompt_kv,vae_encode_first,vae_encode]"])
    with pytest.raises(RecipeError, match="prompt_kv without a DiT step"):
        lingbot_va.check_recipe(recipe)
