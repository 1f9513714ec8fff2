"""zoo.policies.fast_init on toy modules: built on meta and loaded equals built normally and loaded.

The reference is torch's own path, what LeRobot's ``from_pretrained`` does today: construct with the
default initialisation, then ``safetensors.torch.load_model`` (copying ``load_state_dict``).
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_model, save_file, save_model
from torch import nn

from zoo.core.errors import ExportError
from zoo.policies import fast_init


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, 3 * dim)
        self.norm = nn.LayerNorm(3 * dim)
        self.table = nn.Parameter(torch.randn(1, 2, dim) / dim ** 0.5)
        self.frozen = nn.Linear(dim, dim, bias=False)
        self.frozen.requires_grad_(False)
        self.register_buffer("scale", torch.linspace(0.5, 2.0, dim))  # persistent: in the checkpoint
        self.register_buffer("steps", torch.arange(7, dtype=torch.float64) ** 0.5, persistent=False)
        # A plain attribute (not a buffer), as Wan's rope tables are: computed here, never in a checkpoint.
        self.freqs = torch.polar(torch.ones(4, dim // 2, dtype=torch.float64),
                                 torch.outer(torch.arange(4.0, dtype=torch.float64),
                                             1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)))


class Toy(nn.Module):
    """A stack in bf16 except a float32 head, with a tied output matrix and an embedding."""

    def __init__(self, dim: int = 16, layers: int = 3, vocab: int = 11):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(layers)])
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight  # tied
        self.blocks.to(device="cpu", dtype=torch.bfloat16)  # as Fast-WAM moves its experts when built
        self.head = nn.Linear(dim, 2)


class Policy(nn.Module):
    """Stands in for a LeRobot policy: the big part built by ``Toy``, a small part beside it, and
    LeRobot's loader seam ``_load_as_safetensor`` (the classmethod ``from_pretrained`` reads through)."""

    def __init__(self):
        super().__init__()
        self.model = Toy()
        self.aux = nn.Linear(3, 5)

    @classmethod
    def _load_as_safetensor(cls, model, model_file, map_location, strict):
        load_model(model, model_file, strict=strict)
        return model

    @classmethod
    def from_pretrained(cls, path, strict=True):  # LeRobot's from_pretrained, reduced to its three steps
        policy = cls()
        policy = cls._load_as_safetensor(policy, str(path), "cpu", strict)
        return policy.eval()


@pytest.fixture()
def checkpoint(tmp_path):
    """A checkpoint with values no initialisation gives (so an init leaking through would show)."""
    torch.manual_seed(123)
    donor = Policy()
    with torch.no_grad():
        for t in donor.state_dict().values():
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape) * 0.3 + 0.7)
    path = tmp_path / "model.safetensors"
    save_model(donor, str(path))  # drops one name of each tied pair, as LeRobot's save does
    return path


def all_tensors(module: nn.Module):
    out = dict(module.state_dict())
    out.update({f"attr:{k}": v for k, v in fast_init.plain_tensor_attributes(module).items()})
    out.update({f"buffer:{k}": v for k, v in module.named_buffers()})
    return out


def test_built_on_meta_and_loaded_equals_built_normally_and_loaded(checkpoint):
    torch.manual_seed(0)
    normal = Policy.from_pretrained(checkpoint)
    torch.manual_seed(1)  # a different init seed: nothing of the init may survive either path
    with fast_init.built_on_meta(Policy, [Toy]):
        fast = Policy.from_pretrained(checkpoint)
    assert fast_init.same_structure(normal, fast) == []
    a, b = all_tensors(normal), all_tensors(fast)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name
    assert fast.model.out.weight is fast.model.embed.weight  # still tied
    assert not fast.model.blocks[0].frozen.weight.requires_grad and fast.model.blocks[0].proj.weight.requires_grad
    assert fast_init.meta_tensors(fast) == []
    # The seam is put back: a plain build initialises again.
    assert Policy.__dict__["_load_as_safetensor"].__func__ is Policy._load_as_safetensor.__func__
    assert Toy().blocks[0].proj.weight.device.type == "cpu"


def test_only_the_named_classes_are_built_on_meta():
    with fast_init.parameters_on_meta([Block]):
        toy = Toy()
    assert toy.blocks[0].proj.weight.device.type == "meta"
    assert toy.blocks[0].proj.weight.dtype == torch.bfloat16  # the constructor's cast still applies
    assert toy.embed.weight.device.type == "cpu" and toy.head.weight.device.type == "cpu"
    # Buffers and plain attributes are computed for real, with the values a normal build gives.
    reference = Block(16).to(torch.bfloat16)  # as Toy casts its blocks (plain attributes stay as computed)
    assert toy.blocks[1].freqs.dtype == torch.complex128 and torch.equal(toy.blocks[1].freqs, reference.freqs)
    assert torch.equal(toy.blocks[1].steps, reference.steps)
    assert torch.equal(toy.blocks[1].scale, reference.scale)


