"""The llama family: Meta's complex-rotary decoder against transformers' LlamaForCausalLM on the same weights.

The reference is transformers' own model (rotate-half RoPE, eager attention) loaded from the same fabricated
HF checkpoint, and for the q/k permutation a float64 hand computation of both rotary conventions.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from zoo.core.errors import PullError, RecipeError  # noqa: E402
from zoo.export.hub_cache import folder_commit, hub_environment, put_in_cache  # noqa: E402
from zoo.core.numerics import compare  # noqa: E402
from zoo.policies.llama import unit as llama  # noqa: E402
from zoo.contract.recipes import load_recipe  # noqa: E402

pytestmark = pytest.mark.policies

TINY = "llama-rope-tiny"
SIZES = [2, 7, 33, 100, 256]  # 256 is the tiny recipe's dynamic maximum


def hf_model(folder: Path, dtype=torch.float32):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(folder), dtype=dtype, attn_implementation="eager").eval()


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens, use_cache=False).logits


def tokens(unit, seq: int, seed: int = 0) -> torch.Tensor:
    return unit.methods["forward"].example_inputs({"seq": seq}, seed=seed)[0]


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return compare("logits", got, ref).rel_l2


@pytest.fixture(scope="module")
def recipe():
    return load_recipe(TINY)


@pytest.fixture(scope="module")
def checkpoint(recipe, tmp_path_factory) -> Path:
    repos = llama.fabricate_checkpoint(recipe, tmp_path_factory.mktemp("llama-fab"))
    assert list(repos) == [recipe.source.repo_id]  # no auxiliary repos for this family
    return repos[recipe.source.repo_id]


@pytest.fixture(scope="module")
def unit(checkpoint, recipe):
    return llama.build_unit(checkpoint, recipe)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return hf_model(checkpoint)


@pytest.fixture(scope="module")
def exported(unit):
    """Exported once at a length that is neither bound nor any size the tests check it at."""
    method = unit.methods["forward"]
    dims = {"seq": torch.export.Dim("seq", min=2, max=256)}
    with torch.no_grad():
        return torch.export.export(method.module, method.example_inputs({"seq": 17}),
                                   dynamic_shapes=method.dynamic_shapes(dims), strict=False)


def corrupt_copy(checkpoint: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoint, folder)
    return folder


# ---- the permutation, against a float64 hand computation of both conventions ---------------------------


def test_permutation_maps_rotate_half_to_interleaved_pairs():
    n_heads, head_dim, dim, theta, pos = 3, 8, 5, 10000.0, 7
    g = torch.Generator().manual_seed(0)
    w_hf = torch.randn(n_heads * head_dim, dim, generator=g, dtype=torch.float64)
    x = torch.randn(dim, generator=g, dtype=torch.float64)
    half = head_dim // 2
    angles = pos * theta ** (-torch.arange(half, dtype=torch.float64) * 2 / head_dim)

    # HF: q * cos + rotate_half(q) * sin, with pair j at (j, j + half) of each head.
    q_hf = (w_hf @ x).view(n_heads, head_dim)
    cos, sin = torch.cat([angles.cos()] * 2), torch.cat([angles.sin()] * 2)
    rotated_hf = q_hf * cos + torch.cat([-q_hf[:, half:], q_hf[:, :half]], dim=-1) * sin

    # Meta: pair j at (2j, 2j+1) as one complex number, times e^{i angle}.
    q_meta = (llama.hf_to_meta_rows(w_hf, n_heads, head_dim) @ x).view(n_heads, half, 2)
    rotated_meta = torch.view_as_real(torch.view_as_complex(q_meta) * torch.polar(torch.ones_like(angles), angles))

    # Same numbers, each in its own layout: HF (real part, then imaginary) vs Meta (interleaved).
    expected = torch.stack([rotated_hf[:, :half], rotated_hf[:, half:]], dim=-1)
    assert torch.allclose(rotated_meta, expected, rtol=0, atol=1e-12)


# ---- the unit against transformers ----------------------------------------------------------------------


@pytest.mark.parametrize("seq", SIZES)
def test_unit_matches_transformers(unit, reference, seq):
    tok = tokens(unit, seq, seed=seq)
    with torch.no_grad():
        got = unit.methods["forward"].module(tok)
    assert got.shape == (1, seq, 256) and got.dtype == torch.float32
    assert rel(got, hf_logits(reference, tok)) < 1e-5


def test_unit_reference_is_transformers(unit, reference):
    tok = tokens(unit, 9, seed=1)
    (ref,) = unit.reference("forward", tok)
    assert torch.equal(ref, hf_logits(reference, tok))


def test_unit_spec_and_host_side(unit, checkpoint):
    method = unit.methods["forward"]
    assert method.module.training is False
    assert [(s.name, s.dtype, s.shape) for s in method.inputs] == [("tokens", "int64", [1, "seq"])]
    assert method.output_names == ["logits"]
    tok = tokens(unit, 256, seed=5)
    assert tok.dtype == torch.int64 and 0 <= int(tok.min()) and int(tok.max()) < 256
    assert method.module.freqs_cis.dtype == torch.complex64 and method.module.freqs_cis.shape == (256, 32)
    assert unit.host_settings.vocab_size == 256 and unit.host_settings.max_seq_len == 256
    assert checkpoint / "generation_config.json" in unit.host_files


def test_untied_checkpoint_and_legacy_config(recipe, tmp_path):
    """An untied lm_head, and a transformers-4 style config (top-level rope_theta, rope_scaling null)."""
    untied = load_recipe(TINY, ["unit.options.fabricate_config.tie_word_embeddings=false",
                                "unit.options.fabricate_config.num_hidden_layers=1"])
    folder = llama.fabricate_checkpoint(untied, tmp_path)[untied.source.repo_id]
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["rope_parameters"]
    cfg.update(rope_theta=5000.0, rope_scaling=None)  # a theta the fabricated one is not: it must be read
    (folder / "config.json").write_text(json.dumps(cfg))

    unit = llama.build_unit(folder, untied)
    assert unit.methods["forward"].module.output is not None
    model = hf_model(folder)
    assert model.config.rope_parameters["rope_theta"] == 5000.0
    for seq in (3, 40):
        tok = tokens(unit, seq, seed=seq)
        with torch.no_grad():
            assert rel(unit.methods["forward"].module(tok), hf_logits(model, tok)) < 1e-5


def test_tied_checkpoint_that_stores_its_head(checkpoint, recipe, unit, tmp_path):
    """Some tied checkpoints also store lm_head.weight; equal to the embedding, it is accepted."""
    folder = corrupt_copy(checkpoint, tmp_path)
    _edit_tensors(folder, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    tok = tokens(unit, 10, seed=8)
    with torch.no_grad():
        assert torch.equal(llama.build_unit(folder, recipe).methods["forward"].module(tok),
                           unit.methods["forward"].module(tok))


def test_bfloat16_unit(checkpoint, recipe, unit):
    bf16 = llama.build_unit(checkpoint, load_recipe(TINY, ["unit.dtype=bfloat16"]))
    module = bf16.methods["forward"].module
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    # The rotary table stays complex64 (rope runs in float32, as in Meta's code).
    assert torch.equal(module.freqs_cis, unit.methods["forward"].module.freqs_cis)
    tok = tokens(unit, 33, seed=2)
    with torch.no_grad():
        got, ref = module(tok), unit.methods["forward"].module(tok)
    c = compare("logits", got, ref)
    assert got.dtype == torch.float32
    assert 0 < c.rel_l2 < 5e-2 and c.cosine > 0.999


# ---- export and the complex rewrite ---------------------------------------------------------------------


def test_export_keeps_dynamic_length(exported, unit):
    (constraint,) = exported.range_constraints.values()
    assert (constraint.lower, constraint.upper) == (2, 256)
    program = exported.module()
    for seq in (2, 5, 100, 256):
        tok = tokens(unit, seq, seed=seq)
        with torch.no_grad():
            assert rel(program(tok), unit.methods["forward"].module(tok)) < 1e-6


def complex_values(ep) -> list:
    found = [n.name for n in ep.graph.nodes
             if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].is_complex()]
    found += [k for k, v in {**ep.state_dict, **ep.constants}.items()
              if isinstance(v, torch.Tensor) and v.is_complex()]
    return found


def test_complex_rewrite_leaves_no_complex_and_matches_eager(exported, unit, reference, recipe):
    from zoo import rewrites

    try:
        rewrite = rewrites.get("replace_complex_with_real")
    except ImportError:
        pytest.skip("zoo/rewrites/complex_to_real.py is not written yet")
    assert complex_values(exported)  # the unit really carries complex rope into the program
    result = rewrite(exported, complex128_as=recipe.rotary_pairs)
    assert result.changed and result.declined is None
    assert complex_values(result.program) == []
    program = result.program.module()
    for seq in (2, 7, 33, 100, 256):  # none of them the export length (17)
        tok = tokens(unit, seq, seed=seq)
        with torch.no_grad():
            got = program(tok)
            assert rel(got, unit.methods["forward"].module(tok)) < 1e-5
            assert rel(got, hf_logits(reference, tok)) < 1e-5


# ---- pulling through zoo's Hub cache --------------------------------------------------------------------


def test_fabricate_cache_offline_build(checkpoint, recipe, unit, tmp_path):
    from huggingface_hub import snapshot_download

    # Same seed, same bytes: the cache maps the recipe to the same commit every time.
    again = llama.fabricate_checkpoint(recipe, tmp_path / "again")[recipe.source.repo_id]
    assert folder_commit(again) == folder_commit(checkpoint)

    commit = put_in_cache(recipe.source.repo_id, checkpoint, tmp_path / "cache")
    with hub_environment(tmp_path / "cache", offline=True):
        folder = Path(snapshot_download(recipe.source.repo_id, revision=recipe.source.revision))
        # transformers reads huggingface_hub's cache constant at call time, so it finds the repo offline too.
        by_id = hf_model(recipe.source.repo_id)
    assert folder.name == commit
    pulled = llama.build_unit(folder, recipe)
    tok = tokens(unit, 21, seed=4)
    with torch.no_grad():
        got = pulled.methods["forward"].module(tok)
        assert torch.equal(got, unit.methods["forward"].module(tok))
        assert rel(got, hf_logits(by_id, tok)) < 1e-5


def test_sharded_checkpoint(checkpoint, recipe, unit, tmp_path):
    model = hf_model(checkpoint)
    model.save_pretrained(str(tmp_path / "sharded"), max_shard_size="1MB")
    assert not (tmp_path / "sharded" / "model.safetensors").exists()
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1
    sharded = llama.build_unit(tmp_path / "sharded", recipe)
    tok = tokens(unit, 12, seed=6)
    with torch.no_grad():
        assert torch.equal(sharded.methods["forward"].module(tok), unit.methods["forward"].module(tok))


# ---- bad checkpoints and recipes ------------------------------------------------------------------------


def _edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(folder: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _truncate(folder: Path) -> None:
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


BAD_CHECKPOINTS = {
    "wrong model_type": (lambda f: _edit_config(f, model_type="mistral", architectures=["MistralForCausalLM"]),
                         "not a Llama checkpoint"),
    "lerobot policy config": (lambda f: (f / "config.json").write_text(json.dumps({"type": "lingbot_va"})),
                              "'lingbot_va'"),
    "missing tensor": (lambda f: _edit_tensors(f, lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
                       "'model.layers.1.mlp.up_proj.weight' is missing"),
    "mismatched shape": (lambda f: _edit_tensors(f, lambda t: t.update(
        {"model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 256)})),
                         "'model.layers.0.self_attn.k_proj.weight' has shape (64, 256)"),
    "unexpected tensor": (lambda f: _edit_tensors(f, lambda t: t.update(
        {"model.layers.2.mlp.up_proj.weight": torch.zeros(512, 256)})),
                          "unexpected tensor(s) in the checkpoint: model.layers.2.mlp.up_proj.weight"),
    "tied head that is not the embedding": (lambda f: _edit_tensors(f, lambda t: t.update(
        {"lm_head.weight": torch.zeros(512, 256)})), "unexpected tensor(s) in the checkpoint: lm_head.weight"),
    "non-finite weight": (lambda f: _edit_tensors(f, lambda t: t["model.norm.weight"].__setitem__(3, math.nan)),
                          "'model.norm.weight' is not finite"),
    "truncated safetensors": (_truncate, "cannot be read as safetensors"),
    "no weights": (lambda f: (f / "model.safetensors").unlink(), "has no model.safetensors"),
    "no config": (lambda f: (f / "config.json").unlink(), "has no config.json"),
    "rope scaling": (lambda f: _edit_config(f, rope_parameters={"rope_type": "llama3", "rope_theta": 1e5,
                                                                  "factor": 8.0}),
                     "rope scaling 'llama3'"),
}


@pytest.mark.parametrize("case", list(BAD_CHECKPOINTS))
def test_bad_checkpoint_raises_pull_error(case, checkpoint, recipe, tmp_path):
    corrupt, message = BAD_CHECKPOINTS[case]
    folder = corrupt_copy(checkpoint, tmp_path)
    corrupt(folder)
    with pytest.raises(PullError) as info:
        llama.build_unit(folder, recipe)
    assert message in str(info.value) and info.value.hint


@pytest.mark.parametrize("overrides, message", [
    (["unit.methods=[prefill,decode]"], "the llama unit has one method"),
    # Option keys are the recipe schema's since LlamaOptions (refused at load, like any key).
    (["unit.options.layers=3"], "unit.options.layers: Key 'layers' not in 'LlamaOptions'"),
    (["inputs.seq_len=8"], "mean nothing to the llama family"),
    (["dynamic.seq.min=1"], "specialises sizes 0 and 1"),
    (["dynamic.seq.max=512"], "exceeds the checkpoint's max_position_embeddings=256"),
])
def test_bad_recipe_raises_recipe_error(overrides, message, checkpoint):
    with pytest.raises(RecipeError) as info:
        llama.build_unit(checkpoint, load_recipe(TINY, overrides))
    assert message in str(info.value)


def test_fabricate_needs_the_size(tmp_path):
    no_size = load_recipe(TINY)
    no_size.unit.options.fabricate_config = None
    with pytest.raises(RecipeError, match="no unit.options.fabricate_config"):
        llama.fabricate_checkpoint(no_size, tmp_path)
    partial = load_recipe(TINY)
    del partial.unit.options.fabricate_config["vocab_size"]
    with pytest.raises(RecipeError, match="lacks \\['vocab_size'\\]"):
        llama.fabricate_checkpoint(partial, tmp_path)
