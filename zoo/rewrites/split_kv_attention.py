"""Attention over a long, masked KV pool for few queries -> ``zoo::split_kv_attention``, its split-KV Triton kernel.

    scaled_dot_product_attention(q, k, v, mask, 0.0, False, scale=s)
        ->  zoo::split_kv_attention(q, k, v, mask, scale=s)

Opt-in (a recipe lists it in ``rewrites``). Why, what is kept and what declines: docs/ARCHITECTURE.md, "Rewrites";
the kernel: ``zoo.kernels.split_kv_triton``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Dict, List

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from zoo.kernels import SPLIT_KV_ATTENTION, kernel_declines
from zoo.rewrites.graph import (Declined, aten, calls, copy_program, decline_on_failure, finish, graph_modules_under,
                                insert_call, op_name, require_program, rewriting, same_layout, same_size, schema_get)
from zoo.rewrites.registry import rewrite
from zoo.rewrites.result import RewriteResult, log, source_line

NAME = "replace_sdpa_with_split_kv_attention"
_SDPA = aten.scaled_dot_product_attention.default
_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
# Splitting the keys pays where there are few queries per head (a decode-like step): with more, the
# programs of query blocks alone fill the GPU and torch's or ExecuTorch's whole-row kernels are as good.
MAX_QUERIES = 128
DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # float32 keeps torch's SDPA inside the op


def _bound(node: Node) -> Dict[str, Any]:
    return {name: schema_get(node.target, node.args, node.kwargs, name) for name in _ARGS}


def _value(arg: Any) -> Any:
    return arg.meta["val"] if isinstance(arg, Node) else None


def keep_reasons(node: Node) -> List[str]:
    """Why an SDPA node stays as it is ([] when it becomes ``zoo::split_kv_attention``)."""
    bound = _bound(node)
    q, k, v, mask = (_value(bound[name]) for name in ("query", "key", "value", "attn_mask"))
    reasons = []
    if bound["is_causal"]:
        reasons.append("it is causal; the kernel takes a boolean mask only")
    if bound["enable_gqa"] and q.dim() == k.dim() >= 3 and not same_size(q.shape[-3], k.shape[-3]):
        reasons.append(f"it is grouped-query attention ({k.shape[-3]} key heads for {q.shape[-3]} query heads)")
    if q.dtype not in DTYPES:
        reasons.append(f"it computes in {str(q.dtype).replace('torch.', '')}; the op takes bf16, fp16 and float32")
    reasons += kernel_declines(q, k, v, mask)
    if not reasons and q.shape[-2] > MAX_QUERIES:
        reasons.append(f"it has {q.shape[-2]} queries per head, more than {MAX_QUERIES}: splitting the keys pays "
                       "for few queries only")
    if not reasons and not same_layout(torch.empty_like(q), node.meta["val"]):
        reasons.append(f"its output is laid out as {tuple(node.meta['val'].stride())}, not densely in the query's "
                       "order as the op writes it, and the nodes after it were traced on that layout")
    return reasons


def _check(node: Node) -> None:
    """Raises Declined for what an inference program must not hold."""
    dropout = _bound(node)["dropout_p"]
    if dropout:
        raise Declined(node, f"it applies dropout (p={dropout}), which an inference program must not")


def _match(ep: ExportedProgram):
    """[(SDPA node, keep reasons)] in every graph."""
    return [(node, keep_reasons(node)) for gm in graph_modules_under(ep.graph_module)
            for node in calls(gm.graph, (_SDPA,))]


def _replace(node: Node) -> None:
    bound = _bound(node)
    kwargs = {"scale": bound["scale"]} if bound["scale"] is not None else {}
    attention = insert_call(node.graph, node, SPLIT_KV_ATTENTION,
                            (bound["query"], bound["key"], bound["value"], bound["attn_mask"]), kwargs, like=node)
    node.replace_all_uses_with(attention)
    node.graph.erase_node(node)


def _replaced(ep: ExportedProgram) -> RewriteResult:
    plans = _match(ep)
    for node, _ in plans:
        _check(node)
    notes = [f"kept {op_name(node.target)} at {source_line(node)}: {'; '.join(reasons)}"
             for node, reasons in plans if reasons]
    for note in notes:
        log.info("%s: %s", NAME, note)
    if all(reasons for _, reasons in plans):
        result = RewriteResult.unchanged(NAME, ep)
        result.notes.extend(notes)
        return result
    work = copy_program(ep)
    counts: Counter = Counter()
    for node, reasons in _match(work):
        if not reasons:
            with rewriting(node):
                counts[op_name(node.target)] += 1
                _replace(node)
    return RewriteResult.rewritten(NAME, finish(work), counts, notes)


@rewrite(NAME)
def replace_sdpa_with_split_kv_attention(ep: ExportedProgram) -> RewriteResult:
    require_program(ep, NAME)
    return decline_on_failure(NAME, ep, lambda: _replaced(ep))