def test_a_class_without_its_own_init_is_restored_as_it_was():
    class Sub(Block):
        pass

    assert "__init__" not in Sub.__dict__
    with fast_init.parameters_on_meta([Sub]):
        assert Sub(4).proj.weight.device.type == "meta"
    assert "__init__" not in Sub.__dict__
    assert Sub(4).proj.weight.device.type == "cpu"


@pytest.mark.parametrize("change, message", [
    (lambda sd: sd.pop("model.head.bias"), "Missing key(s) in state_dict: \"model.head.bias\""),
    (lambda sd: sd.update(extra=torch.zeros(2)), "Unexpected key(s) in state_dict: \"extra\""),
    (lambda sd: sd.update({"aux.weight": torch.zeros(5, 4)}), "shape mismatch for aux.weight"),
])
def test_strict_load_names_what_does_not_fit(tmp_path, change, message):
    donor = Policy()
    state = {k: v.contiguous() for k, v in donor.state_dict().items() if k != "model.out.weight"}
    change(state)
    path = tmp_path / "bad.safetensors"
    save_file(state, str(path))
    with fast_init.built_on_meta(Policy, [Toy]), pytest.raises(RuntimeError, match="Error"):
        try:
            Policy.from_pretrained(path)
        except RuntimeError as exc:
            assert message in str(exc)
            raise


def test_non_strict_load_with_a_missing_tensor_refuses_to_leave_it_empty(tmp_path):
    donor = Policy()
    state = {k: v.contiguous() for k, v in donor.state_dict().items() if k not in ("model.out.weight",
                                                                                  "model.head.bias")}
    path = tmp_path / "partial.safetensors"
    save_file(state, str(path))
    with fast_init.parameters_on_meta([Toy]):
        policy = Policy()
    with pytest.raises(ExportError, match="model.head.bias"):
        fast_init.load_weights(policy, path, strict=False)


def test_seeded_weights_fill_in_the_built_dtype_independently_of_threads():
    def build(seed, threads):
        with fast_init.parameters_on_meta([Toy]):
            policy = Policy()
        fast_init.fill_seeded(policy, seed, threads=threads)
        return policy

    one, four, other = build(5, 1), build(5, 4), build(6, 4)
    assert fast_init.meta_tensors(four) == []
    parameters = dict(four.named_parameters())
    for (name, a), b, c in zip(one.state_dict().items(), four.state_dict().values(), other.state_dict().values()):
        if not name.startswith("model."):
            continue  # aux is built normally, from the global RNG: checked below
        assert torch.equal(a, b), name
        if name in parameters:  # built on meta, so filled: the seed matters
            assert not torch.equal(a, c), name
    w = four.model.blocks[0].proj.weight
    assert w.dtype == torch.bfloat16 and w.requires_grad
    bound = math.sqrt(3.0 / 16)
    assert w.abs().max() <= bound and w.float().std() > 0.8 * bound / math.sqrt(3)
    ln = four.model.blocks[0].norm.weight
    assert (ln - 1).abs().max() <= 0.18 and (ln - 1).float().std() > 0.05  # spread around 1, not all 1
    assert four.model.out.weight is four.model.embed.weight
    # Parameters not built on meta keep what their constructor gave them.
    torch.manual_seed(9)
    aux_a = build(5, 1).aux.weight
    torch.manual_seed(9)
    assert torch.equal(aux_a, build(7, 1).aux.weight)


def test_seeded_weights_inside_built_on_meta_read_no_file(tmp_path):
    with fast_init.built_on_meta(Policy, [Toy]), fast_init.seeded_weights(3):
        policy = Policy.from_pretrained(tmp_path / "does-not-exist.safetensors")
    assert fast_init.meta_tensors(policy) == []
    with fast_init.parameters_on_meta([Toy]):
        again = Policy()
    fast_init.fill_seeded(again, 3)
    assert torch.equal(policy.model.blocks[2].proj.weight, again.model.blocks[2].proj.weight)


