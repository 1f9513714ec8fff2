"""replace_view_copies: splitting views become slices/selects; numerics against eager, and what reaches Inductor.

The "what reaches Inductor" check runs executorch's own ``to_edge_transform_and_lower`` on the CPU with a
stand-in backend whose preprocess records the edge program, applies the CUDA backend's own
``ReplaceViewCopyWithViewPass`` and its decomposition step, as ``AotiBackend.preprocess`` does before
``aot_compile``; then every op left is looked up in torch's Inductor tables. An op with no Inductor lowering, no
Inductor decomposition and no composite implementation becomes an ATen fallback kernel, which executorch
1.2.0's CUDA backend refuses.
"""

from __future__ import annotations


import pytest
import torch
from torch import nn
from torch.export import Dim, export


from inductor_probe import fallback_ops, inductor_input
from zoo.rewrites import replace_view_copies

aten = torch.ops.aten
SPLITTING = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int}


def export_ng(module, args, dynamic_shapes=None):
    with torch.no_grad():
        return export(module.eval(), args, dynamic_shapes=dynamic_shapes)


def targets(ep):
    return [n.target for n in ep.graph.nodes if n.op == "call_function"]


# ------------------------------------------------------------------ modules


class AdaLNBlock(nn.Module):
    """The DiT conditioning of LingBot-VA / Fast-WAM in miniature: modulation chunked in 6, plus the other
    splitting views the policies use."""

    def __init__(self, dim=8):
        super().__init__()
        self.modulation = nn.Parameter(torch.randn(1, 6, dim) / dim ** 0.5)
        self.proj = nn.Linear(dim, 6 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)

    def forward(self, x, e):
        shift, scale, gate, shift2, scale2, gate2 = (self.modulation + self.proj(e).unflatten(1, (6, -1))).chunk(6, dim=1)
        h = self.norm(x) * (1 + scale) + shift
        a, b = h.split([3, 5], dim=-1)
        first, second = torch.split(h, 4, dim=-1)
        rows = x.unbind(1)
        return x + gate * h + gate2 * (scale2 + shift2), a.sum(-1) - b.mean(-1), first * second, rows[-1]


@pytest.fixture(scope="module")
def adaln():
    torch.manual_seed(0)
    module = AdaLNBlock().eval()
    args = (torch.randn(2, 5, 8), torch.randn(2, 8))
    return module, args, export_ng(module, args)


# ------------------------------------------------------------------ tests


def test_splitting_views_become_slices_and_match_eager(adaln):
    module, args, ep = adaln
    before = str(ep.graph)
    result = replace_view_copies(ep)
    assert result.declined is None and result.changed and result.program is not ep
    assert result.counts == {"aten.chunk.default": 1, "aten.split.Tensor": 1,
                             "aten.split_with_sizes.default": 1, "aten.unbind.int": 1}
    assert not SPLITTING & set(targets(result.program))
    assert aten.slice.Tensor in targets(result.program) and aten.select.int in targets(result.program)
    assert str(ep.graph) == before  # the caller's program is untouched
    torch.manual_seed(1)
    for _ in range(2):
        fresh = (torch.randn(2, 5, 8), torch.randn(2, 8))
        with torch.no_grad():
            want, got = module(*fresh), result.program.module()(*fresh)
        for w, g in zip(want, got):
            assert torch.equal(w, g)  # views of the same memory: bit-identical


def test_no_view_copy_without_inductor_kernel_reaches_the_backend(adaln):
    _, _, ep = adaln
    original = inductor_input(ep)
    # The failure the rewrite exists for: chunk/split arrive as split_copy, which Inductor cannot compile.
    assert "aten.split_copy.Tensor" in fallback_ops(original)
    rewritten = inductor_input(replace_view_copies(ep).program)
    assert not {op for op in fallback_ops(rewritten) if "copy" in op}
    assert aten.split_copy.Tensor not in targets(rewritten)
    assert aten.slice.Tensor in targets(rewritten)  # the backend's own pass turned slice_copy back into views


class DynamicSplit(nn.Module):
    def forward(self, x):
        a, _, c = x.split(4, dim=1)
        return a * 2, c.sum(1)


def test_split_along_a_dynamic_dimension():
    ep = export_ng(DynamicSplit(), (torch.randn(2, 11, 3),), dynamic_shapes=({1: Dim("n", min=10, max=11)},))
    result = replace_view_copies(ep)
    assert result.changed and result.counts == {"aten.split.Tensor": 1}
    torch.manual_seed(2)
    for length in (10, 11):  # the last piece is 2 or 3 long: slice clamps its end as split does
        x = torch.randn(2, length, 3)
        for w, g in zip(DynamicSplit()(x), result.program.module()(x)):
            assert torch.equal(w, g)


class SymbolicSizes(nn.Module):
    def forward(self, x):
        head, tail = torch.split(x, [x.shape[1] - 2, 2], dim=1)
        return head.sum(1) + tail.sum(1)


def test_symbolic_split_sizes_decline_and_leave_the_program_alone():
    ep = export_ng(SymbolicSizes(), (torch.randn(2, 7, 3),), dynamic_shapes=({1: Dim("n", min=4, max=16)},))
    before = str(ep.graph)
    result = replace_view_copies(ep)
    assert result.program is ep and not result.changed
    assert "aten.split_with_sizes.default" in result.declined
    assert "test_view_copies.py" in result.declined and "torch.split" in result.declined  # the source line
    assert "symbols" in result.declined
    assert str(ep.graph) == before


class OnlyViews(nn.Module):
    def forward(self, x):
        return x[:, 1:3].transpose(0, 1) * 2, x.unflatten(1, (2, 2))


def test_program_without_splitting_views_is_unchanged():
    ep = export_ng(OnlyViews(), (torch.randn(3, 4),))
    result = replace_view_copies(ep)
    assert result.program is ep and not result.changed and result.declined is None and result.counts == {}
