"""inline_autocast_regions: regions inlined, autocast's casts written out, numerics equal to eager autocast.

The references are the eager modules themselves, run under the same autocast contexts, on fresh seeded inputs.
"""

from __future__ import annotations

import copy
import importlib.util
import logging

import pytest
import torch
from torch import nn
from torch.export import export

from joint_program import as_joint
from zoo.rewrites import inline_autocast_regions

aten = torch.ops.aten
HOPS = (torch.ops.higher_order.wrap_with_autocast, torch.ops.higher_order.wrap_with_set_grad_enabled)


def all_nodes(ep):
    for gm in ep.graph_module.modules():
        if isinstance(gm, torch.fx.GraphModule):
            yield from gm.graph.nodes


def hop_count(ep):
    return sum(1 for n in all_nodes(ep) if n.op == "call_function" and n.target in HOPS)


def inline(ep):
    result = inline_autocast_regions(ep)
    assert result.declined is None, result.declined
    assert result.changed and result.program is not ep
    assert hop_count(result.program) == 0
    assert not [m for m in result.program.graph_module.modules() if m is not result.program.graph_module]
    return result


def run(ep, *args):
    with torch.no_grad():
        return ep.module()(*args)


class Disabled(nn.Module):
    """The motivating case: a region that switches autocast off and reads an input and a parameter."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            y = self.linear(x)
        return y * 2


class Nested(nn.Module):
    """An outer bfloat16 region holding an inner autocast-off region; both read inputs, parameters, a buffer."""

    def __init__(self):
        super().__init__()
        self.outer = nn.Linear(8, 8)
        self.inner = nn.Linear(8, 8)
        self.register_buffer("shift", torch.randn(8))

    def forward(self, x, z):
        h = x * 2
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a = self.outer(h)  # bfloat16 under autocast
            with torch.autocast("cpu", enabled=False):
                b = self.inner(a.float() + z) + self.shift  # float32: autocast is off here
            c = a @ b.t()  # bfloat16 again
        return c, b, a


@pytest.fixture(scope="module")
def nested():
    torch.manual_seed(0)
    module = Nested().eval()
    with torch.no_grad():
        return module, export(module, (torch.randn(3, 8), torch.randn(3, 8)))


def test_region_turning_autocast_off_reads_input_and_parameter():
    torch.manual_seed(0)
    module = Disabled().eval()
    with torch.no_grad():
        ep = export(module, (torch.randn(2, 8),))
    result = inline(ep)
    assert result.counts == {"higher_order.wrap_with_autocast": 1}
    x = torch.randn(2, 8)
    assert torch.equal(run(result.program, x), module(x))
    assert hop_count(ep) == 1  # the caller's program keeps its region


def test_nested_regions_match_eager_autocast(nested):
    module, ep = nested
    # The bodies name their inputs arg0_1, arg1_1, ...: not the names of the operands outside.
    outer = ep.graph_module.get_submodule(next(n.target for n in ep.graph.nodes if n.op == "get_attr"))
    body_inputs = {n.name for n in outer.graph.nodes if n.op == "placeholder"}
    assert not body_inputs <= {n.name for n in ep.graph.nodes}
    result = inline(ep)
    assert result.counts == {"higher_order.wrap_with_autocast": 2}
    casts = [n for n in result.program.graph.nodes if n.target is aten._to_copy.default]
    # outer linear: input, weight and bias to bfloat16; a @ b.t(): b to bfloat16. The inner linear: none.
    assert len(casts) == 4 and {n.kwargs["dtype"] for n in casts} == {torch.bfloat16}
    assert any("autocast cast" in note for note in result.notes)
    torch.manual_seed(1)
    for _ in range(2):
        x, z = torch.randn(3, 8), torch.randn(3, 8)
        with torch.no_grad():
            want = module(x, z)
        got = run(result.program, x, z)
        for w, g in zip(want, got):
            assert w.dtype == g.dtype and torch.equal(w, g)
        assert [t.dtype for t in got] == [torch.bfloat16, torch.float32, torch.bfloat16]


def test_grad_mode_region_of_an_inference_program_is_inlined():
    class NoGradInside(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            with torch.no_grad():
                y = self.linear(x) * 2
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    z = self.linear(y)
            return y + 1, z

    torch.manual_seed(0)
    module = NoGradInside().eval()
    ep = export(module, (torch.randn(3, 4),))  # exported with grad enabled: the block becomes a region
    result = inline(ep)
    assert result.counts == {"higher_order.wrap_with_autocast": 1, "higher_order.wrap_with_set_grad_enabled": 1}
    x = torch.randn(3, 4)
    for w, g in zip(module(x), run(result.program, x)):
        assert w.dtype == g.dtype and torch.equal(w, g)


def test_grad_mode_region_of_a_joint_program_is_kept(caplog):
    class NoGradInside(nn.Module):
        def forward(self, x):
            with torch.no_grad():
                y = x * 2
            return y.sum() + x.sum()

    joint = as_joint(export(NoGradInside(), (torch.randn(3),)))
    with caplog.at_level(logging.WARNING, logger="zoo.rewrites"):
        result = inline_autocast_regions(joint)
    assert result.program is joint and not result.changed and result.declined is None
    (note,) = result.notes
    assert "kept higher_order.wrap_with_set_grad_enabled" in note and "gradient" in note
    assert note in caplog.text


def test_unexplained_dtype_declines_untouched():
    torch.manual_seed(0)
    with torch.no_grad():
        ep = export(Disabled().eval(), (torch.randn(2, 8),))
    tampered = copy.deepcopy(ep)
    body = next(m for m in tampered.graph_module.modules() if m is not tampered.graph_module)
    linear = next(n for n in body.graph.nodes if n.target is aten.linear.default)
    linear.meta["val"] = linear.meta["val"].to(torch.bfloat16)  # as if a cast had happened with autocast off
    before = [str(m.graph) for m in tampered.graph_module.modules() if isinstance(m, torch.fx.GraphModule)]
    result = inline_autocast_regions(tampered)
    assert result.program is tampered and not result.changed
    assert "aten.linear.default" in result.declined and "no enclosing region enables autocast" in result.declined
    assert before == [str(m.graph) for m in tampered.graph_module.modules() if isinstance(m, torch.fx.GraphModule)]


def test_region_for_another_device_type_casts_nothing_and_says_so(caplog):
    class Scaled(nn.Module):
        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = x * 3  # no autocast policy for mul: recorded in float32
            return y

    ep = export(Scaled(), (torch.randn(2, 2),))
    # Stand in for a CUDA autocast region in a program traced on CPU (no GPU here to trace one).
    hop = next(n for n in ep.graph.nodes if n.target is HOPS[0])
    hop.args = ("cuda",) + hop.args[1:]
    with caplog.at_level(logging.WARNING, logger="zoo.rewrites"):
        result = inline(ep)
    (note,) = result.notes
    assert "autocast('cuda', torch.bfloat16)" in note and "['cpu']" in note and note in caplog.text
    x = torch.randn(2, 2)
    assert torch.equal(run(result.program, x), x * 3)


def test_program_without_regions_is_unchanged():
    class Plain(nn.Module):
        def forward(self, x):
            return x.relu()

    ep = export(Plain(), (torch.randn(2),))
    result = inline_autocast_regions(ep)
    assert result.program is ep and not result.changed and result.declined is None and result.notes == []


# ------------------------------------------------------------------ Fast-WAM's rope


def rope_params(max_len: int, dim: int, theta: float = 10000.0) -> torch.Tensor:
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64),
                         1.0 / torch.pow(theta, torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    return torch.polar(torch.ones_like(angles), angles)  # complex128, as Fast-WAM's rope_params


class FastWamRope(nn.Module):
    """Fast-WAM's action rope in miniature: a complex128 table kept as a plain attribute (a lifted constant), an
    autocast-disabled decorated rope, complex64 queries times the complex128 table."""

    def __init__(self, heads: int = 2, head_dim: int = 8, max_len: int = 32):
        super().__init__()
        self.q = nn.Linear(heads * head_dim, heads * head_dim)
        self.heads, self.head_dim = heads, head_dim
        self.freqs = rope_params(max_len, head_dim)

    @staticmethod
    @torch.amp.autocast("cuda", enabled=False)
    def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        xc = torch.view_as_complex(x.to(torch.float32).reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs).flatten(3).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape
        q = self.q(x).view(b, length, self.heads, self.head_dim)
        return self.apply_rope(q, self.freqs[:length].view(length, 1, -1))


_HAS_COMPLEX_REWRITE = importlib.util.find_spec("zoo.rewrites.complex_to_real") is not None


def test_fast_wam_rope_region_is_inlined_with_its_complex_operands():
    torch.manual_seed(0)
    module = FastWamRope().eval()
    with torch.no_grad():
        ep = export(module, (torch.randn(1, 6, 16),))
    region = next(n for n in ep.graph.nodes if n.target is HOPS[0])
    assert region.args[:3] == ("cuda", torch.float16, False)
    assert any(a.meta["val"].is_complex() for a in region.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor))
    result = inline(ep)
    root_ops = [n.target for n in result.program.graph.nodes]
    assert aten.view_as_complex.default in root_ops and aten.mul.Tensor in root_ops  # visible to other rewrites
    x = torch.randn(1, 6, 16)
    assert torch.equal(run(result.program, x), module(x))


@pytest.mark.skipif(not _HAS_COMPLEX_REWRITE, reason="zoo.rewrites.complex_to_real is not written yet")
def test_fast_wam_rope_through_inline_then_complex_rewrite():
    from zoo import rewrites

    torch.manual_seed(0)
    module = FastWamRope().eval()
    with torch.no_grad():
        ep = export(module, (torch.randn(1, 6, 16),))
    inlined = inline(ep).program
    result = rewrites.get("replace_complex_with_real")(inlined)
    assert result.declined is None and result.changed
    for node in all_nodes(result.program):
        for v in torch.utils._pytree.tree_leaves(node.meta.get("val")):
            assert not (isinstance(v, torch.Tensor) and v.is_complex()), node.name
    for t in [*result.program.state_dict.values(), *result.program.constants.values()]:
        assert not (isinstance(t, torch.Tensor) and t.is_complex())
    torch.manual_seed(1)
    for _ in range(2):
        x = torch.randn(1, 6, 16)
        with torch.no_grad():
            want = module(x)  # complex128 eager
        got = run(result.program, x)
        assert (got - want).abs().max().item() <= 1e-6 * want.abs().max().item()