class Stack(nn.Module):
    """A module whose constructor casts everything to ``dtype``, as LeRobot's policies do with config.dtype."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.embed = nn.Embedding(11, 16)
        self.blocks = nn.ModuleList([Block(16) for _ in range(2)])
        self.head = nn.Linear(16, 2)
        self.to(dtype)


def seeded_stack(dtype: torch.dtype, seed: int, **draw) -> Stack:
    with fast_init.parameters_on_meta([Stack]):
        stack = Stack(dtype)
    fast_init.fill_seeded(stack, seed, threads=3, **draw)
    return stack


def test_seeded_weights_drawn_in_bf16_give_a_float32_build_the_bf16_builds_values(monkeypatch):
    monkeypatch.setattr(fast_init, "FILL_CHUNK", 7)  # several chunks per tensor, filled on several threads
    low = seeded_stack(torch.bfloat16, 4)  # drawn in each tensor's own dtype: the default, unchanged
    low_drawn = seeded_stack(torch.bfloat16, 4, draw_dtype=torch.bfloat16)
    wide = seeded_stack(torch.float32, 4, draw_dtype=torch.bfloat16)
    wide_own = seeded_stack(torch.float32, 4)  # float32 draws of its own: another model
    parameters = dict(low.named_parameters())
    assert len(parameters) > 10
    for name, a in low.state_dict().items():
        if name not in parameters:
            continue  # buffers are computed by the constructor, not filled
        assert a.dtype == torch.bfloat16 and wide.state_dict()[name].dtype == torch.float32, name
        assert torch.equal(low_drawn.state_dict()[name], a), name  # bf16 tensors: drawn as without draw_dtype
        assert torch.equal(wide.state_dict()[name], a.float()), name  # the bf16 values, upcast exactly
        assert not torch.equal(wide_own.state_dict()[name], a.float()), name
        assert not torch.equal(wide_own.state_dict()[name].bfloat16(), a), name


def test_seeded_weights_with_a_draw_dtype_inside_built_on_meta(tmp_path):
    # Toy keeps its embedding and head in float32 beside bf16 blocks: with draw_dtype=bf16 those float32
    # tensors take bf16-drawn values (so they change), the bf16 blocks do not.
    with fast_init.built_on_meta(Policy, [Toy]), fast_init.seeded_weights(3, draw_dtype=torch.bfloat16):
        drawn = Policy.from_pretrained(tmp_path / "does-not-exist.safetensors")
    with fast_init.built_on_meta(Policy, [Toy]), fast_init.seeded_weights(3):
        own = Policy.from_pretrained(tmp_path / "does-not-exist.safetensors")
    assert fast_init.meta_tensors(drawn) == []
    assert torch.equal(drawn.model.blocks[1].proj.weight, own.model.blocks[1].proj.weight)
    head = drawn.model.head.weight
    assert head.dtype == torch.float32 and torch.equal(head, head.bfloat16().float())
    assert not torch.equal(head, own.model.head.weight)
    assert not torch.equal(own.model.head.weight, own.model.head.weight.bfloat16().float())
    with pytest.raises(TypeError, match="floating"):
        with fast_init.seeded_weights(3, draw_dtype=torch.int64):
            pass


def test_seeded_policies_build_their_other_parameters_from_the_seed_and_leave_the_callers_rng(tmp_path):
    # aux is built by its constructor from the global RNG and no file overwrites it under seeded_weights:
    # every policy built in the block gets the same values (what a checkpoint would give), from
    # torch.manual_seed(seed), whatever ran before it, and the caller's RNG stream goes on undisturbed.
    init = Policy.__dict__["__init__"]
    with fast_init.parameters_on_meta([Toy]):  # the constructor run from torch.manual_seed(3), unfilled
        torch.manual_seed(3)
        expected = Policy().aux.weight
    torch.manual_seed(11)
    state = torch.random.get_rng_state()
    with fast_init.built_on_meta(Policy, [Toy]), fast_init.seeded_weights(3):
        first = Policy.from_pretrained(tmp_path / "none.safetensors")
        assert torch.equal(torch.random.get_rng_state(), state)
        torch.rand(17)
        second = Policy.from_pretrained(tmp_path / "none.safetensors")
    assert torch.equal(first.aux.weight, expected) and torch.equal(second.aux.weight, expected)
    with fast_init.built_on_meta(Policy, [Toy]), fast_init.seeded_weights(3, draw_dtype=torch.bfloat16):
        rounded = Policy.from_pretrained(tmp_path / "none.safetensors")
    # With a draw dtype the constructor's float32 values are rounded through it, as a bf16 checkpoint gives.
    assert rounded.aux.weight.dtype == torch.float32
    assert torch.equal(rounded.aux.weight, expected.bfloat16().float())
    assert Policy.__dict__["__init__"] is init  # put back
