"""Splitting views -> slices and selects, so that no ``split_copy`` reaches AOTInductor.

    getitem(split(x, s, d), i)  ->  slice(x, d, i*s, (i+1)*s)        (chunk, split_with_sizes alike)
    getitem(unbind(x, d), i)    ->  select(x, d, i)                  (and the unsafe_ twins)

Why here, in the ATen program, and what declines: docs/ARCHITECTURE.md, "Rewrites".
"""

from __future__ import annotations

from collections import Counter
from typing import Dict, List, Tuple

from torch.export import ExportedProgram
from torch.fx import Node

from zoo.rewrites.graph import (Declined, aten, calls, copy_program, decline_on_failure, finish, getitem_users,
                    graph_modules_under, insert_call, op_name, require_program, rewriting, same_tensor_meta)
from zoo.rewrites.registry import rewrite
from zoo.rewrites.result import RewriteResult

NAME = "replace_view_copies"
_SPLIT_SIZE = {aten.split.Tensor, aten.unsafe_split.Tensor}
_SPLIT_SIZES = {aten.split_with_sizes.default, aten.unsafe_split_with_sizes.default}
_CHUNK = {aten.chunk.default, aten.unsafe_chunk.default}
_UNBIND = {aten.unbind.int}
_TARGETS = _SPLIT_SIZE | _SPLIT_SIZES | _CHUNK | _UNBIND


def _arg(node: Node, index: int, name: str, default):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _bounds(node: Node) -> Tuple[int, List[Tuple[int, int]]]:
    """(dim, [(start, end) per piece]) of a split/chunk node; raises Declined where a bound is not an int."""
    x = node.args[0]
    pieces = node.meta["val"]
    dim = _arg(node, 2, "dim", 0)
    if not isinstance(dim, int):
        raise Declined(node, "its dimension is not an integer")
    dim = dim % x.meta["val"].dim()
    if node.target in _SPLIT_SIZE:
        step = node.args[1]
        if not isinstance(step, int):
            raise Declined(node, "its split size is a symbol, so the slice bounds are not integers; "
                                     "export with a static size along that dimension")
        return dim, [(i * step, (i + 1) * step) for i in range(len(pieces))]
    if node.target in _CHUNK:
        size = x.meta["val"].shape[dim]
        if not isinstance(size, int):
            raise Declined(node, f"it chunks dimension {dim}, whose size is dynamic, so the piece bounds "
                                     "are not integers; chunk a static dimension or split by a fixed size")
        step = -(-size // node.args[1]) if size else 0
        return dim, [(i * step, (i + 1) * step) for i in range(len(pieces))]
    sizes = node.args[1]
    if not all(isinstance(s, int) for s in sizes):
        raise Declined(node, "its split sizes are symbols, so the slice bounds are not integers; "
                                 "export with static sizes along that dimension")
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return dim, [(s, s + n) for s, n in zip(starts, sizes)]


def _match(ep: ExportedProgram) -> List[Node]:
    found = []
    for gm in graph_modules_under(ep.graph_module):
        found.extend(calls(gm.graph, _TARGETS))
    return found


def _plan(node: Node) -> Dict[int, tuple]:
    """{piece index: (target, args)} for every piece the program uses; raises Declined if it cannot."""
    users = getitem_users(node)
    x = node.args[0]
    if node.target in _UNBIND:
        dim = _arg(node, 1, "dim", 0)
        if not isinstance(dim, int):
            raise Declined(node, "its dimension is not an integer")
        return {i: (aten.select.int, (x, dim, i)) for i in users}
    dim, bounds = _bounds(node)
    return {i: (aten.slice.Tensor, (x, dim, bounds[i][0], bounds[i][1])) for i in users}


def _rewrite(node: Node, plan: Dict[int, tuple]) -> None:
    graph = node.graph
    for index, getitems in getitem_users(node).items():
        target, args = plan[index]
        for getitem in getitems:
            if not getitem.users:  # a piece nobody reads needs no view
                graph.erase_node(getitem)
                continue
            with rewriting(node):
                view = insert_call(graph, getitem, target, args, like=getitem)
            old, new = getitem.meta["val"], view.meta["val"]
            if not same_tensor_meta(old, new):
                raise Declined(node, f"piece {index} as {op_name(target)} would have shape "
                                         f"{tuple(new.shape)} and strides {new.stride()}, not "
                                         f"{tuple(old.shape)} and {old.stride()}")
            getitem.replace_all_uses_with(view)
            graph.erase_node(getitem)
    graph.erase_node(node)


def _rewritten_copy(ep: ExportedProgram) -> RewriteResult:
    work = copy_program(ep)
    counts: Counter = Counter()
    nodes = _match(work)
    plans = [_plan(node) for node in nodes]  # every node is matched before any is rewritten
    for node, plan in zip(nodes, plans):
        counts[op_name(node.target)] += 1
        _rewrite(node, plan)
    return RewriteResult.rewritten(NAME, finish(work), counts)


@rewrite(NAME)
def replace_view_copies(ep: ExportedProgram) -> RewriteResult:
    require_program(ep, NAME)
    if not _match(ep):
        return RewriteResult.unchanged(NAME, ep)
    return decline_on_failure(NAME, ep, lambda: _rewritten_copy(ep))
