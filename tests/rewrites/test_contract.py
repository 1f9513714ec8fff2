"""What every registered rewrite promises, checked for each one in the registry.

For each rewrite there is a program it must decline and a program it must change, built here:
* a decline hands back the caller's program itself, its graphs, signature and state exactly as they were;
* a rewrite that changes a program hands back a new one, runs like eager PyTorch, and leaves the caller's alone;
* a failure while rewriting (after matching) declines the whole program and says why: nothing half-applied;
* ``summary()`` is JSON-ready either way.
Plus the registry itself: one registration per name, every rewrite in DEFAULT_ORDER exactly once, and
``rewrites_for(recipe)`` binding the recipe's values.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from types import SimpleNamespace
from typing import Callable, Dict, NamedTuple, Tuple

import pytest
import torch
from torch import nn
from torch.export import Dim, ExportedProgram, export

import zoo.rewrites
from joint_program import as_joint
from zoo.core.errors import RecipeError
from zoo.contract.recipes import Recipe
from zoo.rewrites import DEFAULT_ORDER, RewriteResult, rewrites_for
from zoo.rewrites import registry

aten = torch.ops.aten


class Case(NamedTuple):
    program: ExportedProgram
    inputs: Tuple[torch.Tensor, ...] = ()
    eager: Callable = None  # what the program computes, for a program the rewrite changes


def exported(module: nn.Module, *inputs: torch.Tensor, dynamic_shapes=None) -> Case:
    module = module.eval()
    return Case(export(module, inputs, dynamic_shapes=dynamic_shapes, strict=False), inputs, module)


# --------------------------------------------------------------------------------------------- the programs


class GradRegion(nn.Module):
    def forward(self, x):
        with torch.no_grad():
            y = x * 2
        return y.sum() + x.sum()


class Rope(nn.Module):
    def forward(self, x):
        z = torch.view_as_complex(x)
        return torch.view_as_real(z * z)


class ComplexInput(nn.Module):
    def forward(self, z):
        return torch.view_as_real(z * 2)


class Float64Table(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.linspace(0.5, 2.0, 4, dtype=torch.float64))

    def forward(self, x):
        return (x.double() * self.table).float()


class Float64Input(nn.Module):
    def forward(self, x):
        return x.float() * 2


class MutatedFloat64(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("acc", torch.zeros(4, dtype=torch.float64))

    def forward(self, x):
        self.acc.add_(x.double())
        return x * 2


class Flash(nn.Module):
    def forward(self, q, k, v):
        return aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, 0.0, False)[0] * 1


class WideAttention(nn.Module):
    """A head wider than executorch's Triton SDPA computes; ``gqa`` lets 2 key heads serve 4 query heads."""

    def __init__(self, gqa: bool = False):
        super().__init__()
        self.gqa = gqa

    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=self.gqa) * 1


class MaskedAttention(nn.Module):
    """Attention under a boolean key mask; ``dropout`` makes it one an inference program must not hold."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.dropout = dropout

    def forward(self, q, k, v, visible):
        mask = visible[None, None, None, :].expand(q.shape[0], 1, q.shape[2], visible.shape[0])
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout) * 1


def masked_attention() -> Tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return (*(torch.randn(1, 2, n, 64, generator=g) for n in (4, 70, 70)), torch.rand(70, generator=g) > 0.3)


def wide_attention(hq: int, hkv: int) -> Tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, h, 5, 320, generator=g) for h in (hq, hkv, hkv))


class Detaching(nn.Module):
    def forward(self, x):
        return (x * 2).detach() + 1


class Split(nn.Module):
    def forward(self, x):
        a, b = x.split(2, dim=1)
        return a * b


class SymbolicSplit(nn.Module):
    def forward(self, x):
        head, tail = torch.split(x, [x.shape[1] - 2, 2], dim=1)
        return head.sum(1) + tail.sum(1)


class Transposed(nn.Module):
    def forward(self, x):
        return (x + 1).t()


def attention(hq: int, hkv: int) -> Tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, h, 5, 8, generator=g) for h in (hq, hkv, hkv))


def tampered_body(ep: ExportedProgram) -> ExportedProgram:
    """A region whose recorded dtype its op does not compute (as if autocast had run with autocast off)."""
    ep = copy.deepcopy(ep)
    body = next(m for m in ep.graph_module.modules() if m is not ep.graph_module)
    op = next(n for n in body.graph.nodes if n.op == "call_function")
    op.meta["val"] = op.meta["val"].to(torch.bfloat16)
    return ep


def output_without_value(ep: ExportedProgram) -> ExportedProgram:
    """The last output's node with no recorded value (a program edited by hand)."""
    ep = copy.deepcopy(ep)
    del ep.graph.output_node().args[0][-1].meta["val"]
    return ep


