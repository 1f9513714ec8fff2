"""Split-KV ("flash-decoding") attention in Triton: the CUDA path of ``zoo::split_kv_attention``.

    out = softmax(q k^T * scale, masked keys at -inf) v          q [B, H, Lq, D], k and v [B, H, S, D]

ExecuTorch 1.2's own Triton SDPA gives each program one block of queries of one head and streams every key
through it: with few queries (LingBot-VA's action_step has 16 per head) that is B*H programs on a GPU of 132
SMs, each reading all S keys, masked ones included. Here the keys are cut into ``num_splits`` slices as well:

1. ``_split_kv_attention_partial``, grid (B*H, query blocks, splits): each program runs the online softmax over
   its slice of the keys in float32 and writes its unnormalised sum, its running maximum and its running
   denominator to float32 scratch. A key block that no query row of the program sees is skipped before its
   keys and values are loaded, and inside a block the keys nobody sees are not loaded either (masked loads), so
   the program reads only the live slots of a KV pool;
2. ``_split_kv_attention_combine``, grid (B*H, Lq): each program rescales the splits of one query row to a
   common maximum and divides by the total denominator.

With one split the first kernel normalises and writes the output itself. Maxima are kept in base 2 (the
scores are scaled by ``scale * log2(e)`` and exponentiated with ``exp2``). A row whose keys are all masked
ends with maximum -inf and denominator 0 and is written as zeros, as torch's SDPA writes it; no -inf - -inf
is ever computed.

Under ``TRITON_INTERPRET=1`` (set before this module is imported) the kernels run in Triton's interpreter on
CPU tensors, which is how the tests check them on a machine without a GPU.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton
from triton.runtime.jit import JITFunction

# Launch shape. Fixed, no autotuning: a kernel compiled into an AOTInductor .so keeps the configuration it was
# built with, and these are the usual flash-attention choices for heads of 64-128.
BLOCK_N = 64  # keys per block
NUM_STAGES = 2

# How many splits: enough programs for about three waves of an H100's / H200's 132 SMs, but at least two key
# blocks per split (a split's scratch write, D floats a row, stays small beside the K/V it reads) and at most
# 32 splits (the combine kernel holds every split of a row in registers).
SMS = 132
TARGET_PROGRAMS = 3 * SMS
MIN_BLOCKS_PER_SPLIT = 2
MAX_SPLITS = 32

LOG2_E = 1.4426950408889634

# Head widths the kernel takes: a power of two (tl.arange) of at least 16 (tl.dot) and at most 256.
HEAD_DIMS = (16, 32, 64, 128, 256)


@triton.jit
def _attend_block(q, k, v, visible, acc, row_max, row_sum, qk_scale_log2, EXACT_DOT: tl.constexpr):
    """One key block of the online softmax: the running (acc, row_max, row_sum) after it. Scores of keys a row
    does not see are -inf; a row that has seen no key yet keeps max -inf and is shifted by 0, so exp2 gives 0
    and -inf - -inf is never computed."""
    # float32 inputs: products in float32 (tl.dot's default there is TF32, 10-bit mantissas)
    if EXACT_DOT:
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale_log2
    else:
        scores = tl.dot(q, tl.trans(k)) * qk_scale_log2
    scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, axis=1))
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    weights = tl.exp2(scores - shift[:, None])
    rescale = tl.exp2(row_max - shift)
    row_sum = row_sum * rescale + tl.sum(weights, axis=1)
    if EXACT_DOT:
        acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v)
    return acc, new_max, row_sum


@triton.jit
def _split_kv_attention_partial(
    Q, K, V, Mask, Out, PartAcc, PartMax, PartSum,
    heads, q_len, kv_len, keys_per_split, num_splits,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_ob, stride_oh, stride_om, stride_od,
    qk_scale_log2,
    HAS_MASK: tl.constexpr, ONE_SPLIT: tl.constexpr, EXACT_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    batch_head = tl.program_id(0)
    split = tl.program_id(2)
    b = batch_head // heads
    h = batch_head % heads
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_valid = rows < q_len
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qm + dims[None, :] * stride_qd,
                mask=row_valid[:, None], other=0.0)

    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)  # base 2
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    first_key = split * keys_per_split
    end_key = tl.minimum(first_key + keys_per_split, kv_len)
    for block_start in range(first_key, end_key, BLOCK_N):
        keys = block_start + tl.arange(0, BLOCK_N)
        in_split = keys < end_key
        if HAS_MASK:
            visible = tl.load(Mask + b * stride_mb + h * stride_mh + rows[:, None] * stride_mm
                              + keys[None, :] * stride_mn, mask=row_valid[:, None] & in_split[None, :], other=0) != 0
        else:
            visible = row_valid[:, None] & in_split[None, :]
        # Only the keys some row of this program sees are loaded, and a block with none is skipped whole.
        needed = tl.max(visible.to(tl.int32), axis=0) > 0
        if tl.max(needed.to(tl.int32), axis=0) > 0:
            k = tl.load(K + b * stride_kb + h * stride_kh + keys[:, None] * stride_kn + dims[None, :] * stride_kd,
                        mask=needed[:, None], other=0.0)
            v = tl.load(V + b * stride_vb + h * stride_vh + keys[:, None] * stride_vn + dims[None, :] * stride_vd,
                        mask=needed[:, None], other=0.0)
            acc, row_max, row_sum = _attend_block(q, k, v, visible, acc, row_max, row_sum, qk_scale_log2, EXACT_DOT)

    if ONE_SPLIT:
        # A row with every key masked has acc 0 and row_sum 0: zeros, without dividing by 0.
        out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
        tl.store(Out + b * stride_ob + h * stride_oh + rows[:, None] * stride_om + dims[None, :] * stride_od,
                 out.to(Out.dtype.element_ty), mask=row_valid[:, None])
    else:
        part = (batch_head * num_splits + split) * q_len + rows
        tl.store(PartAcc + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_valid[:, None])
        tl.store(PartMax + part, row_max, mask=row_valid)
        tl.store(PartSum + part, row_sum, mask=row_valid)


@triton.jit
def _split_kv_attention_combine(
    PartAcc, PartMax, PartSum, Out,
    heads, q_len, num_splits,
    stride_ob, stride_oh, stride_om, stride_od,
    SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    batch_head = tl.program_id(0)
    row = tl.program_id(1)
    b = batch_head // heads
    h = batch_head % heads
    splits = tl.arange(0, SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    present = splits < num_splits
    part = (batch_head * num_splits + splits) * q_len + row
    maxima = tl.load(PartMax + part, mask=present, other=float("-inf"))
    sums = tl.load(PartSum + part, mask=present, other=0.0)
    overall = tl.max(maxima, axis=0)
    shift = tl.where(overall == float("-inf"), 0.0, overall)
    weights = tl.exp2(maxima - shift)  # 0 for a split that saw no key of this row
    total = tl.sum(sums * weights, axis=0)
    accs = tl.load(PartAcc + part[:, None] * HEAD_DIM + dims[None, :], mask=present[:, None], other=0.0)
    out = tl.sum(accs * weights[:, None], axis=0)
    out = out / tl.where(total > 0, total, 1.0)  # a row with every key masked: acc and total 0, zeros
    tl.store(Out + b * stride_ob + h * stride_oh + row * stride_om + dims * stride_od, out.to(Out.dtype.element_ty))


INTERPRETED = not isinstance(_split_kv_attention_partial, JITFunction)  # TRITON_INTERPRET=1 when imported


# --------------------------------------------------------------------------------------------- launch shape


def query_block(q_len: int, head_dim: int) -> int:
    """Query rows per program: the queries rounded up to a power of two, at least 16 (tl.dot's minimum), at most
    64, or 32 for heads of 256 (a [64, 256] float32 accumulator spills registers, compiled for sm_90)."""
    return min(64 if head_dim <= 128 else 32, max(16, triton.next_power_of_2(q_len)))


def choose_num_splits(batch_heads: int, q_len: int, kv_len: int, head_dim: int) -> int:
    """How many slices the keys are cut into, from the shapes alone (static when a program is compiled): enough
    programs for ``TARGET_PROGRAMS``, at least ``MIN_BLOCKS_PER_SPLIT`` key blocks a split, at most
    ``MAX_SPLITS``."""
    programs = batch_heads * triton.cdiv(q_len, query_block(q_len, head_dim))
    key_blocks = triton.cdiv(kv_len, BLOCK_N)
    wanted = triton.cdiv(TARGET_PROGRAMS, programs)
    return max(1, min(wanted, key_blocks // MIN_BLOCKS_PER_SPLIT, MAX_SPLITS))


def keys_per_split(kv_len: int, num_splits: int) -> int:
    """Keys of one split: whole key blocks, so that only the last block of the last split is partial."""
    return triton.cdiv(triton.cdiv(kv_len, BLOCK_N), num_splits) * BLOCK_N


def num_warps(block_m: int, head_dim: int) -> int:
    """Warps of a partial program: 8 from a [64, 128] tile up (4 spill registers there, compiled for sm_90)."""
    return 8 if block_m * head_dim >= 64 * 128 else 4


# --------------------------------------------------------------------------------------------- launching


class UnsupportedAttention(ValueError):
    """Inputs the split-KV kernel does not take; ``torch.nn.functional.scaled_dot_product_attention`` computes
    them (``zoo::split_kv_attention`` falls back to it by itself)."""


def _check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Optional[torch.Tensor],
           out: torch.Tensor) -> None:
    if not (query.dim() == key.dim() == value.dim() == out.dim() == 4):
        raise UnsupportedAttention("the split-KV kernel takes 4-D [B, H, L, D] query, key, value and output")
    if not (query.shape[:2] == key.shape[:2] == value.shape[:2]) or key.shape[2] != value.shape[2]:
        raise UnsupportedAttention(f"query {tuple(query.shape)}, key {tuple(key.shape)} and value "
                                   f"{tuple(value.shape)} must share batch and heads, key and value their length")
    if not (query.shape[3] == key.shape[3] == value.shape[3]) or query.shape[3] not in HEAD_DIMS:
        raise UnsupportedAttention(f"head widths {query.shape[3]}/{key.shape[3]}/{value.shape[3]}: the kernel "
                                   f"takes one width for q, k and v, one of {HEAD_DIMS}")
    if out.shape != query.shape:
        raise UnsupportedAttention(f"the output {tuple(out.shape)} must have the query's shape {tuple(query.shape)}")
    if mask is not None and mask.dtype != torch.bool:
        raise UnsupportedAttention(f"the mask is {mask.dtype}; the kernel takes a boolean mask (True: attend)")


def launch_split_kv_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              mask: Optional[torch.Tensor], scale: float, out: torch.Tensor,
                              num_splits: Optional[int] = None) -> torch.Tensor:
    """Write ``softmax(query key^T * scale, mask) value`` into ``out`` (any strides, ``query``'s shape) and
    return it. ``mask`` is boolean and broadcastable to [B, H, Lq, S] (True: attend) or None; ``num_splits``
    overrides ``choose_num_splits`` (the tests use it to cover one and many splits)."""
    _check(query, key, value, mask, out)
    batch, heads, q_len, head_dim = query.shape
    kv_len = key.shape[2]
    splits = num_splits if num_splits is not None else choose_num_splits(batch * heads, q_len, kv_len, head_dim)
    per_split = keys_per_split(kv_len, splits)
    splits = triton.cdiv(kv_len, per_split)  # no split left without keys
    block_m = query_block(q_len, head_dim)
    if mask is not None:
        mask = mask.expand(batch, heads, q_len, kv_len)  # a view: broadcast dimensions get stride 0
    mask_strides = mask.stride() if mask is not None else (0, 0, 0, 0)
    one_split = splits == 1
    # Scratch for the splits' partial results, float32 whatever the inputs (unused with one split).
    scratch = (batch * heads * splits * q_len) if not one_split else 1
    part_acc = torch.empty(scratch * (head_dim if not one_split else 1), dtype=torch.float32, device=query.device)
    part_max = torch.empty(scratch, dtype=torch.float32, device=query.device)
    part_sum = torch.empty(scratch, dtype=torch.float32, device=query.device)
    if INTERPRETED:  # the interpreter's kernels are plain Python functions, which wrap_triton does not take
        partial, combine = _split_kv_attention_partial, _split_kv_attention_combine
    else:  # traced into the program (AOTInductor compiles them into the .so), run as they are in eager mode
        partial, combine = wrap_triton(_split_kv_attention_partial), wrap_triton(_split_kv_attention_combine)
    partial[(batch * heads, triton.cdiv(q_len, block_m), splits)](
        query, key, value, mask if mask is not None else query,  # without a mask any pointer: never read
        out, part_acc, part_max, part_sum,
        heads, q_len, kv_len, per_split, splits,
        *query.stride(), *key.stride(), *value.stride(), *mask_strides, *out.stride(),
        float(scale) * LOG2_E,
        HAS_MASK=mask is not None, ONE_SPLIT=one_split,
        EXACT_DOT=query.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, HEAD_DIM=head_dim,
        num_warps=num_warps(block_m, head_dim), num_stages=NUM_STAGES,
    )
    if not one_split:
        combine[(batch * heads, q_len)](
            part_acc, part_max, part_sum, out, heads, q_len, splits, *out.stride(),
            SPLITS=triton.next_power_of_2(splits), HEAD_DIM=head_dim, num_warps=4,
        )
    return out
