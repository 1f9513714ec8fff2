"""replace_fused_sdpa_with_sdpa: each fused variant against float64 attention math, and every keep-condition.

The fused kernels have no CPU implementation, but they trace with fake tensors, so the modules below call them
directly and are exported; the rewritten program then runs on the CPU. The reference is written out here in
float64: softmax(q k^T * scale + bias) v, key/value heads repeated per query-head group, a top-left causal mask.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn
from torch.export import Dim, export

from zoo.rewrites import replace_fused_sdpa_with_sdpa

aten = torch.ops.aten
FLASH = aten._scaled_dot_product_flash_attention.default
EFFICIENT = aten._scaled_dot_product_efficient_attention.default
CUDNN = aten._scaled_dot_product_cudnn_attention.default
FOR_CPU = aten._scaled_dot_product_flash_attention_for_cpu.default
SDPA = aten.scaled_dot_product_attention.default
TOL = 1e-5  # float32 attention vs the float64 formula, at these sizes


def reference(q, k, v, bias=None, causal=False, scale=None):
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    scores = q @ k.transpose(-2, -1) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if bias is not None:
        scores = scores + bias.double()
    if causal:
        lq, lk = scores.shape[-2:]
        scores = scores.masked_fill(~torch.ones(lq, lk, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


class Fused(nn.Module):
    """Calls one fused kernel; ``use`` names extra outputs to return besides the attention output."""

    def __init__(self, op, causal=False, with_bias=False, scale=None, use=(), debug=False):
        super().__init__()
        self.op, self.causal, self.with_bias, self.scale, self.use, self.debug = op, causal, with_bias, scale, use, debug

    def forward(self, q, k, v, bias):
        b = bias if self.with_bias else None
        if self.op is FLASH:
            out = FLASH(q, k, v, 0.0, self.causal, self.debug, scale=self.scale)
        elif self.op is EFFICIENT:
            out = EFFICIENT(q, k, v, b, bool(self.use), 0.0, self.causal, scale=self.scale)
        elif self.op is CUDNN:
            out = CUDNN(q, k, v, b, bool(self.use), 0.0, self.causal, self.debug, scale=self.scale)
        else:
            out = FOR_CPU(q, k, v, 0.0, self.causal, attn_mask=b, scale=self.scale)
        return (out[0] * 1,) + tuple(out[i] for i in self.use)


def inputs(seed, lq=5, lkv=5, hq=4, hkv=2):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, hq, lq, 8, generator=g), torch.randn(1, hkv, lkv, 8, generator=g),
            torch.randn(1, hkv, lkv, 8, generator=g), torch.randn(1, hq, lq, lkv, generator=g))


def sdpa_nodes(ep):
    return [n for n in ep.graph.nodes if n.op == "call_function" and n.target is SDPA]


@pytest.mark.parametrize("op, with_bias, causal", [
    (FLASH, False, False), (FLASH, False, True), (EFFICIENT, True, False), (EFFICIENT, False, True),
    (CUDNN, True, False), (CUDNN, False, True), (FOR_CPU, True, False), (FOR_CPU, False, True),
], ids=lambda p: getattr(p, "__name__", str(p)))
def test_variant_becomes_sdpa_and_matches_attention_math(op, with_bias, causal):
    module = Fused(op, causal=causal, with_bias=with_bias, scale=0.3)
    ep = export(module, inputs(0))
    result = replace_fused_sdpa_with_sdpa(ep)
    assert result.declined is None and result.changed and result.program is not ep
    assert result.counts == {str(op): 1} and result.notes == []
    (node,) = sdpa_nodes(result.program)
    assert node.kwargs["enable_gqa"] is True  # 2 key heads for 4 query heads
    for seed in (1, 2):
        q, k, v, bias = inputs(seed)
        got = result.program.module()(q, k, v, bias)[0]
        want = reference(q, k, v, bias if with_bias else None, causal, scale=0.3)
        assert (got.double() - want).abs().max().item() < TOL


def test_same_head_count_uses_no_gqa():
    ep = export(Fused(EFFICIENT, with_bias=True), inputs(0, hkv=4))
    result = replace_fused_sdpa_with_sdpa(ep)
    (node,) = sdpa_nodes(result.program)
    assert "enable_gqa" not in node.kwargs and "scale" not in node.kwargs
    q, k, v, bias = inputs(3, hkv=4)
    assert (result.program.module()(q, k, v, bias)[0].double() - reference(q, k, v, bias)).abs().max() < TOL


def kept(ep, caplog):
    with caplog.at_level(logging.WARNING, logger="zoo.rewrites"):
        result = replace_fused_sdpa_with_sdpa(ep)
    assert result.program is ep and not result.changed and result.declined is None
    (note,) = result.notes
    assert note in caplog.text  # said at warning level
    return note


def test_kept_when_log_sum_exp_is_used(caplog):
    note = kept(export(Fused(EFFICIENT, use=(1,)), inputs(0)), caplog)
    assert "log_sumexp output is used" in note and "test_fused_sdpa.py" in note


def test_kept_when_debug_mask_is_used(caplog):
    note = kept(export(Fused(FLASH, debug=True, use=(8,)), inputs(0)), caplog)
    assert "debug_attn_mask output is used" in note


def test_kept_when_causal_with_bias(caplog):
    note = kept(export(Fused(CUDNN, causal=True, with_bias=True), inputs(0)), caplog)
    assert "causal with a bias" in note


@pytest.mark.parametrize("op", [FLASH, EFFICIENT, CUDNN, FOR_CPU], ids=str)
def test_kept_when_causal_and_lengths_differ(op, caplog):
    note = kept(export(Fused(op, causal=True), inputs(0, lq=3, lkv=5)), caplog)
    assert "L_q == L_kv is not statically known (L_q=3, L_kv=5)" in note


def test_kept_when_causal_and_lengths_are_independent_symbols(caplog):
    dims = ({2: Dim("lq", min=2, max=8)}, {2: Dim("lkv", min=2, max=8)}, {2: Dim("lkv", min=2, max=8)}, None)
    ep = export(Fused(FLASH, causal=True), inputs(0, lq=4, lkv=6), dynamic_shapes=dims)
    assert "L_q == L_kv is not statically known" in kept(ep, caplog)


def test_causal_with_one_symbolic_length_is_replaced():
    seq = Dim("seq", min=2, max=8)
    dims = ({2: seq}, {2: seq}, {2: seq}, None)
    ep = export(Fused(FLASH, causal=True), inputs(0, lq=6, lkv=6), dynamic_shapes=dims)
    result = replace_fused_sdpa_with_sdpa(ep)
    assert result.changed and result.notes == []
    unused_bias = inputs(0, lq=6, lkv=6)[3]  # static in the export, not read by a causal call
    for length in (3, 7):
        q, k, v, _ = inputs(4, lq=length, lkv=length)
        want = reference(q, k, v, causal=True)
        assert (result.program.module()(q, k, v, unused_bias)[0].double() - want).abs().max() < TOL


def test_kept_and_replaced_nodes_in_one_program(caplog):
    class Two(nn.Module):
        def forward(self, q, k, v, bias):
            kept_out = EFFICIENT(q, k, v, bias, True, 0.0, False)
            replaced = FLASH(q, k, v, 0.0, False, False)
            return kept_out[0] + kept_out[1].sum(), replaced[0]

    ep = export(Two(), inputs(0))
    with caplog.at_level(logging.WARNING, logger="zoo.rewrites"):
        result = replace_fused_sdpa_with_sdpa(ep)
    assert result.changed and result.counts == {str(FLASH): 1}
    (note,) = result.notes
    assert str(EFFICIENT) in note and "log_sumexp" in note and note in caplog.text
    remaining = [n.target for n in result.program.graph.nodes if n.op == "call_function"]
    assert EFFICIENT in remaining and FLASH not in remaining


def test_heads_that_do_not_group_decline_untouched():
    ep = export(Fused(FLASH), inputs(0, hq=3, hkv=2))
    before = str(ep.graph)
    result = replace_fused_sdpa_with_sdpa(ep)
    assert result.program is ep and not result.changed
    assert str(FLASH) in result.declined and "test_fused_sdpa.py" in result.declined
    assert "2 key heads do not divide 3 query heads" in result.declined
    assert str(ep.graph) == before


def test_plain_sdpa_program_is_unchanged():
    class Plain(nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v, _ = inputs(0, hkv=4)
    ep = export(Plain(), (q, k, v))
    result = replace_fused_sdpa_with_sdpa(ep)
    assert result.program is ep and not result.changed and result.notes == [] and result.declined is None
