"""Fused attention kernels -> ``scaled_dot_product_attention``, where that computes the same result.

    getitem(_scaled_dot_product_{flash,efficient,cudnn,flash_for_cpu}_attention(q, k, v, ...), 0)
        ->  scaled_dot_product_attention(q, k, v, bias, p, causal, scale=s, enable_gqa=(heads(k) < heads(q)))

Why, which nodes are kept and which decline: docs/ARCHITECTURE.md, "Rewrites".
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Dict, List, Optional, Tuple

from torch.export import ExportedProgram
from torch.fx import Node

from zoo.rewrites.graph import (Declined, aten, calls, copy_program, decline_on_failure, finish, getitem_users,
                    graph_modules_under, insert_call, op_name, require_program, rewriting, same_size)
from zoo.rewrites.registry import rewrite
from zoo.rewrites.result import RewriteResult, log, source_line

NAME = "replace_fused_sdpa_with_sdpa"
_FUSED = (
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
)
_SDPA = aten.scaled_dot_product_attention.default


def _bind(node: Node) -> Dict[str, Any]:
    """Every schema argument of ``node`` by name, defaults filled in (export drops trailing defaults)."""
    bound = {}
    for i, arg in enumerate(node.target._schema.arguments):
        if i < len(node.args) and not arg.kwarg_only:
            bound[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            bound[arg.name] = node.kwargs[arg.name]
        else:
            bound[arg.name] = arg.default_value if arg.has_default_value() else None
    return bound


def _keep_reasons(node: Node, bound: Dict[str, Any]) -> List[str]:
    reasons = []
    returns = node.target._schema.returns
    for index, getitems in sorted(getitem_users(node).items()):
        readers = [u.name for g in getitems for u in g.users]
        if index != 0 and readers:
            reasons.append(f"its {returns[index].name} output is used (by {', '.join(readers)})")
    bias = bound.get("attn_bias", bound.get("attn_mask"))
    if bound["is_causal"] and bias is not None:
        reasons.append("it is causal with a bias, which scaled_dot_product_attention cannot express")
    if bound["is_causal"]:
        lq, lkv = bound["query"].meta["val"].shape[-2], bound["key"].meta["val"].shape[-2]
        if not same_size(lq, lkv):
            reasons.append(f"it is causal and L_q == L_kv is not statically known (L_q={lq}, L_kv={lkv}): "
                           "the kernel masks from the top left, a lowered causal SDPA may not")
    return reasons


def _replacement(node: Node, bound: Dict[str, Any]) -> Tuple[tuple, Dict[str, Any]]:
    """SDPA args and kwargs for ``node``; raises Declined where no SDPA call computes the same thing."""
    q, k, v = (bound[n].meta["val"] for n in ("query", "key", "value"))
    hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
    if not same_size(hk, hv):
        raise Declined(node, f"key and value have different head counts ({hk}, {hv})")
    gqa = not same_size(hq, hk)
    if gqa and not (isinstance(hq, int) and isinstance(hk, int) and hk > 0 and hq % hk == 0):
        raise Declined(node, f"{hk} key heads do not divide {hq} query heads, which grouped-query "
                                 "attention (enable_gqa) needs")
    bias: Optional[Node] = bound.get("attn_bias", bound.get("attn_mask"))
    if bias is not None and not bias.meta["val"].dtype.is_floating_point:
        raise Declined(node, f"its bias is {bias.meta['val'].dtype}; the fused kernels add the bias, "
                                 "while scaled_dot_product_attention reads a boolean mask as keep/drop")
    args = (bound["query"], bound["key"], bound["value"], bias, bound["dropout_p"], bound["is_causal"])
    kwargs: Dict[str, Any] = {}
    if bound["scale"] is not None:
        kwargs["scale"] = bound["scale"]
    if gqa:
        kwargs["enable_gqa"] = True
    return args, kwargs


def _match(ep: ExportedProgram):
    """[(node, replacement or None, keep reasons)] for every fused-attention node, in every graph."""
    plans = []
    for gm in graph_modules_under(ep.graph_module):
        for node in calls(gm.graph, _FUSED):
            bound = _bind(node)
            reasons = _keep_reasons(node, bound)
            plans.append((node, None if reasons else _replacement(node, bound), reasons))
    return plans


def _rewrite(node: Node, args: tuple, kwargs: Dict[str, Any]) -> None:
    graph = node.graph
    getitems = getitem_users(node)
    with rewriting(node):
        sdpa = insert_call(graph, node, _SDPA, args, kwargs, like=node)
    for getitem in getitems.get(0, []):
        getitem.replace_all_uses_with(sdpa)
    for group in getitems.values():
        for getitem in group:
            graph.erase_node(getitem)  # the kept-node check made sure no other output has a reader
    graph.erase_node(node)


def _replaced(ep: ExportedProgram) -> RewriteResult:
    plans = _match(ep)
    notes = []
    for node, _, reasons in plans:
        if reasons:
            note = f"kept {op_name(node.target)} at {source_line(node)}: {'; '.join(reasons)}"
            log.warning("%s: %s", NAME, note)
            notes.append(note)
    if not any(replacement for _, replacement, _ in plans):
        result = RewriteResult.unchanged(NAME, ep)
        result.notes.extend(notes)
        return result
    work = copy_program(ep)
    counts: Counter = Counter()
    for node, replacement, _ in _match(work):
        if replacement is not None:
            counts[op_name(node.target)] += 1
            _rewrite(node, *replacement)
    return RewriteResult.rewritten(NAME, finish(work), counts, notes)


@rewrite(NAME)
def replace_fused_sdpa_with_sdpa(ep: ExportedProgram) -> RewriteResult:
    require_program(ep, NAME)
    return decline_on_failure(NAME, ep, lambda: _replaced(ep))
