"""LeRobot's real policy classes built on meta (zoo.policies.fast_init) against LeRobot's own
``from_pretrained`` (random initialisation, then ``load_state_dict``), from the same tiny checkpoint.

Every tensor a policy holds must be the same: the state_dict (values, dtypes, ``requires_grad``), every
buffer, and the plain tensor attributes the constructors compute (Wan's rope tables), for a float32 unit
(the bf16 file cast on load) and a bf16 unit (the file's tensors used as read).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("lerobot")
pytestmark = pytest.mark.policies

from huggingface_hub import snapshot_download  # noqa: E402

from zoo.export.hub_cache import hub_environment, put_in_cache  # noqa: E402
from zoo.policies import load_family
from zoo.policies import fast_init  # noqa: E402
from zoo.contract.recipes import load_recipe  # noqa: E402


def fabricated(family, recipe, root: Path):
    repos = family.fabricate_checkpoint(recipe, root / "fabricated")
    cache = root / "cache"
    for repo_id, folder in repos.items():
        put_in_cache(repo_id, folder, cache)
    with hub_environment(cache, offline=True):
        return cache, Path(snapshot_download(recipe.source.repo_id))


def every_tensor(*modules) -> dict:
    out = {}
    for i, module in enumerate(modules):
        out.update({f"{i}:sd:{k}": v for k, v in module.state_dict(keep_vars=True).items()})
        out.update({f"{i}:buf:{k}": v for k, v in module.named_buffers(remove_duplicate=False)})
        out.update({f"{i}:attr:{k}": v for k, v in fast_init.plain_tensor_attributes(module).items()})
    return out


def assert_same_tensors(normal: dict, fast: dict) -> None:
    assert sorted(normal) == sorted(fast)
    assert len(normal) > 20
    for name, a in normal.items():
        b = fast[name]
        assert b.device.type == "cpu", name
        assert (a.dtype, tuple(a.shape), a.requires_grad) == (b.dtype, tuple(b.shape), b.requires_grad), name
        assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lingbot_va_built_on_meta_holds_what_from_pretrained_gives(tmp_path, dtype):
    from lerobot.policies.lingbot_va import LingBotVAPolicy
    from lerobot.policies.lingbot_va.utils import WanTransformer3DModel

    lingbot_va = load_family("lingbot_va")
    recipe = load_recipe("lingbot-va-tiny", [f"unit.dtype={dtype}"])
    cache, checkpoint = fabricated(lingbot_va, recipe, tmp_path)
    with hub_environment(cache, offline=True):
        torch.manual_seed(0)
        normal = lingbot_va.load_policy(checkpoint, recipe)
        torch.manual_seed(1)
        with fast_init.built_on_meta(LingBotVAPolicy, [WanTransformer3DModel]):
            fast = lingbot_va.load_policy(checkpoint, recipe)
    assert fast_init.same_structure(normal, fast) == []
    assert_same_tensors(every_tensor(normal), every_tensor(fast))
    assert fast.transformer.rope.f_freqs_base.dtype == torch.float64  # computed, not loaded


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fast_wam_built_on_meta_holds_what_from_pretrained_gives(tmp_path, dtype):
    from lerobot.policies.fastwam.modeling_fastwam import FastWAMPolicy
    from lerobot.policies.fastwam.wan import ActionDiT, WanVideoDiT

    fast_wam = load_family("fast_wam")
    recipe = load_recipe("fast-wam-tiny", [f"unit.dtype={dtype}"])
    cache, checkpoint = fabricated(fast_wam, recipe, tmp_path)
    with hub_environment(cache, offline=True):
        torch.manual_seed(0)
        normal = fast_wam.load_policy(checkpoint, dtype)
        torch.manual_seed(1)
        with fast_init.built_on_meta(FastWAMPolicy, [WanVideoDiT, ActionDiT]):
            fast = fast_wam.load_policy(checkpoint, dtype)
    assert fast_init.same_structure(normal, fast) == []
    # The experts are plain attributes of FastWAM (mot owns their blocks); the VAE is loaded by diffusers,
    # outside the meta scope, and must be the real one.
    parts = lambda p: (p, p.model.video_expert, p.model.action_expert, p.model.vae)  # noqa: E731
    assert_same_tensors(every_tensor(*parts(normal)), every_tensor(*parts(fast)))
    assert fast.model.video_expert.freqs.dtype == torch.complex128  # computed, not loaded


def seeded_builds(name: str, tmp_path: Path, builds):
    """The tiny policy built with seeded weights (no file read) per (dtype, draw dtype) of ``builds``, each
    from another global torch seed (what the constructors draw outside the meta classes must not matter)."""
    family = load_family(name)
    recipe = load_recipe({"fast_wam": "fast-wam-tiny", "lingbot_va": "lingbot-va-tiny"}[name])
    cache, checkpoint = fabricated(family, recipe, tmp_path)
    if name == "fast_wam":
        from lerobot.policies.fastwam.modeling_fastwam import FastWAMPolicy as policy_cls
        from lerobot.policies.fastwam.wan import ActionDiT, WanVideoDiT
        classes = [WanVideoDiT, ActionDiT]
        load = lambda dtype: family.load_policy(checkpoint, dtype)  # noqa: E731
        parts = lambda p: (p, p.model.video_expert, p.model.action_expert, p.model.vae)  # noqa: E731
    else:
        from lerobot.policies.lingbot_va import LingBotVAPolicy as policy_cls
        from lerobot.policies.lingbot_va.utils import WanTransformer3DModel
        classes = [WanTransformer3DModel]
        load = lambda dtype: family.load_policy(checkpoint, load_recipe("lingbot-va-tiny",  # noqa: E731
                                                                        [f"unit.dtype={dtype}"]))
        parts = lambda p: (p,)  # noqa: E731
    out = {}
    with hub_environment(cache, offline=True):
        for seed, (dtype, draw_dtype) in enumerate(builds):
            torch.manual_seed(seed)
            with fast_init.built_on_meta(policy_cls, classes), fast_init.seeded_weights(7, draw_dtype=draw_dtype):
                out[dtype, draw_dtype] = every_tensor(*parts(load(dtype)))
    return out


@pytest.mark.parametrize("name", ["fast_wam", "lingbot_va"])
def test_seeded_weights_drawn_in_bf16_make_the_float32_policy_the_bf16_policy_upcast(tmp_path, name):
    """The bf16 rule's reference (LeRobot's policy in float32) at real size holds seeded weights: drawn in
    bf16, the float32 policy is the bf16 policy with every filled weight upcast exactly, and every other
    floating tensor is the bf16 one before rounding (Fast-WAM's VAE, read from its tiny repo in float32).
    For a bf16 build, drawing in bf16 is drawing as without a draw dtype: the lowered unit's weights."""
    bf16, f32 = torch.bfloat16, torch.float32
    builds = seeded_builds(name, tmp_path, [("bfloat16", bf16), ("float32", bf16), ("bfloat16", None)])
    low, wide, low_own = builds["bfloat16", bf16], builds["float32", bf16], builds["bfloat16", None]
    assert sorted(low) == sorted(wide) == sorted(low_own) and len(low) > 20
    for key, a in low.items():
        b = wide[key]
        assert torch.equal(low_own[key], a), key
        if not a.is_floating_point() or a.dtype == torch.float64:
            assert torch.equal(a, b), key  # computed in a fixed dtype: the same in both builds
            continue
        assert a.dtype in (bf16, f32) and b.dtype == f32, key
        assert torch.equal(b.to(a.dtype), a), key  # the bf16 build holds the float32 build's values rounded
        if not key.startswith("3:"):  # all but the VAE (not part of the policy's state_dict): exact
            assert torch.equal(b, a.to(f32)), key
    filled = [k for k, a in low.items() if k.startswith("0:sd:") and a.dtype == bf16]
    assert len(filled) > 20


@pytest.mark.parametrize("name", ["fast_wam", "lingbot_va"])
def test_the_policy_checks_reference_holds_the_units_seeded_weights_without_reading_the_file(tmp_path, name):
    """At real size the policy check has no weights file (bench_chunk's placeholder checkpoint holds an empty
    model.safetensors): the unit and LeRobot's policy (``lerobot_policy``, the check's reference) are both
    filled under ``fast_init.seeded_weights`` and must hold the same values. A reference that reads the file
    instead fails strict loading (Fast-WAM's did, on the H200's first real-size check)."""
    from safetensors.torch import save_file

    family = load_family(name)
    recipe = load_recipe({"fast_wam": "fast-wam-tiny", "lingbot_va": "lingbot-va-tiny"}[name])
    cache, fabricated_checkpoint = fabricated(family, recipe, tmp_path)
    checkpoint = tmp_path / "placeholder"
    checkpoint.mkdir()
    for path in fabricated_checkpoint.iterdir():  # the snapshot's links, read through
        (checkpoint / path.name).write_bytes(path.read_bytes())
    save_file({}, str(checkpoint / "model.safetensors"))

    def seeded(build):
        with torch.random.fork_rng(devices=[]), fast_init.seeded_weights(7, draw_dtype=torch.float32):
            torch.manual_seed(7)
            return build()

    # The policy build_unit cuts the unit's methods out of.
    unit_build = {"fast_wam": lambda: family.load_policy(checkpoint, recipe.unit.dtype),
                  "lingbot_va": lambda: family.load_policy(checkpoint, recipe)}[name]
    with hub_environment(cache, offline=True):
        unit_values = seeded(unit_build).state_dict()
        reference_values = seeded(lambda: family.lerobot_policy(checkpoint, recipe)[0]).state_dict()
    shared = sorted(set(unit_values) & set(reference_values))
    assert len(shared) > 20
    for key in shared:
        assert torch.equal(unit_values[key], reference_values[key]), key
