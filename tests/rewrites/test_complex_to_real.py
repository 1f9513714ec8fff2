"""replace_complex_with_real: rewritten programs against eager PyTorch, and every decline leaves the program alone.

References are eager modules run on fresh seeded inputs (complex128 eager for float64 pairs), or closed-form
float64 math; never the rewrite's own earlier output. Shapes are tiny so the module runs in seconds.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn
from torch.export import Dim, export

from zoo.core.errors import ZooError
from zoo.core.numerics import compare
from zoo.rewrites import replace_complex_with_real
from zoo.rewrites import complex_rules

F32_TOL = 1e-6  # float32 pairs vs eager
F64_TOL = 1e-12  # float64 pairs vs complex128 eager


# ============================================================================================ helpers


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)  # module weights and complex constants are drawn from the global generator


def export_ng(module: nn.Module, args: tuple, dynamic_shapes=None):
    with torch.no_grad():
        return export(module.eval(), args, dynamic_shapes=dynamic_shapes, strict=False)


def rel_l2(got: torch.Tensor, ref: torch.Tensor) -> float:
    c = compare("out", got, torch.view_as_real(ref) if ref.is_complex() else ref)
    assert c.ok, c.why
    return c.rel_l2


def all_graph_nodes(ep):
    for gm in ep.graph_module.modules():
        if isinstance(gm, torch.fx.GraphModule):
            yield from gm.graph.nodes


def assert_no_complex(ep) -> None:
    for node in all_graph_nodes(ep):
        val = node.meta.get("val")
        vals = val if isinstance(val, (list, tuple)) else [val]
        for v in vals:
            assert not (isinstance(v, torch.Tensor) and v.is_complex()), f"{node.name} still carries {v.dtype}"
    for name, t in [*ep.state_dict.items(), *ep.constants.items()]:
        assert not (isinstance(t, torch.Tensor) and t.is_complex()), f"{name} is still {t.dtype}"


def rewrite(ep, **kw):
    result = replace_complex_with_real(ep, **kw)
    assert result.declined is None, result.declined
    assert result.changed and result.program is not ep
    assert_no_complex(result.program)
    return result


def run(ep, *args):
    with torch.no_grad():
        out = ep.module()(*args)
    return out if isinstance(out, tuple) else (out,)


def eager(module, *args):
    with torch.no_grad():
        out = module(*args)
    return out if isinstance(out, tuple) else (out,)


def snapshot(ep) -> dict:
    """Everything a declined rewrite must leave as it was, copied so later mutation would show."""
    return {
        "code": ep.graph_module.code,
        "graph": str(ep.graph),
        "placeholders": [
            (n.name, n.meta["val"].dtype, tuple(n.meta["val"].shape))
            for n in ep.graph.nodes
            if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
        ],
        "state": {k: (v.dtype, v.detach().clone()) for k, v in ep.state_dict.items()},
        "constants": {
            k: (v.dtype, v.detach().clone()) for k, v in ep.constants.items() if isinstance(v, torch.Tensor)
        },
        "signature": str(ep.graph_signature),
    }


def assert_declined_unchanged(ep, before: dict, needle: str, caplog) -> str:
    with caplog.at_level(logging.WARNING, logger="zoo.rewrites"):
        result = replace_complex_with_real(ep)
    assert result.program is ep
    assert not result.changed and result.counts == {}
    assert result.declined is not None and needle in result.declined, result.declined
    assert any(needle in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    after = snapshot(ep)
    assert after["code"] == before["code"] and after["graph"] == before["graph"]
    assert after["placeholders"] == before["placeholders"]
    assert after["signature"] == before["signature"]
    for table in ("state", "constants"):
        assert after[table].keys() == before[table].keys()
        for k, (dtype, value) in before[table].items():
            assert after[table][k][0] == dtype
            assert torch.equal(after[table][k][1], value)
    return result.declined


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ============================================================================================ policy-style modules


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    """Meta Llama's reference table: complex64 [end, dim/2]."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, dtype=torch.float32)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    shape = [d if i == 1 or i == x.ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class LlamaRope(nn.Module):
    """Projections + Meta's apply_rotary_emb over a complex64 buffer sliced to the input's dynamic length."""

    def __init__(self, dim: int = 16, heads: int = 2, max_seq: int = 32):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.register_buffer("freqs_cis", precompute_freqs_cis(self.head_dim, max_seq))

    def forward(self, x):
        b, seqlen, _ = x.shape
        xq = self.wq(x).view(b, seqlen, self.heads, self.head_dim)
        xk = self.wk(x).view(b, seqlen, self.heads, self.head_dim)
        return apply_rotary_emb(xq, xk, self.freqs_cis[:seqlen])


