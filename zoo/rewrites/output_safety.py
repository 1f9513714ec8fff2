"""Method outputs -> contiguous tensors that own their memory, one per output.

    out_i  ->  clone(out_i, memory_format=contiguous_format)    for every user output out_i that is not
        contiguous, or shares memory with a program input, weight or constant, or with an earlier output.

Why (ExecuTorch's CUDA runtimes) and how sharing is read from the graph: docs/ARCHITECTURE.md, "Rewrites".
"""

from __future__ import annotations

import operator
from collections import Counter
from typing import Dict, List, Optional

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind
from torch.fx import Node

from zoo.rewrites.graph import (Declined, aten, copy_program, decline_on_failure, finish, insert_call, op_name, require_program,
                    rewriting)
from zoo.rewrites.registry import rewrite
from zoo.rewrites.result import RewriteResult

NAME = "make_outputs_safe"

_CLONE = aten.clone.default


def _aliased_argument(node: Node) -> Optional[Node]:
    """The argument whose memory ``node``'s result shares, per the op schema, or None for fresh memory."""
    target = node.target
    if target is operator.getitem:
        # A piece of a multi-result op lives in that op's memory, which may itself be a view (split).
        producer = node.args[0]
        return producer if isinstance(producer, Node) and _aliased_argument(producer) is not None else None
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.returns:
        return None
    alias = target._schema.returns[0].alias_info
    if alias is None:
        return None
    # A list result (split: ``Tensor(a)[]``) carries its alias set on the elements, which the Python schema
    # does not show; its set reads empty, and the aliased argument is the one argument with an alias set.
    shared = set(alias.before_set)
    for i, arg in enumerate(target._schema.arguments):
        if arg.alias_info is not None and (not shared or shared & set(arg.alias_info.before_set)):
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            return value if isinstance(value, Node) else None
    return None


def _storage_root(node: Node) -> Node:
    """The node that allocated the memory ``node`` reads: itself, or what it is a view (or in-place op) of."""
    while node.op == "call_function":
        base = _aliased_argument(node)
        if base is None:
            break
        node = base
    return node


def _contiguous(val: torch.Tensor) -> bool:
    # Unknown (symbolic sizes that do not settle it) counts as not contiguous: a clone is always safe.
    return bool(torch._prims_common.is_contiguous_or_false(val))


def _match(ep: ExportedProgram) -> Dict[int, str]:
    """{output position: why it must be cloned} for the user outputs that need it."""
    outputs = list(ep.graph.output_node().args[0])
    unsafe: Dict[int, str] = {}
    owners: Dict[Node, int] = {}  # storage root -> position of the first output left as it is
    for position, (spec, value) in enumerate(zip(ep.graph_signature.output_specs, outputs)):
        if spec.kind != OutputKind.USER_OUTPUT or not isinstance(value, Node):
            continue
        if "val" not in value.meta:
            raise Declined(value, f"output {position} has no recorded value, so whether it is contiguous and "
                                  "owns its memory cannot be checked")
        val = value.meta["val"]
        if not isinstance(val, torch.Tensor):
            continue
        root = _storage_root(value)
        if root.op in ("placeholder", "get_attr"):
            unsafe[position] = f"shares memory with program input {root.name}"
        elif not _contiguous(val):
            unsafe[position] = f"is not contiguous (shape {tuple(val.shape)}, strides {val.stride()})"
        elif root in owners:
            unsafe[position] = f"shares memory with output {owners[root]} ({root.name})"
        else:
            owners[root] = position
    return unsafe


def _rewrite(ep: ExportedProgram, unsafe: Dict[int, str]) -> Counter:
    graph = ep.graph
    out = graph.output_node()
    values: List = list(out.args[0])
    counts: Counter = Counter()
    for position in sorted(unsafe):
        value = values[position]
        with rewriting(value):
            clone = insert_call(graph, out, _CLONE, (value,), {"memory_format": torch.contiguous_format},
                                like=value if value.op == "call_function" else None)
        values[position] = clone
        counts[op_name(_CLONE)] += 1
    out.args = (tuple(values),)
    return counts


def _make_safe(ep: ExportedProgram) -> RewriteResult:
    if not _match(ep):
        return RewriteResult.unchanged(NAME, ep)
    work = copy_program(ep)
    unsafe = _match(work)
    counts = _rewrite(work, unsafe)
    notes = [f"output {position} {why}: returned as a contiguous clone" for position, why in sorted(unsafe.items())]
    return RewriteResult.rewritten(NAME, finish(work), counts, notes)


@rewrite(NAME)
def make_outputs_safe(ep: ExportedProgram) -> RewriteResult:
    require_program(ep, NAME)
    return decline_on_failure(NAME, ep, lambda: _make_safe(ep))
