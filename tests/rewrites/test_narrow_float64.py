"""narrow_float64: no float64 value left anywhere, results within float32 rounding of the float64 source."""

from __future__ import annotations

import logging

import torch
from torch import nn

from zoo.rewrites import get
from zoo.rewrites.narrow_float64 import float64_nodes, has_float64

narrow = get("narrow_float64")
to_real = get("replace_complex_with_real")


class LingBotStyleRope(nn.Module):
    """LingBot-VA's rope in miniature: rope angles from float64 base frequencies (a plain attribute) times
    integer grid ids, polar in complex64, then q cast to float64 and rotated in complex128."""

    def __init__(self):
        super().__init__()
        self.base = 1.0 / (10000.0 ** (torch.arange(0, 8, dtype=torch.float64) / 8))
        self.proj = nn.Linear(16, 16)

    def forward(self, x, grid):  # x: [B, L, 16], grid: int64 [B, L]
        angles = torch.cat([grid[:, :, None] * self.base, grid[:, :, None] * self.base * 0.5], dim=-1).float()
        freqs = torch.polar(torch.ones_like(angles), angles)[:, :, :8]  # complex64 [B, L, 8]
        q = self.proj(x)
        qc = torch.view_as_complex(q.to(torch.float64).reshape(*q.shape[:2], 8, 2))
        return torch.view_as_real(qc * freqs).flatten(2).to(q.dtype)


def export(module, *args):
    with torch.no_grad():
        return torch.export.export(module, args, strict=False)


def rel(a, b):
    return float(torch.linalg.vector_norm(a.double() - b.double()) / torch.linalg.vector_norm(b.double()))


def inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 6, 16, generator=g), torch.randint(0, 2000, (2, 6), generator=g)


def test_float32_pairs_then_narrowing_leaves_no_float64_and_matches_eager():
    module = LingBotStyleRope().eval()
    ep = to_real(export(module, *inputs(0)), complex128_as="float32").program
    assert float64_nodes(ep)  # the real float64 math around the rope is still there
    result = narrow(ep)
    assert result.changed and result.declined is None and result.counts["float64 state"] == 1
    assert not has_float64(result.program) and float64_nodes(result.program) == {}
    for seed in (1, 2, 3):
        x, grid = inputs(seed)
        # float32 rounding of angles up to ~2000 rad and of the rotation: well inside the 1e-5 float32 bound
        assert rel(result.program.module()(x, grid), module(x, grid)) < 1e-5
    from executorch.exir import to_edge

    to_edge(result.program)  # still a valid program for the lowering path


def test_program_without_float64_comes_back_unchanged():
    ep = export(nn.Linear(4, 4), torch.randn(2, 4))
    result = narrow(ep)
    assert result.program is ep and not result.changed and result.declined is None


class Float64Out(nn.Module):
    def forward(self, x):
        return x.double() * 2


class Float64In(nn.Module):
    def forward(self, x):
        return (x * 2).float()


class MutatesFloat64(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("acc", torch.zeros(3, dtype=torch.float64))

    def forward(self, x):
        self.acc.add_(x.double())
        return self.acc.float()


def test_declines_leave_the_program_as_it_was(caplog):
    cases = [(Float64Out(), torch.randn(3), "output"), (Float64In(), torch.randn(3, dtype=torch.float64), "input"),
             (MutatesFloat64(), torch.randn(3), "mutated")]
    for module, x, why in cases:
        ep = export(module, x)
        code = ep.graph_module.code
        with caplog.at_level(logging.WARNING, logger="zoo.rewrites"):
            result = narrow(ep)
        assert result.program is ep and not result.changed and why in result.declined
        assert ep.graph_module.code == code