def rope_params(max_seq_len: int, dim: int, theta: float = 10000.0) -> torch.Tensor:
    """Wan's table: complex128 [max_seq_len, dim/2]."""
    freqs = torch.outer(
        torch.arange(max_seq_len), 1.0 / torch.pow(theta, torch.arange(0, dim, 2).to(torch.float64).div(dim))
    )
    return torch.polar(torch.ones_like(freqs), freqs)


def wan_table(head_dim: int, max_seq: int) -> torch.Tensor:
    d = head_dim
    return torch.cat(
        [
            rope_params(max_seq, d - 4 * (d // 6)),
            rope_params(max_seq, 2 * (d // 6)),
            rope_params(max_seq, 2 * (d // 6)),
        ],
        dim=1,
    )


class WanRope(nn.Module):
    """Wan's rope_apply with static grid sizes; the complex128 table is a plain attribute (lifted constant)."""

    def __init__(self, head_dim: int = 12, grid_sizes=((2, 2, 3), (1, 3, 2))):
        super().__init__()
        self.freqs = wan_table(head_dim, 16)
        self.grid_sizes = grid_sizes

    def forward(self, x):  # x [B, S, N, D], S >= f*h*w of every sample
        n, c = x.size(2), x.size(3) // 2
        freqs = self.freqs.split([c - 2 * (c // 3), c // 3, c // 3], dim=1)
        output = []
        for i, (f, h, w) in enumerate(self.grid_sizes):
            seq_len = f * h * w
            x_i = torch.view_as_complex(x[i, :seq_len].to(torch.float64).reshape(seq_len, n, -1, 2))
            freqs_i = torch.cat(
                [
                    freqs[0][:f].view(f, 1, 1, -1).expand(f, h, w, -1),
                    freqs[1][:h].view(1, h, 1, -1).expand(f, h, w, -1),
                    freqs[2][:w].view(1, 1, w, -1).expand(f, h, w, -1),
                ],
                dim=-1,
            ).reshape(seq_len, 1, -1)
            x_i = torch.view_as_real(x_i * freqs_i).flatten(2)
            x_i = torch.cat([x_i, x[i, seq_len:]])
            output.append(x_i)
        return torch.stack(output).float()


class Complex128Rope(nn.Module):
    """Wan/LingBot style: x.to(float64) -> view_as_complex, times a complex128 table sliced to a dynamic length."""

    def __init__(self, head_dim: int = 8, max_seq: int = 32):
        super().__init__()
        self.freqs = rope_params(max_seq, head_dim)

    def forward(self, x):  # [B, L, N, D] float32
        b, seqlen, n, _ = x.shape
        x_c = torch.view_as_complex(x.to(torch.float64).reshape(b, seqlen, n, -1, 2))
        rotated = torch.view_as_real(x_c * self.freqs[:seqlen].view(1, seqlen, 1, -1)).flatten(3)
        return rotated, rotated.to(x.dtype)


class FastWamActionRope(nn.Module):
    """Fast-WAM apply_dense_rope: complex64 activations times a complex128 table (eager promotes first)."""

    def __init__(self, head_dim: int = 8, max_seq: int = 32):
        super().__init__()
        self.freqs = rope_params(max_seq, head_dim)

    def forward(self, x):  # [1, L, N, D] float32
        seqlen = x.shape[1]
        freqs = self.freqs[:seqlen].view(seqlen, 1, -1).to(x.device)
        x_c = torch.view_as_complex(x.to(torch.float32).reshape(*x.shape[:-1], -1, 2))
        out = torch.view_as_real(x_c * freqs).flatten(3)
        return out, out.to(x.dtype)


class LingBotRope(nn.Module):
    """LingBot-VA: polar in complex64 from grid ids and float64 base freqs, q rotated in complex128."""

    def __init__(self, head_dim: int = 24, theta: float = 10000.0):
        super().__init__()
        f, h = head_dim - 4 * (head_dim // 6), 2 * (head_dim // 6)
        # Plain attributes, as in LingBot (lifted float64 constants, not complex).
        self.f_freqs_base = 1.0 / theta ** (torch.arange(0, f, 2).double() / f)
        self.h_freqs_base = 1.0 / theta ** (torch.arange(0, h, 2).double() / h)
        self.w_freqs_base = 1.0 / theta ** (torch.arange(0, h, 2).double() / h)

    def forward(self, q, grid_ids):  # q [B, L, N, D] float32, grid_ids [B, 3, L] int64
        b, seqlen, n, _ = q.shape
        freqs = torch.cat(
            [
                grid_ids[:, 0, :, None] * self.f_freqs_base,
                grid_ids[:, 1, :, None] * self.h_freqs_base,
                grid_ids[:, 2, :, None] * self.w_freqs_base,
            ],
            dim=-1,
        ).float()
        freqs = torch.polar(torch.ones_like(freqs), freqs)[:, :, None]  # complex64 [B, L, 1, D/2]
        x = torch.view_as_complex(q.to(torch.float64).reshape(b, seqlen, n, -1, 2))
        out = torch.view_as_real(x * freqs).flatten(3)
        return out.to(q.dtype), out


# ============================================================================================ shared exports


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    module = LlamaRope()
    seq = Dim("seq", min=2, max=32)
    ep = export_ng(module, (torch.randn(2, 5, 16),), dynamic_shapes=({1: seq},))
    return module, ep, rewrite(ep)


@pytest.fixture(scope="module")
def complex128_rope():
    module = Complex128Rope()
    seq = Dim("seq", min=2, max=32)
    ep = export_ng(module, (torch.randn(2, 6, 3, 8),), dynamic_shapes=({1: seq},))
    return module, ep


# ============================================================================================ numerics


def test_llama_rope_matches_eager_at_lengths_not_used_at_export(llama):
    module, ep, result = llama
    assert result.counts["aten.view_as_complex.default"] == 2
    assert result.counts["aten.mul.Tensor"] == 2
    assert result.counts["aten.slice.Tensor"] == 1  # the buffer sliced to the dynamic length
    assert result.counts["constant"] == 1
    for seqlen in (2, 5, 9, 32):  # 5 is the export length; 2 and 32 are the range's ends
        x = torch.randn(2, seqlen, 16, generator=gen(seqlen))
        for got, ref in zip(run(result.program, x), eager(module, x)):
            assert got.dtype == ref.dtype and got.shape == ref.shape
            assert rel_l2(got, ref) < F32_TOL


def test_llama_rope_keeps_dynamic_dims(llama):
    module, ep, result = llama
    assert {str(k): (v.lower, v.upper) for k, v in result.program.range_constraints.items()} == {
        str(k): (v.lower, v.upper) for k, v in ep.range_constraints.items()
    }
    (placeholder,) = [n for n in result.program.graph.nodes if n.name == "x"]
    assert not isinstance(placeholder.meta["val"].shape[1], int)  # still symbolic
    with pytest.raises(AssertionError, match=r"x.size\(\)\[1\] <= 32"):  # the range check still runs
        run(result.program, torch.randn(2, 33, 16))


def test_llama_rope_retraces_and_passes_strict_to_edge(llama):
    from executorch.exir import to_edge

    _, _, result = llama
    retraced = result.program.run_decompositions({})
    assert_no_complex(retraced)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        edge = to_edge(result.program)  # default EdgeCompileConfig: strict IR validity check
    assert_no_complex(edge.exported_program())
    x = torch.randn(2, 7, 16, generator=gen(7))
    got = run(edge.exported_program(), x)
    for g, ref in zip(got, run(result.program, x)):
        assert rel_l2(g, ref) < F32_TOL


def test_complex128_pairs_match_complex128_eager(complex128_rope):
    module, ep = complex128_rope
    result = rewrite(ep)
    pair_table = next(v for v in result.program.constants.values() if v.dim() == 3)
    assert pair_table.dtype == torch.float64 and tuple(pair_table.shape) == (32, 4, 2)
    for seqlen in (3, 6, 17):
        x = torch.randn(2, seqlen, 3, 8, generator=gen(seqlen))
        got64, got32 = run(result.program, x)
        ref64, ref32 = eager(module, x)
        assert got64.dtype == torch.float64 and rel_l2(got64, ref64) < F64_TOL
        assert got32.dtype == torch.float32 and rel_l2(got32, ref32) < F32_TOL


def test_complex128_as_float32_stores_no_float64_and_keeps_eager_dtypes(complex128_rope):
    module, ep = complex128_rope
    result = rewrite(ep, complex128_as="float32")
    tables = [v for v in result.program.constants.values() if v.dim() == 3]
    assert [t.dtype for t in tables] == [torch.float32]
    assert any("float32" in note for note in result.notes)
    x = torch.randn(2, 11, 3, 8, generator=gen(11))
    got64, got32 = run(result.program, x)
    ref64, ref32 = eager(module, x)
    assert got64.dtype == torch.float64  # the program's real values keep eager's dtype
    assert rel_l2(got64, ref64) < F32_TOL and rel_l2(got32, ref32) < F32_TOL


def test_fast_wam_action_rope_promotes_complex64_like_eager():
    module = FastWamActionRope()
    ep = export_ng(module, (torch.randn(1, 6, 3, 8),), dynamic_shapes=({1: Dim("seq", min=2, max=32)},))
    result = rewrite(ep)
    muls = [n for n in result.program.graph.nodes if n.target is torch.ops.aten.mul.Tensor]
    assert muls and all(n.meta["val"].dtype == torch.float64 for n in muls)  # multiplied after widening
    for seqlen in (2, 6, 13):
        x = torch.randn(1, seqlen, 3, 8, generator=gen(seqlen))
        got64, got32 = run(result.program, x)
        ref64, ref32 = eager(module, x)
        # complex128 eager is the reference: c64 * c128 promotes c64 exactly, then multiplies in double.
        assert rel_l2(got64, ref64) < F64_TOL
        assert rel_l2(got32, ref32) < F32_TOL
    # Independent check of the promotion: the same product in complex64 is measurably further away.
    x = torch.randn(1, 9, 3, 8, generator=gen(99))
    x_c = torch.view_as_complex(x.reshape(1, 9, 3, 4, 2))
    low = torch.view_as_real(x_c * module.freqs[:9].view(9, 1, -1).to(torch.complex64)).flatten(3)
    ref = eager(module, x)[0]
    assert rel_l2(low.double(), ref) > 1e-9 > rel_l2(run(result.program, x)[0], ref)


def test_lingbot_polar_in_float32_then_widened():
    module = LingBotRope()
    q = torch.randn(2, 5, 2, 24)
    grid = torch.randint(0, 8, (2, 3, 5))
    seq = Dim("seq", min=2, max=64)
    ep = export_ng(module, (q, grid), dynamic_shapes=({1: seq}, {2: seq}))
    result = rewrite(ep)
    assert result.counts["aten.polar.default"] == 1
    cos = [n for n in result.program.graph.nodes if n.target is torch.ops.aten.cos.default]
    assert [n.meta["val"].dtype for n in cos] == [torch.float32]  # eager builds polar in complex64
    for seqlen in (3, 5, 20):
        q = torch.randn(2, seqlen, 2, 24, generator=gen(seqlen))
        grid = torch.randint(0, 40, (2, 3, seqlen), generator=gen(seqlen + 1))
        got32, got64 = run(result.program, q, grid)
        ref32, ref64 = eager(module, q, grid)
        assert got64.dtype == torch.float64
        assert rel_l2(got32, ref32) < F32_TOL and rel_l2(got64, ref64) < F32_TOL


def test_wan_rope_apply_static_grid():
    module = WanRope()
    x = torch.randn(2, 14, 2, 12)
    ep = export_ng(module, (x,))
    result = rewrite(ep)
    assert result.counts["aten.split_with_sizes.default"] == 1
    assert result.counts["aten.expand.default"] == 6 and result.counts["aten.cat.default"] == 2
    x = torch.randn(2, 14, 2, 12, generator=gen(3))
    (got,) = run(result.program, x)
    (ref,) = eager(module, x)
    assert rel_l2(got, ref) < F32_TOL


class PolarForward(nn.Module):
    def forward(self, r, theta):
        single = torch.polar(r, theta)
        double = torch.polar(r.double(), theta.double())
        return torch.view_as_real(single), torch.view_as_real(double)


def test_polar_with_magnitude_other_than_one_against_closed_form():
    r = torch.rand(3, 5) + 0.5
    ep = export_ng(PolarForward(), (r, torch.randn(3, 5)))
    result = rewrite(ep)
    assert result.counts["aten.polar.default"] == 2
    r = torch.rand(3, 5, generator=gen(1)) * 3 + 0.1
    theta = torch.randn(3, 5, generator=gen(2)) * 4
    got32, got64 = run(result.program, r, theta)
    rd, td = r.double(), theta.double()
    ref = torch.stack([rd * torch.cos(td), rd * torch.sin(td)], -1)  # float64 closed form
    assert got32.dtype == torch.float32 and rel_l2(got32, ref) < F32_TOL
    assert got64.dtype == torch.float64 and rel_l2(got64, ref) < F64_TOL
    assert (r - 1).abs().max() > 0.5  # the magnitudes really differ from one


class ShapeOps(nn.Module):
    """view_as_real returned twice, repeat, squeeze, transpose, cat, negative dims, chunk, split, index."""

    def forward(self, x, idx):  # x [B, L, 1, 8] float32
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], 4, 2))  # [B, L, 1, 4]
        z = z.squeeze(-2)  # [B, L, 4]
        # Split before the transpose: ExecuTorch 1.2.0's to_edge arg validator takes len() of the first
        # tensor a split returns, which pins a dynamic leading dim to its export value.
        a, b = z.chunk(2, dim=-1)
        c, d = z.split(2, dim=-1)
        w = torch.cat([a * d, b + c, z[..., :2] - a], dim=-1).repeat(2, 1, 1).transpose(0, 1)  # [L, 2B, 6]
        w = w.unsqueeze(0).permute(1, 0, 2, 3).squeeze(1)  # [L, 2B, 6]
        w = torch.stack([w, w.clone().contiguous()], dim=-2)[:, :, 0]  # [L, 2B, 6]
        sel = w.select(-1, 1)[idx]  # [K, 2B]
        v = torch.view_as_real(w.flatten(1))
        return v, v, torch.view_as_real(sel), torch.view_as_real(w.unflatten(-1, (2, 3)).narrow(-1, 1, 2))


def test_shape_ops_and_one_output_returned_twice():
    module = ShapeOps()
    x = torch.randn(2, 5, 1, 8)
    ep = export_ng(module, (x, torch.tensor([0, 2])), dynamic_shapes=({1: Dim("seq", min=3, max=16)}, None))
    result = rewrite(ep)
    for op in ("squeeze", "transpose", "chunk", "split", "cat", "repeat", "permute", "stack", "select", "index"):
        assert any(k.startswith(f"aten.{op}.") for k in result.counts), (op, result.counts)
    outputs = list(result.program.graph.output_node().args[0])
    assert outputs[0] is outputs[1]
    for seqlen in (3, 5, 11):
        x = torch.randn(2, seqlen, 1, 8, generator=gen(seqlen))
        idx = torch.tensor([seqlen - 1, 1])  # static length 2, values past the export length
        got, ref = run(result.program, x, idx), eager(module, x, idx)
        assert len(got) == 4
        for g, r in zip(got, ref):
            assert g.shape == r.shape and rel_l2(g, r) < F32_TOL


class MoreViews(nn.Module):
    """squeeze without and with a dims list, unbind, index_select, a SymInt scale, a view over the last dim."""

    def forward(self, x, idx):  # x [1, L, 1, 6] float32
        seqlen = x.shape[1]
        z = torch.view_as_complex(x.reshape(1, seqlen, 1, 3, 2))  # [1, L, 1, 3]
        a = z.squeeze()  # [L, 3]
        b = torch.squeeze(z, (0, -2))  # [L, 3]
        first, second, third = a.unbind(-1)
        picked = torch.index_select(b, -2, idx) * seqlen  # [K, 3]
        flat = (a * b).view(-1)  # the complex last dim folded into the leading one
        return (
            torch.view_as_real(torch.stack([first, second * third], -1)),
            torch.view_as_real(picked),
            torch.view_as_real(flat),
        )


def test_more_views_and_a_symbolic_scale():
    module = MoreViews()
    seq = Dim("seq", min=2, max=12)
    ep = export_ng(module, (torch.randn(1, 4, 1, 6), torch.tensor([0, 3])), dynamic_shapes=({1: seq}, None))
    result = rewrite(ep)
    for op in ("aten.squeeze.default", "aten.squeeze.dims", "aten.unbind.int", "aten.index_select.default"):
        assert result.counts.get(op), (op, result.counts)
    for seqlen in (4, 9):
        x = torch.randn(1, seqlen, 1, 6, generator=gen(seqlen))
        idx = torch.tensor([seqlen - 1, 1])
        for g, r in zip(run(result.program, x, idx), eager(module, x, idx)):
            assert g.shape == r.shape and rel_l2(g, r) < F32_TOL


class ViewOfEagerLayout(nn.Module):
    """A view eager can take only because its complex product kept the inputs' transposed layout."""

    def forward(self, x):  # [4, 3, 2]
        zt = torch.view_as_complex(x).transpose(0, 1)  # [3, 4], strides (1, 3)
        product = zt * zt  # eager keeps the transposed layout
        return torch.view_as_real(product.transpose(0, 1).view(12))


def test_view_that_needs_eager_layout_becomes_reshape():
    module = ViewOfEagerLayout()
    ep = export_ng(module, (torch.randn(4, 3, 2),))
    assert any(n.target is torch.ops.aten.view.default for n in ep.graph.nodes)
    result = rewrite(ep)
    assert result.counts["aten.view.default"] == 1
    assert any(n.target is torch.ops.aten.reshape.default for n in result.program.graph.nodes)
    x = torch.randn(4, 3, 2, generator=gen(4))
    (got,), (ref,) = run(result.program, x), eager(module, x)
    assert rel_l2(got, ref) < F32_TOL


class Casts(nn.Module):
    """Moves and casts of a complex constant, asserts, alias/detach, dynamic slices, c64 <-> c128 promotion."""

    def __init__(self):
        super().__init__()
        self.tab = rope_params(16, 12)  # complex128 [16, 6], plain attribute

    def forward(self, x):  # [B, L, 12]
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))  # c64 [B, L, 6]
        t = self.tab.to(x.device)[: x.shape[1]]  # to.dtype_layout + dynamic slice
        t = t.to(device=x.device, dtype=torch.complex128)
        t = torch.ops.aten._to_copy.default(t, device=x.device)
        low = t.to(torch.complex64)
        back = low.type_as(t)  # c64 -> c128 again
        y = (z * t).detach() + torch.ops.aten.alias.default(back)
        return torch.view_as_real(y), torch.view_as_real(z.to(torch.complex128) - low.to(torch.complex128))


def test_casts_moves_and_asserts():
    module = Casts()
    ep = export_ng(module, (torch.randn(2, 5, 12),), dynamic_shapes=({1: Dim("seq", min=2, max=16)},))
    ops = {str(n.target) for n in ep.graph.nodes}
    assert {"aten.to.dtype_layout", "aten._assert_tensor_metadata.default", "aten._to_copy.default"} <= ops
    result = rewrite(ep)
    asserts = [n for n in result.program.graph.nodes if n.target is torch.ops.aten._assert_tensor_metadata.default]
    assert asserts and all(not n.kwargs.get("dtype", torch.float32).is_complex for n in asserts)
    for seqlen in (2, 5, 16):
        x = torch.randn(2, seqlen, 12, generator=gen(seqlen))
        for g, r in zip(run(result.program, x), eager(module, x)):
            assert g.dtype == torch.float64 and rel_l2(g, r) < F64_TOL


class Constants(nn.Module):
    """Complex constants stored every way a module can hold them, including on submodules."""

    def __init__(self):
        super().__init__()
        self.register_buffer("buf", torch.polar(torch.rand(4, 3) + 0.5, torch.randn(4, 3)))
        self.register_buffer("scratch", torch.randn(4, 3, dtype=torch.complex64), persistent=False)
        self.param = nn.Parameter(torch.randn(4, 3, dtype=torch.complex64))
        self.attr = rope_params(4, 6)  # complex128 plain attribute
        self.sub = nn.Module()
        self.sub.freqs = rope_params(4, 6)  # nested plain attribute (Fast-WAM's mot.mixtures.*.freqs)
        self.sub.register_buffer("nested", torch.randn(4, 3, dtype=torch.complex64))

    def forward(self, x):  # [4, 6]
        z = torch.view_as_complex(x.reshape(4, 3, 2))
        a = z * self.buf * self.param + self.scratch - self.sub.nested
        b = z * self.attr * self.sub.freqs
        return torch.view_as_real(a), torch.view_as_real(b)


def test_constants_as_buffer_parameter_and_attributes():
    module = Constants()
    ep = export_ng(module, (torch.randn(4, 6),))
    result = rewrite(ep)
    prog = result.program
    assert result.counts["constant"] == 6
    expected = {
        "buf": module.buf, "scratch": module.scratch, "param": module.param,
        "attr": module.attr, "sub.freqs": module.sub.freqs, "sub.nested": module.sub.nested,
    }
    tables = {**prog.state_dict, **prog.constants}
    for name, original in expected.items():
        stored = tables[name]
        assert stored.dtype == (torch.float32 if original.dtype == torch.complex64 else torch.float64)
        assert torch.equal(stored, torch.view_as_real(original.detach()))  # exactly the real view
    assert isinstance(prog.state_dict["param"], nn.Parameter)
    assert "scratch" in prog.constants and "buf" in prog.state_dict  # each kept in its own table
    specs = {s.arg.name: s for s in prog.graph_signature.input_specs}
    for node in prog.graph.nodes:
        if node.op == "placeholder" and specs[node.name].target in expected:
            assert tuple(node.meta["val"].shape) == (4, 3, 2) and not node.meta["val"].is_complex()
    assert module.buf.is_complex() and ep.state_dict["buf"].is_complex()  # the caller's copies are untouched
    x = torch.randn(4, 6, generator=gen(5))
    for g, r in zip(run(prog, x), eager(module, x)):
        assert rel_l2(g, r) < F32_TOL


def test_rewritten_programs_pass_strict_to_edge():
    from executorch.exir import to_edge

    module = Constants()
    result = rewrite(export_ng(module, (torch.randn(4, 6),)))
    shapes = ShapeOps()
    seq = Dim("s", min=3, max=9)
    shape_result = rewrite(
        export_ng(shapes, (torch.randn(2, 5, 1, 8), torch.tensor([0, 2])), dynamic_shapes=({1: seq}, None))
    )
    for prog, args, ref in [
        (result.program, (torch.randn(4, 6, generator=gen(8)),), module),
        (shape_result.program, (torch.randn(2, 7, 1, 8, generator=gen(9)), torch.tensor([6, 1])), shapes),
    ]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            edge = to_edge(prog).exported_program()
        assert_no_complex(edge)
        for g, r in zip(run(edge, *args), eager(ref, *args)):
            assert rel_l2(g, r) < F32_TOL


class RopeThenCond(nn.Module):
    """A real-only torch.cond downstream of the rope: kept, re-valued, and given its own copy of the bodies."""

    def __init__(self):
        super().__init__()
        self.register_buffer("freqs_cis", precompute_freqs_cis(4, 16))

    def forward(self, x):  # [1, L, 1, 4]
        q, _ = apply_rotary_emb(x, x, self.freqs_cis[: x.shape[1]])
        return torch.cond(q.sum() > 0, lambda t: t * 2, lambda t: t - 1, (q,))


def test_real_higher_order_ops_are_kept_with_private_bodies():
    module = RopeThenCond()
    ep = export_ng(module, (torch.randn(1, 5, 1, 4),), dynamic_shapes=({1: Dim("seq", min=2, max=16)},))
    result = rewrite(ep)
    old_bodies = {n: m for n, m in ep.graph_module.named_children()}
    new_bodies = {n: m for n, m in result.program.graph_module.named_children()}
    assert old_bodies.keys() == new_bodies.keys() and old_bodies
    for name, old in old_bodies.items():
        assert new_bodies[name] is not old and new_bodies[name].graph is not old.graph
    for seqlen in (3, 5, 12):
        for sign in (1.0, -1.0):
            x = sign * torch.rand(1, seqlen, 1, 4, generator=gen(seqlen))
            (got,), (ref,) = run(result.program, x), eager(module, x)
            assert rel_l2(got, ref) < F32_TOL


# ============================================================================================ no-ops and bad input


def test_program_without_complex_values_is_unchanged():
    ep = export_ng(nn.Linear(4, 3), (torch.randn(2, 4),))
    before = snapshot(ep)
    result = replace_complex_with_real(ep)
    assert result.program is ep and not result.changed and result.declined is None and result.counts == {}
    assert snapshot(ep)["code"] == before["code"]


def test_bad_arguments_raise_zoo_errors(llama):
    _, ep, _ = llama
    with pytest.raises(ZooError, match="complex128_as"):
        replace_complex_with_real(ep, complex128_as="bfloat16")
    with pytest.raises(ZooError, match="ExportedProgram"):
        replace_complex_with_real(nn.Linear(2, 2))


# ============================================================================================ declines


class ComplexInput(nn.Module):
    def forward(self, z):
        return torch.view_as_real(z * 2)


class ComplexOutput(nn.Module):
    def forward(self, x):
        return torch.view_as_complex(x) * 2, x + 1


class CondBranch(nn.Module):
    def forward(self, x):
        def rotate(x):
            z = torch.view_as_complex(x.reshape(4, 2))
            return torch.view_as_real(z * z).flatten()

        def shift(x):
            return x + 1

        return torch.cond(x.sum() > 0, rotate, shift, (x,))


class GradRegion(nn.Module):  # exported under no_grad, enable_grad becomes wrap_with_set_grad_enabled
    def forward(self, x):
        z = torch.view_as_complex(x)
        with torch.enable_grad():
            y = torch.view_as_real(z * z)
        return y + 1


class Complex32(nn.Module):
    def forward(self, x):
        return torch.view_as_real(torch.view_as_complex(x.half()) * 2).float()


class MutatedBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("state", torch.zeros(4, dtype=torch.complex64))

    def forward(self, x):
        self.state.mul_(torch.view_as_complex(x))
        return x * 2


class Fft(nn.Module):
    def forward(self, x):
        return torch.view_as_real(torch.fft.fft(x[:, 0]))


class ComplexToReal(nn.Module):
    def forward(self, x):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.view_as_complex(x).to(torch.float32)


class ComplexPlusReal(nn.Module):
    def forward(self, x):
        return torch.view_as_real(torch.view_as_complex(x) + x[:, 0])


X42 = torch.randn(4, 2)

DECLINES = [
    pytest.param(
        ComplexInput(), (torch.randn(3, dtype=torch.complex64),), "complex program input 'z'", id="input"
    ),
    pytest.param(ComplexOutput(), (X42,), "complex program output", id="output"),
    pytest.param(CondBranch(), (torch.randn(8),), "higher_order.cond", id="cond"),
    pytest.param(GradRegion(), (X42,), "higher_order.wrap_with_set_grad_enabled", id="hop"),
    pytest.param(Complex32(), (X42,), "complex32", id="complex32"),
    pytest.param(MutatedBuffer(), (X42,), "mutates complex buffer 'state'", id="mutated-buffer"),
    pytest.param(Fft(), (X42,), "aten.fft_fft.default", id="unknown-op"),
    pytest.param(ComplexToReal(), (X42,), "casts complex to real", id="complex-to-real"),
    pytest.param(ComplexPlusReal(), (torch.randn(2, 2),), "only complex +/- complex", id="complex-plus-real"),
]


@pytest.mark.parametrize("module, args, needle", DECLINES)
def test_declines_leave_the_program_exactly_as_it_was(module, args, needle, caplog):
    ep = export_ng(module, args)
    before = snapshot(ep)
    reason = assert_declined_unchanged(ep, before, needle, caplog)
    if needle.startswith("aten."):
        assert "test_complex_to_real.py" in reason  # the user's source line


def test_functionalised_mutated_buffer_is_declined(caplog):
    class Accumulate(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("state", torch.ones(4, dtype=torch.complex64))

        def forward(self, x):
            self.state.copy_(torch.view_as_complex(x) * self.state)
            return x * 2

    ep = export_ng(Accumulate(), (X42,)).run_decompositions({})
    assert "state" in ep.graph_signature.buffers_to_mutate.values()
    assert_declined_unchanged(ep, snapshot(ep), "complex buffer 'state' is mutated", caplog)


def test_failure_after_matching_declines_and_leaves_the_program(monkeypatch, caplog):
    module = Constants()
    ep = export_ng(module, (torch.randn(4, 6),))
    before = snapshot(ep)

    def broken(rw, node):
        raise RuntimeError("synthetic failure")

    rule = complex_rules.Rule(broken, complex_rules.no_objection)
    monkeypatch.setitem(complex_rules.RULES, torch.ops.aten.mul.Tensor, rule)
    reason = assert_declined_unchanged(ep, before, "synthetic failure", caplog)
    assert "aten.mul.Tensor" in reason


# ============================================================================================ scale


class Stack(nn.Module):
    def __init__(self, layers: int):
        super().__init__()
        self.layers = layers
        self.register_buffer("freqs_cis", precompute_freqs_cis(8, 32))

    def forward(self, x):  # [1, L, 2, 8]
        for _ in range(self.layers):
            q, k = apply_rotary_emb(x, x * 0.5, self.freqs_cis[: x.shape[1]])
            x = q + k
        return x



def test_deep_stack_rewrites_every_layer_and_matches_eager():
    # The rewrite's speed is measured by benchmarks, not here; this checks a 40-layer program is handled whole.
    module = Stack(40)
    ep = export_ng(module, (torch.randn(1, 6, 2, 8),))
    result = rewrite(ep)
    assert result.changed and result.declined is None
    assert result.counts["aten.mul.Tensor"] == 80
    x = torch.randn(1, 6, 2, 8, generator=torch.Generator().manual_seed(3))
    got, want = result.program.module()(x), module(x)
    assert torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want) < 1e-6
