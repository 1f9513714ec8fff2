"""``zoo::split_kv_attention(query, key, value, attn_mask=None, scale=None)``: attention with a split-KV Triton
kernel on CUDA for bf16/fp16, and torch's own SDPA everywhere else.

    split_kv_attention(q, k, v, mask, scale)
        == torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

What runs:
- CUDA, bf16 or fp16, shapes the kernel takes (``kernel_declines``): ``zoo.kernels.split_kv_triton``;
- anything else (the CPU, float32 anywhere): ``scaled_dot_product_attention`` itself, called exactly as the
  SDPA node the rewrite replaced called it, so every CPU check of zoo stays bit-exact against LeRobot, and a
  float32 reference on the GPU never runs the kernel it is meant to judge.

It is a ``torch.library.triton_op``: ``torch.export`` and ``run_decompositions`` keep it as one node (that is
how it survives ExecuTorch's re-tracing), and when AOTInductor compiles the program its body is traced on the
GPU's fake tensors, so the Triton kernels are compiled into the ``.so`` (as executorch's own ``triton::sdpa``
is) and no runtime shim is needed. Its output is laid out as torch's SDPA lays out its own: dense, in the
query's dimension order (``torch.empty_like(query)``), so the nodes after it keep the strides they were traced on.
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch.library import triton_op

try:  # triton comes with torch's CUDA builds; without it the op has its SDPA path only
    from zoo.kernels.split_kv_triton import launch_split_kv_attention
except ImportError:  # pragma: no cover - a CPU-only torch
    launch_split_kv_attention = None

NAME = "zoo::split_kv_attention"
KERNEL_DTYPES = (torch.bfloat16, torch.float16)  # what the Triton kernel runs; the rest goes to SDPA
# The head widths the kernel takes (split_kv_triton.HEAD_DIMS), spelled here too: what the rewrite replaces must
# not depend on whether triton is installed where a program is exported.
HEAD_DIMS = (16, 32, 64, 128, 256)


def kernel_declines(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attn_mask: Optional[torch.Tensor]) -> List[str]:
    """Why the split-KV kernel would not take these inputs (real or fake tensors; [] when it takes them),
    whatever their device and dtype. A size that is not a static number counts against it: the launch shape is
    chosen from the sizes when the program is compiled."""
    tensors = {"query": query, "key": key, "value": value}
    if any(t.dim() != 4 for t in tensors.values()):
        return [f"it is not 4-D [B, H, L, D] attention (query/key/value have {query.dim()}/{key.dim()}/"
                f"{value.dim()} dimensions)"]
    sizes = [s for t in (*tensors.values(), *([attn_mask] if attn_mask is not None else [])) for s in t.shape]
    if not all(isinstance(s, int) for s in sizes):
        return ["its sizes are not all static numbers, from which the kernel's launch shape is chosen"]
    reasons = []
    if len({t.dtype for t in tensors.values()}) != 1:
        reasons.append(f"query, key and value differ in dtype ({query.dtype}, {key.dtype}, {value.dtype})")
    if not (query.shape[:2] == key.shape[:2] == value.shape[:2]) or key.shape[2] != value.shape[2]:
        reasons.append(f"query {tuple(query.shape)}, key {tuple(key.shape)} and value {tuple(value.shape)} do not "
                       "share batch and heads, or key and value their length")
    widths = {query.shape[3], key.shape[3], value.shape[3]}
    if len(widths) != 1 or query.shape[3] not in HEAD_DIMS:
        reasons.append(f"its head is {'/'.join(str(w) for w in sorted(widths))} channels wide; the kernel takes one "
                       f"width for q, k and v, one of {', '.join(str(d) for d in HEAD_DIMS)}")
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        reasons.append(f"its mask is {str(attn_mask.dtype).replace('torch.', '')}, not boolean (an additive mask)")
    return reasons


def runs_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_mask: Optional[torch.Tensor]) -> bool:
    """Whether the op computes these inputs with the Triton kernel (else with torch's SDPA)."""
    return (launch_split_kv_attention is not None and query.device.type == "cuda"
            and query.dtype in KERNEL_DTYPES and not kernel_declines(query, key, value, attn_mask))


def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Optional[torch.Tensor],
          scale: Optional[float]) -> torch.Tensor:
    """torch's SDPA, called as the replaced node called it; copied into the op's layout only where SDPA chose
    another (a copy changes no value)."""
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, scale=scale)
    want = _empty_output(query, value)
    if out.stride() == want.stride():
        return out
    return want.copy_(out)


def _empty_output(query: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The op's output, unwritten: laid out as torch's SDPA lays out its own, dense in the query's dimension
    order (contiguous when the value's width differs from the query's, a case the kernel does not take)."""
    if value.shape[-1] == query.shape[-1]:
        return torch.empty_like(query)
    return query.new_empty(query.shape[:-1] + value.shape[-1:])


@triton_op(NAME, mutates_args=())
def split_kv_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attn_mask: Optional[torch.Tensor] = None, scale: Optional[float] = None) -> torch.Tensor:
    if not runs_kernel(query, key, value, attn_mask):
        return _sdpa(query, key, value, attn_mask, scale)
    scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])  # SDPA's default
    return launch_split_kv_attention(query, key, value, attn_mask, scale, _empty_output(query, value))


@split_kv_attention.register_fake
def _split_kv_attention_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attn_mask: Optional[torch.Tensor] = None,
                             scale: Optional[float] = None) -> torch.Tensor:
    # Shapes as scaled_dot_product_attention checks them, without computing anything.
    if query.dim() < 2 or key.shape[-1] != query.shape[-1] or key.shape[-2] != value.shape[-2]:
        raise ValueError(f"{NAME}: query {tuple(query.shape)}, key {tuple(key.shape)} and value "
                         f"{tuple(value.shape)} do not make an attention (widths of q and k, lengths of k and v)")
    return _empty_output(query, value)


__all__ = ["NAME", "KERNEL_DTYPES", "kernel_declines", "runs_kernel", "split_kv_attention"]