def declines() -> Dict[str, Callable[[], ExportedProgram]]:
    """A program each rewrite must decline, and why it must."""
    x4, x42 = torch.randn(3, 4), torch.randn(4, 2)
    return {
        # a grad region whose op's recorded dtype no autocast state explains
        "inline_autocast_regions": lambda: tampered_body(exported(GradRegion(), torch.randn(3)).program),
        # a complex program input: the caller would have to pass real pairs
        "replace_complex_with_real": lambda: exported(ComplexInput(), torch.randn(3, dtype=torch.complex64)).program,
        # a float64 program input: narrowing would change the method's signature
        "narrow_float64": lambda: exported(Float64Input(), torch.randn(4, dtype=torch.float64)).program,
        # a float64 buffer the program mutates: its stored state must stay float64
        "split_float64_constants": lambda: exported(MutatedFloat64(), torch.randn(4)).program,
        # 2 key heads do not divide 3 query heads
        "replace_fused_sdpa_with_sdpa": lambda: exported(Flash(), *attention(3, 2)).program,
        # attention with dropout, which an inference program must not hold
        "replace_sdpa_with_split_kv_attention": lambda: exported(MaskedAttention(dropout=0.1),
                                                                 *masked_attention()).program,
        # grouped-query attention with a wide head: not written out
        "replace_triton_unsafe_sdpa_with_math": lambda: exported(WideAttention(gqa=True), *wide_attention(4, 2)).program,
        # a joint program, where detach decides which gradients flow
        "replace_detach_with_alias": lambda: as_joint(exported(Detaching(), x4).program),
        # split sizes that are symbols: no slice with integer bounds
        "replace_view_copies": lambda: exported(SymbolicSplit(), torch.randn(2, 7, 3),
                                                dynamic_shapes=({1: Dim("n", min=4, max=16)},)).program,
        # an output whose safety cannot be told
        "make_outputs_safe": lambda: output_without_value(exported(Transposed(), x42).program),
    }


def changes() -> Dict[str, Callable[[], Case]]:
    """A program each rewrite must change, with the eager module it stands for."""
    return {
        "inline_autocast_regions": lambda: exported(GradRegion(), torch.randn(3)),
        "replace_complex_with_real": lambda: exported(Rope(), torch.randn(4, 2)),
        "narrow_float64": lambda: exported(Float64Table(), torch.randn(4)),
        "split_float64_constants": lambda: exported(Float64Table(), torch.randn(4)),
        "replace_fused_sdpa_with_sdpa": lambda: exported(Flash(), *attention(2, 2)),
        "replace_sdpa_with_split_kv_attention": lambda: exported(MaskedAttention(), *masked_attention()),
        "replace_triton_unsafe_sdpa_with_math": lambda: exported(WideAttention(), *wide_attention(2, 2)),
        "replace_detach_with_alias": lambda: exported(Detaching(), torch.randn(3, 4)),
        "replace_view_copies": lambda: exported(Split(), torch.randn(3, 4)),
        "make_outputs_safe": lambda: exported(Transposed(), torch.randn(4, 2)),
    }


# --------------------------------------------------------------------------------------------- checks


def snapshot(ep: ExportedProgram) -> dict:
    """Everything a rewrite must leave as it was in the caller's program, copied so later mutation would show."""
    def table(tensors):
        return {k: (v, v.dtype, v.detach().clone()) for k, v in tensors.items() if isinstance(v, torch.Tensor)}

    return {
        "graphs": [(name, m.code, str(m.graph)) for name, m in ep.graph_module.named_modules()
                   if isinstance(m, torch.fx.GraphModule)],
        "values": [(n.name, n.meta.get("val")) for m in ep.graph_module.modules()
                   if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes],
        "signature": str(ep.graph_signature),
        "state_dict": table(ep.state_dict),
        "constants": table(ep.constants),
    }


def assert_untouched(ep: ExportedProgram, before: dict) -> None:
    after = snapshot(ep)
    assert after["graphs"] == before["graphs"]
    assert after["signature"] == before["signature"]
    assert [name for name, _ in after["values"]] == [name for name, _ in before["values"]]
    assert all(a is b for (_, a), (_, b) in zip(after["values"], before["values"]))  # same fake values, not swapped
    for key in ("state_dict", "constants"):
        assert after[key].keys() == before[key].keys()
        for name, (tensor, dtype, value) in before[key].items():
            now, now_dtype, now_value = after[key][name]
            assert now is tensor and now_dtype == dtype and torch.equal(now_value, value)


def assert_json_ready(result: RewriteResult) -> None:
    summary = result.summary()
    assert json.loads(json.dumps(summary)) == summary


REWRITES = sorted(registry.registered())


def run(name: str, ep: ExportedProgram) -> RewriteResult:
    return zoo.rewrites.get(name)(ep)


def test_every_rewrite_has_a_program_to_decline_and_one_to_change():
    assert sorted(declines()) == REWRITES, "add the new rewrite's programs to declines() and changes()"
    assert sorted(changes()) == REWRITES


@pytest.mark.parametrize("name", REWRITES)
def test_a_decline_hands_back_the_callers_program_untouched(name):
    ep = declines()[name]()
    before = snapshot(ep)
    result = run(name, ep)
    assert result.name == name
    assert result.declined, f"{name} did not decline"
    assert result.program is ep and not result.changed and result.counts == {}
    assert_untouched(ep, before)
    assert_json_ready(result)


