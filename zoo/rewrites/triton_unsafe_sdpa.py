"""Attention that executorch's Triton SDPA computes wrong -> the same attention written out as matmuls and a softmax.

    scaled_dot_product_attention(q, k, v, mask, 0.0, causal, scale=s)      where triton_sdpa_faults(...) names one
        ->  to(softmax(q' @ k'^T * s + bias, dim=-1) @ v', q.dtype)      (the two products as einsum, x' in float32)

The three cases the Triton kernel gets wrong, and what declines: docs/ARCHITECTURE.md, "Rewrites".
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Dict, List, Optional

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from zoo.rewrites.graph import (Declined, aten, calls, copy_program, decline_on_failure, finish, graph_modules_under,
                    insert_call, op_name, require_program, rewriting, same_layout, same_size, schema_get)
from zoo.rewrites.registry import rewrite
from zoo.rewrites.result import RewriteResult

NAME = "replace_triton_unsafe_sdpa_with_math"
_SDPA = aten.scaled_dot_product_attention.default
WIDEST_HEAD = 256  # the clamp of _next_power_of_2 in executorch 1.2.0's Triton SDPA
KEY_BLOCK = 256  # the widest key block (BLOCK_N) its power-of-two path's autotuning may choose
_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _multiple_of(size: Any, n: int) -> bool:
    return isinstance(size, int) and size % n == 0


def triton_sdpa_faults(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                       is_causal: bool) -> List[str]:
    """Why executorch 1.2.0's Triton SDPA would compute this attention wrong (fake or real tensors; [] when it
    computes it right). A size that is not a static number counts against the kernel."""
    faults = []
    widths = [q.shape[-1], v.shape[-1]]
    if any(not isinstance(d, int) or d > WIDEST_HEAD for d in widths):
        faults.append(f"its head is {'/'.join(str(d) for d in widths)} channels wide: the kernel's head block stops "
                      f"at {WIDEST_HEAD}, so it scores from the first {WIDEST_HEAD} channels of q and k and leaves "
                      "the rest of its output unwritten")
    elif widths[0] & (widths[0] - 1) == 0 and mask is None and not is_causal \
            and not _multiple_of(k.shape[-2], KEY_BLOCK):
        faults.append(f"it has no mask and {k.shape[-2]} keys, not a multiple of {KEY_BLOCK}: the kernel scores "
                      "the padding keys of its last block as 0 instead of -inf, which shrinks every output row")
    if mask is not None and mask.dim() == 4 and not same_size(mask.shape[-3], 1) \
            and not same_size(mask.stride(-3), 0):
        faults.append(f"its mask has {mask.shape[-3]} heads (shape {tuple(mask.shape)}): the kernel reads head 0's "
                      "mask for every head")
    return faults


def _bound(node: Node) -> Dict[str, Any]:
    return {name: schema_get(node.target, node.args, node.kwargs, name) for name in _ARGS}


def node_faults(node: Node) -> List[str]:
    """``triton_sdpa_faults`` for an SDPA node of an ATen program."""
    bound = _bound(node)
    val = {name: bound[name].meta["val"] if isinstance(bound[name], Node) else None
           for name in ("query", "key", "value", "attn_mask")}
    return triton_sdpa_faults(val["query"], val["key"], val["value"], val["attn_mask"], bool(bound["is_causal"]))


def _match(ep: ExportedProgram) -> List[Node]:
    """Every SDPA node the Triton kernel would compute wrong, in every graph."""
    return [node for gm in graph_modules_under(ep.graph_module) for node in calls(gm.graph, (_SDPA,))
            if node_faults(node)]


def _check(node: Node, bound: Dict[str, Any]) -> None:
    """Raises Declined where the written-out form would not compute what the node computes."""
    width = bound["query"].meta["val"].shape[-1]
    if not isinstance(width, int):
        raise Declined(node, f"its head width {width} is not a static number, which the default scale needs")
    if bound["dropout_p"]:
        raise Declined(node, f"it applies dropout (p={bound['dropout_p']}), which an inference program must not")
    hq, hk = bound["query"].meta["val"].shape[-3], bound["key"].meta["val"].shape[-3]
    if bound["enable_gqa"] and not same_size(hq, hk):
        raise Declined(node, f"it is grouped-query attention ({hk} key heads for {hq} query heads), which this "
                             "rewrite does not write out")
    if bound["is_causal"] and bound["attn_mask"] is not None:
        raise Declined(node, "it is causal with a mask, which scaled_dot_product_attention itself refuses")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _write_out(node: Node, bound: Dict[str, Any]) -> None:
    graph = node.graph

    def call(target, *args, **kwargs) -> Node:
        return insert_call(graph, node, target, args, kwargs, like=node)

    out_dtype = bound["query"].meta["val"].dtype
    dtype = _compute_dtype(out_dtype)
    q, k, v = (bound[name] if bound[name].meta["val"].dtype == dtype else call(aten._to_copy.default, bound[name],
                                                                                 dtype=dtype)
               for name in ("query", "key", "value"))
    width = bound["query"].meta["val"].shape[-1]
    scale = bound["scale"] if bound["scale"] is not None else 1.0 / math.sqrt(width)
    # einsum, not matmul: matmul's shape logic, run on the program's fake values, pins a dynamic length to its
    # example value; einsum keeps it symbolic.
    scores = call(aten.mul.Tensor, call(aten.einsum.default, "...qd,...kd->...qk", [q, k]), scale)
    mask: Optional[Node] = bound["attn_mask"]
    if bound["is_causal"]:
        mask = call(aten.tril.default, call(aten.ones_like.default, scores, dtype=torch.bool))
    if mask is not None and mask.meta["val"].dtype == torch.bool:
        scores = call(aten.where.ScalarOther, mask, scores, float("-inf"))
    elif mask is not None:
        scores = call(aten.add.Tensor, scores, mask)
    if mask is not None:
        weights = call(aten._safe_softmax.default, scores, -1)
    else:
        weights = call(aten._softmax.default, scores, -1, False)
    out = _laid_out_like(node, call(aten.einsum.default, "...qk,...kd->...qd", [weights, v]), out_dtype, call)
    node.replace_all_uses_with(out)
    graph.erase_node(node)


def _laid_out_like(node: Node, product: Node, dtype: torch.dtype, call) -> Node:
    """``product`` copied into ``dtype`` with the memory layout of ``node``'s output.

    The nodes after the SDPA were traced on its output's strides (a ``view`` there is only valid on them), and
    an SDPA's output is not always contiguous: it follows its query's layout, and attention code passes
    ``q.transpose(1, 2)`` of a [B, L, H, D] tensor. einsum's layout is its own choice. So the copy is made
    contiguous in the original's dimension order (permute, contiguous copy, permute back)."""
    from torch.fx.experimental.symbolic_shapes import size_hint  # sympy: loaded by any program with symbols

    want = node.meta["val"]
    # Outermost first, by the strides' example values (no guard is added); same_layout checks the result.
    order = sorted(range(want.dim()), key=lambda d: -size_hint(want.stride(d)))
    inverse = [order.index(d) for d in range(want.dim())]
    permuted = product if order == sorted(order) else call(aten.permute.default, product, order)
    copied = call(aten._to_copy.default, permuted, dtype=dtype, memory_format=torch.contiguous_format) \
        if product.meta["val"].dtype != dtype else call(aten.clone.default, permuted,
                                                        memory_format=torch.contiguous_format)
    out = copied if order == sorted(order) else call(aten.permute.default, copied, inverse)
    if not same_layout(out.meta["val"], want):
        raise Declined(node, f"its written-out output would be laid out as {tuple(out.meta['val'].stride())}, "
                             f"not {tuple(want.stride())} as the nodes after it were traced on")
    return out


def _replaced(ep: ExportedProgram) -> RewriteResult:
    nodes = _match(ep)
    for node in nodes:
        _check(node, _bound(node))
    if not nodes:
        return RewriteResult.unchanged(NAME, ep)
    work = copy_program(ep)
    counts: Counter = Counter()
    notes = []
    for node in _match(work):
        with rewriting(node):
            notes.append(f"{node.name} written out: {'; '.join(node_faults(node))}")
            counts[op_name(node.target)] += 1
            _write_out(node, _bound(node))
    return RewriteResult.rewritten(NAME, finish(work), counts, notes)


@rewrite(NAME)
def replace_triton_unsafe_sdpa_with_math(ep: ExportedProgram) -> RewriteResult:
    require_program(ep, NAME)
    return decline_on_failure(NAME, ep, lambda: _replaced(ep))
