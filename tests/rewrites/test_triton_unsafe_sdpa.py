"""replace_triton_unsafe_sdpa_with_math: the SDPA nodes executorch 1.2.0's Triton kernel computes wrong are written out,
the result checked against attention math in float64; the nodes it computes right are left alone.

The reference is written out here in float64: softmax(q k^T * scale + bias) v, a boolean mask as keep/drop, a top-left
causal mask. A row whose mask drops every key is zeros in torch's own SDPA; that case is checked against torch.
The fault cases come from reading the kernel (``backends/cuda/triton/kernels/sdpa.py``); the H200 measured the first
two (docs/benchmarks.md, "ExecuTorch's Triton SDPA").
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim, export

from inductor_probe import fallback_ops, inductor_input
from zoo.rewrites import replace_triton_unsafe_sdpa_with_math as rewrite
from zoo.rewrites.triton_unsafe_sdpa import triton_sdpa_faults

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default


def reference(q, k, v, mask=None, causal=False, scale=None):
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-2, -1) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        scores = scores + mask.double()
    return torch.softmax(scores, dim=-1) @ v


class Attention(nn.Module):
    def __init__(self, causal=False, scale=None, dropout=0.0, gqa=False):
        super().__init__()
        self.causal, self.scale, self.dropout, self.gqa = causal, scale, dropout, gqa

    def forward(self, q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout, is_causal=self.causal,
                                              scale=self.scale, enable_gqa=self.gqa) * 1


def qkv(seed, heads=2, lq=7, lkv=7, width=320, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, heads, n, width, generator=g).to(dtype) for n in (lq, lkv, lkv))


def sdpa_count(ep):
    return sum(1 for n in ep.graph.nodes if n.op == "call_function" and n.target is SDPA)


def rewritten(module, args, dynamic_shapes=None):
    with torch.no_grad():
        ep = export(module.eval(), args, dynamic_shapes=dynamic_shapes)
    result = rewrite(ep)
    assert result.declined is None, result.declined
    return ep, result


def rel_l2(got, want):
    return float((got.double() - want).norm() / want.norm())


# --------------------------------------------------------------------------------- what the kernel gets wrong


def test_the_faults_are_named_for_a_hand_picked_set_of_shapes():
    def t(*shape, stride=None):
        x = torch.empty(*shape, device="meta")
        return x if stride is None else x.as_strided(shape, stride)

    q, k = t(2, 1, 64, 640), t(2, 1, 64, 640)
    (wide,) = triton_sdpa_faults(q, k, k, None, False)
    assert "640/640 channels wide" in wide and "first 256 channels" in wide
    (unmasked,) = triton_sdpa_faults(t(2, 4, 64, 128), t(2, 4, 64, 128), t(2, 4, 64, 128), None, False)
    assert "64 keys, not a multiple of 256" in unmasked
    narrow = (t(2, 4, 64, 128), t(2, 4, 512, 128), t(2, 4, 512, 128))
    assert triton_sdpa_faults(*narrow, None, False) == []  # whole key blocks
    assert triton_sdpa_faults(t(2, 4, 64, 128), t(2, 4, 64, 128), t(2, 4, 64, 128), None, True) == []  # causal masks
    assert triton_sdpa_faults(t(2, 4, 64, 80), t(2, 4, 64, 80), t(2, 4, 64, 80), None, False) == []  # masks its keys
    assert triton_sdpa_faults(*narrow, t(2, 1, 64, 512), False) == []  # one mask for every head
    (per_head,) = triton_sdpa_faults(*narrow, t(2, 4, 64, 512), False)
    assert "mask has 4 heads" in per_head
    assert triton_sdpa_faults(*narrow, t(2, 4, 64, 512, stride=(64 * 512, 0, 512, 1)), False) == []  # expanded


@pytest.mark.parametrize("case, width, mask_kind, causal, scale", [
    ("wide head", 320, None, False, None),
    ("wide head, causal", 320, None, True, None),
    ("wide head, bool mask", 320, "bool", False, None),
    ("wide head, float mask and scale", 320, "float", False, 0.05),
    ("narrow head, no mask, 7 keys", 128, None, False, None),
    ("narrow head, mask per head", 128, "bool", False, None),
])
def test_unsafe_attention_is_written_out_and_matches_attention_math(case, width, mask_kind, causal, scale):
    q, k, v = qkv(1, width=width)
    g = torch.Generator().manual_seed(2)
    mask = {None: None, "bool": torch.rand(1, 2, 7, 7, generator=g) > 0.3,
            "float": torch.randn(1, 2, 7, 7, generator=g)}[mask_kind]
    if mask_kind == "bool":
        mask[..., :, 0] = True  # every row keeps a key: the float64 formula has no NaN-free form otherwise
    args = (q, k, v) if mask is None else (q, k, v, mask)
    ep, result = rewritten(Attention(causal=causal, scale=scale), args)
    assert result.changed and result.counts == {"aten.scaled_dot_product_attention.default": 1}, case
    assert sdpa_count(result.program) == 0 and sdpa_count(ep) == 1  # the caller's program is untouched
    assert "written out" in result.notes[0]
    got = result.program.module()(*args)
    assert rel_l2(got, reference(q, k, v, mask, causal, scale)) < 1e-6, case


def test_bf16_is_computed_in_float32_and_returned_in_bf16():
    q, k, v = qkv(3, width=640, dtype=torch.bfloat16)
    _, result = rewritten(Attention(), (q, k, v))
    got = result.program.module()(q, k, v)
    assert got.dtype == torch.bfloat16
    want = reference(q, k, v)  # from the bf16 values themselves: the only error left is the output's rounding
    assert rel_l2(got, want) < 2 ** -8
    casts = [n for n in result.program.graph.nodes if n.target is aten._to_copy.default]
    assert [n.kwargs["dtype"] for n in casts] == [torch.float32] * 3 + [torch.bfloat16]


def test_a_row_that_masks_every_key_is_zeros_as_in_torchs_own_sdpa():
    q, k, v = qkv(4, width=320)
    mask = torch.ones(1, 2, 7, 7, dtype=torch.bool)
    mask[0, 1, 3] = False
    _, result = rewritten(Attention(), (q, k, v, mask))
    got = result.program.module()(q, k, v, mask)
    with torch.no_grad():
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.isfinite(got).all() and got[0, 1, 3].abs().max() == 0
    assert torch.allclose(got, want, atol=1e-5) and torch.isfinite(want).all()


def test_a_dynamic_key_length_counts_against_the_kernel_and_the_program_runs_at_every_length():
    q, k, v = qkv(5, width=128, lq=9, lkv=9)
    length = Dim("length", min=2, max=300)
    _, result = rewritten(Attention(), (q, k, v), dynamic_shapes=({2: length}, {2: length}, {2: length}))
    assert result.changed
    for n in (3, 256, 300):
        q, k, v = qkv(6, width=128, lq=n, lkv=n)
        assert rel_l2(result.program.module()(q, k, v), reference(q, k, v)) < 1e-6, n


# --------------------------------------------------------------------------------- what is left alone


@pytest.mark.parametrize("case, width, lkv, causal, mask", [
    ("narrow head, whole key blocks", 128, 256, False, None),
    ("narrow head, causal", 128, 7, True, None),
    ("narrow head, mask for every head", 64, 7, False, "shared"),
    ("narrow head not a power of two", 80, 7, False, None),
])
def test_attention_the_kernel_computes_right_is_left_alone(case, width, lkv, causal, mask):
    q, k, v = qkv(7, width=width, lq=lkv, lkv=lkv)
    args = (q, k, v) if mask is None else (q, k, v, torch.ones(1, 1, lkv, lkv, dtype=torch.bool).tril())
    ep, result = rewritten(Attention(causal=causal), args)
    assert not result.changed and result.program is ep, case


def test_dropout_declines_the_program_naming_the_reason():
    with torch.no_grad():
        ep = export(Attention(dropout=0.1), qkv(8))
    result = rewrite(ep)
    assert result.program is ep and "dropout" in result.declined and "p=0.1" in result.declined


def test_grouped_query_attention_declines_the_program():
    q, _, _ = qkv(9, heads=4)
    _, k, v = qkv(9, heads=2)
    with torch.no_grad():
        ep = export(Attention(gqa=True), (q, k, v))
    result = rewrite(ep)
    assert result.program is ep and "grouped-query" in result.declined


# --------------------------------------------------------------------------------- what reaches Inductor


def test_the_written_out_form_reaches_inductor_with_no_sdpa_and_no_fallback_kernel():
    q, k, v = qkv(10, width=640, dtype=torch.bfloat16)
    _, result = rewritten(Attention(), (q, k, v))
    probe = inductor_input(result.program)
    targets = {str(n.target) for n in probe.graph.nodes if n.op == "call_function"}
    assert not any("scaled_dot_product" in t or "sdpa" in t for t in targets), targets
    assert "aten.einsum.default" in targets and "aten._softmax.default" in targets, targets
    assert fallback_ops(probe) == set()  # einsum is composite: Inductor traces it into its GEMMs


def test_the_output_keeps_the_layout_the_nodes_after_it_were_traced_on():
    # SDPA's output follows its query's layout. Attention code passes [B, L, H, D] tensors transposed, and merges
    # the heads after it with a reshape that export traced as a view on those strides.
    class HeadsLast(nn.Module):
        def forward(self, q, k, v):  # [B, L, H, D]
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)

    q, k, v = (t.transpose(1, 2).contiguous() for t in qkv(11, heads=3, width=128))
    ep, result = rewritten(HeadsLast(), (q, k, v))
    assert result.changed
    (old,) = [n.meta["val"] for n in ep.graph.nodes if n.target is SDPA]
    assert not old.is_contiguous()  # the case this test is about
    got = result.program.module()(q, k, v)
    want = reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2).reshape(1, 7, -1)
    assert rel_l2(got, want) < 1e-6