@pytest.mark.parametrize("name", REWRITES)
def test_a_rewrite_returns_a_new_program_that_computes_what_eager_does(name):
    case = changes()[name]()
    before = snapshot(case.program)
    result = run(name, case.program)
    assert result.declined is None and result.changed and result.counts
    assert result.program is not case.program
    assert_untouched(case.program, before)
    assert_json_ready(result)
    with torch.no_grad():
        want, got = case.eager(*case.inputs), result.program.module()(*case.inputs)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", REWRITES)
def test_a_failure_after_matching_declines_the_whole_program(name, monkeypatch):
    # Every rewrite lints the graph it built or edited before handing it back: make that fail.
    case = changes()[name]()
    before = snapshot(case.program)

    def broken(graph):
        raise RuntimeError("synthetic lint failure")

    monkeypatch.setattr(torch.fx.Graph, "lint", broken)
    result = run(name, case.program)
    assert result.declined and "synthetic lint failure" in result.declined, result.declined
    assert result.program is case.program and not result.changed and result.counts == {}
    monkeypatch.undo()
    assert_untouched(case.program, before)
    assert_json_ready(result)


# --------------------------------------------------------------------------------------------- registry


def test_default_order_lists_every_registered_rewrite_once():
    assert isinstance(DEFAULT_ORDER, tuple)
    assert len(set(DEFAULT_ORDER)) == len(DEFAULT_ORDER)
    assert set(DEFAULT_ORDER) == set(registry.registered())
    assert zoo.rewrites.names() == list(DEFAULT_ORDER)


@pytest.mark.parametrize("name", REWRITES)
def test_the_package_names_each_rewrite_function(name):
    function = registry.registration(name).function
    assert getattr(zoo.rewrites, name) is function and zoo.rewrites.get(name) is function
    assert function.__module__.startswith("zoo.rewrites.")


def test_a_second_registration_of_a_name_is_refused():
    def replace_detach_with_alias(ep):
        return RewriteResult.unchanged("replace_detach_with_alias", ep)

    original = registry.registration("replace_detach_with_alias")
    with pytest.raises(registry.RegistrationError) as err:
        registry.rewrite("replace_detach_with_alias")(replace_detach_with_alias)
    message = str(err.value)
    assert "zoo.rewrites.detach.replace_detach_with_alias" in message
    assert f"{__name__}.test_a_second_registration_of_a_name_is_refused.<locals>.replace_detach_with_alias" in message
    assert registry.registration("replace_detach_with_alias") is original


def test_a_rewrite_must_run_on_the_program_alone():
    def needs_more(ep, table):
        return RewriteResult.unchanged("needs_more", ep)

    def takes_pairs(ep, pairs="float64"):
        return RewriteResult.unchanged("takes_pairs", ep)

    with pytest.raises(registry.RegistrationError, match=r"\['table'\] have no default"):
        registry.rewrite("needs_more")(needs_more)
    with pytest.raises(registry.RegistrationError, match=r"no keyword parameter\(s\) \['complex128_as'\]"):
        registry.rewrite("takes_pairs", complex128_as="rotary_pairs")(takes_pairs)
    assert "needs_more" not in registry.registered() and "takes_pairs" not in registry.registered()


def test_recipe_arguments_name_recipe_fields():
    fields = {f.name for f in dataclasses.fields(Recipe)}
    for name, registration in registry.registered().items():
        for arg, field in registration.recipe_args:
            assert field in fields, f"{name}: {arg} is set from recipe field {field!r}, which Recipe lacks"


class Complex128Table(nn.Module):
    def __init__(self):
        super().__init__()
        angles = torch.arange(4, dtype=torch.float64) * 0.3
        self.register_buffer("table", torch.polar(torch.ones_like(angles), angles))

    def forward(self, x):
        return torch.view_as_real(torch.view_as_complex(x.double()) * self.table).float()


@pytest.mark.parametrize("pairs, stored", [("float64", torch.float64), ("float32", torch.float32)])
def test_rewrites_for_runs_in_default_order_with_the_recipes_values(pairs, stored):
    listed = ["make_outputs_safe", "replace_complex_with_real"]  # not the order they run in
    recipe = SimpleNamespace(rewrites=listed, rotary_pairs=pairs)
    steps = rewrites_for(recipe)
    assert [name for name, _ in steps] == [n for n in DEFAULT_ORDER if n in listed]

    case = exported(Complex128Table(), torch.randn(4, 2))
    ep = case.program
    for _, rewrite in steps:
        result = rewrite(ep)
        assert result.declined is None
        ep = result.program
    assert ep.constants.get("table", ep.state_dict.get("table")).dtype == stored  # rotary_pairs reached the rewrite
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(*case.inputs), case.eager(*case.inputs), rtol=1e-5, atol=1e-6)


def test_rewrites_for_refuses_an_unknown_name():
    with pytest.raises(RecipeError, match="no_such_rewrite"):
        rewrites_for(SimpleNamespace(rewrites=["no_such_rewrite"], rotary_pairs="float64"))
