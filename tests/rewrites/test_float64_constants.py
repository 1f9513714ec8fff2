"""split_float64_constants: float64 state stored as float32 (hi, lo), rebuilt in float64 in the graph."""

from __future__ import annotations

import logging

import torch
from torch import nn

from zoo.rewrites import get
from zoo.rewrites.float64_constants import split_pair

rewrite = get("split_float64_constants")


class BaseFreqs(nn.Module):
    """LingBot-VA's rope in miniature: float64 base frequencies as a plain attribute (a lifted constant), a
    buffer and a parameter, multiplied by integer grid ids, then cast to float32 angles."""

    def __init__(self):
        super().__init__()
        self.f_base = 1.0 / (10000.0 ** (torch.arange(0, 22, dtype=torch.float64) / 22))  # lifted constant
        self.register_buffer("h_base", 1.0 / (10000.0 ** (torch.arange(0, 21, dtype=torch.float64) / 21)))
        self.w_base = nn.Parameter(1.0 / (1234.5 ** (torch.arange(0, 21, dtype=torch.float64) / 21)),
                                   requires_grad=False)

    def forward(self, grid):  # grid: int64 [B, 3, L]
        f = grid[:, 0, :, None] * self.f_base
        h = grid[:, 1, :, None] * self.h_base
        w = grid[:, 2, :, None] * self.w_base
        return torch.cat([f, h, w], dim=-1).float()


def export(module, *args):
    with torch.no_grad():
        return torch.export.export(module, args, strict=False)


def state_dtypes(ep):
    return {k: v.dtype for k, v in {**ep.state_dict, **ep.constants}.items() if isinstance(v, torch.Tensor)}


def test_split_pair_rebuilds_float64_to_2_pow_minus_48():
    c = torch.tensor([1.0 / 3.0, 1e-7 / 7.0, 12345.678901234567, -2.0 ** 0.5], dtype=torch.float64)
    pair = split_pair(c)
    assert pair.dtype == torch.float32 and pair.shape == (2, 4)
    rebuilt = pair[0].double() + pair[1].double()
    assert torch.all((rebuilt - c).abs() <= 2.0 ** -48 * c.abs())
    assert not torch.equal(pair[0].double(), c)  # float32 alone would not do


def test_no_float64_state_is_left_and_results_match_eager():
    module = BaseFreqs()
    grid = torch.randint(0, 2000, (2, 3, 16), generator=torch.Generator().manual_seed(0))
    ep = export(module, grid)
    assert torch.float64 in state_dtypes(ep).values()
    result = rewrite(ep)
    assert result.changed and result.declined is None and result.counts == {"float64 constant": 3}
    assert torch.float64 not in state_dtypes(result.program).values()
    for seed in (1, 2):
        g = torch.randint(0, 5000, (2, 3, 16), generator=torch.Generator().manual_seed(seed))
        want = module(g)
        got = result.program.module()(g)
        # The angles are float32 in the end: rebuilt float64 bases give the same float32 values.
        assert torch.equal(got, want)
    # The caller's program still stores float64 (a new program was built beside it).
    assert torch.float64 in state_dtypes(ep).values()


def test_program_still_retraces_and_passes_to_edge():
    from executorch.exir import to_edge

    result = rewrite(export(BaseFreqs(), torch.zeros(1, 3, 4, dtype=torch.int64)))
    result.program.run_decompositions({})
    to_edge(result.program)


class NoFloat64(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.ones(3))

    def forward(self, x):
        return x + self.b


def test_program_without_float64_state_comes_back_unchanged():
    ep = export(NoFloat64(), torch.randn(3))
    result = rewrite(ep)
    assert result.program is ep and not result.changed and result.declined is None


class MutatesFloat64(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("acc", torch.zeros(4, dtype=torch.float64))

    def forward(self, x):
        self.acc.add_(x.double())
        return self.acc.float() * 2


def test_mutated_float64_buffer_declines_and_leaves_the_program(caplog):
    ep = export(MutatesFloat64(), torch.randn(4))
    code, dtypes = ep.graph_module.code, state_dtypes(ep)
    with caplog.at_level(logging.WARNING, logger="zoo.rewrites"):
        result = rewrite(ep)
    assert result.program is ep and not result.changed
    assert "acc" in result.declined and "mutated" in result.declined
    assert "declined" in caplog.text
    assert ep.graph_module.code == code and state_dtypes(ep) == dtypes
