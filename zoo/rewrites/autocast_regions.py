"""Autocast and grad-mode regions -> their ops, inlined into the graph that calls them.

    getitem(wrap_with_autocast(dev, dtype, enabled, cache, body, *xs), i)  ->  body(*xs)[i]
    getitem(wrap_with_set_grad_enabled(mode, body, *xs), i)                ->  body(*xs)[i]

with every cast autocast makes inside ``body`` written out as an explicit ``_to_copy``. Why, how a body is
mapped, and why it is exact: docs/ARCHITECTURE.md, "Rewrites".
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections import Counter
from typing import Dict, List, Optional, Tuple

import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg
from torch.utils._python_dispatch import TorchDispatchMode

from zoo.rewrites.graph import (Declined, aten, calls, copy_program, decline_on_failure, fake_eval, fetch_attr, finish,
                    getitem_users, graph_modules_under, insert_call, is_inference_program, no_autocast, op_name,
                    require_program, rewriting, same_dtypes)
from zoo.rewrites.registry import rewrite
from zoo.rewrites.result import RewriteResult, log, source_line

NAME = "inline_autocast_regions"

_AUTOCAST = torch.ops.higher_order.wrap_with_autocast
_SET_GRAD = torch.ops.higher_order.wrap_with_set_grad_enabled
_REGIONS = (_AUTOCAST, _SET_GRAD)
_CAST = aten._to_copy.default

# Autocast state: device type -> (enabled, dtype), as set by the regions enclosing a body.
_State = Dict[str, Tuple[bool, Optional[torch.dtype]]]


def _parts(node: Node, state: _State) -> Tuple[Node, List, _State]:
    """(get_attr of the body, operands, autocast state inside the body) of a region call."""
    if node.kwargs:
        raise Declined(node, f"unexpected keyword arguments {sorted(node.kwargs)}")
    if node.target is _AUTOCAST:
        device, dtype, enabled, _cache, body, *operands = node.args
        inner = dict(state)
        inner[device] = (bool(enabled), dtype)
    else:
        _mode, body, *operands = node.args
        inner = state
    if not (isinstance(body, Node) and body.op == "get_attr"):
        raise Declined(node, "its body is not a sub-module of the calling graph")
    return body, operands, inner


def _has_regions(ep: ExportedProgram) -> bool:
    return any(True for gm in graph_modules_under(ep.graph_module) for _ in calls(gm.graph, _REGIONS))


def _computes_recorded(node: Node) -> bool:
    """Does the op, evaluated without autocast on its inputs' recorded values, give the recorded dtypes?"""
    try:
        got = fake_eval(node.target, node.args, node.kwargs)
    except Exception:  # e.g. linear(bfloat16, float32) without autocast: a mismatch, not a failure
        return False
    return same_dtypes(got, node.meta["val"])


class _CastRecorder(TorchDispatchMode):
    """Records the dtype casts (``_to_copy``) applied to the watched tensors while an op runs."""

    def __init__(self, watched: Dict[int, Node]):
        super().__init__()
        self.watched = watched
        self.casts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _CAST and args and id(args[0]) in self.watched and kwargs.get("dtype") is not None:
            self.casts[(self.watched[id(args[0])], kwargs["dtype"])] += 1
        return func(*args, **kwargs)


def _casts_while_running(node: Node, state: _State) -> Counter:
    """{(input node, dtype): n} cast while the op runs on fake values under ``state`` (empty state: no autocast)."""
    vals = map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    watched = {id(a.meta["val"]): a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)}
    fake_mode = torch._guards.detect_fake_mode([a.meta["val"] for a in watched.values()])
    recorder = _CastRecorder(watched)
    with contextlib.ExitStack() as stack:
        if fake_mode is not None:
            stack.enter_context(fake_mode)
        stack.enter_context(no_autocast())
        for device, (enabled, dtype) in state.items():
            stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=False))
        stack.enter_context(recorder)
        node.target(*vals[0], **vals[1])
    return recorder.casts


def _autocast_casts(node: Node, state: _State) -> List[Tuple[Node, torch.dtype]]:
    """The casts autocast adds to ``node``: those made under the region's state but not without autocast
    (an op may cast its inputs itself, as ``to`` does)."""
    try:
        within = _casts_while_running(node, state)
    except Exception as exc:
        raise Declined(node, f"cannot be evaluated under its autocast state: {exc}") from exc
    try:
        without = _casts_while_running(node, {})
    except Exception:  # mixed dtypes that only autocast makes valid: every cast is autocast's
        without = Counter()
    return list(dict.fromkeys((within - without).elements()))


def _materialise_autocast(body: GraphModule, state: _State) -> int:
    """Write out, as ``_to_copy`` nodes, every cast autocast performs on the ops of ``body`` under ``state``."""
    enabled = any(on for on, _ in state.values())
    casts = 0
    for node in list(body.graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.target._schema.is_mutable:  # autocast casts no in-place op
            continue
        if "val" not in node.meta:
            raise Declined(node, "has no recorded value, so what autocast did to it cannot be checked")
        for arg, dtype in (_autocast_casts(node, state) if enabled else []):
            with rewriting(node):
                cast = insert_call(node.graph, node, _CAST, (arg,), {"dtype": dtype}, like=node)
            node.replace_input_with(arg, cast)
            casts += 1
        if not _computes_recorded(node):
            recorded = [str(v.dtype) for v in torch.utils._pytree.tree_leaves(node.meta["val"])
                        if isinstance(v, torch.Tensor)]
            why = "with autocast's casts written out" if enabled else "and no enclosing region enables autocast"
            raise Declined(node, f"export recorded {recorded}, which the op does not compute {why}")
    return casts


def _fresh_attr(gm: GraphModule, hint: str) -> str:
    base = hint.replace(".", "_")
    for i in itertools.count():
        name = base if i == 0 else f"{base}_{i}"
        if not hasattr(gm, name):
            return name
    raise AssertionError("unreachable")


def _inline(gm: GraphModule, node: Node, body_attr: Node, body: GraphModule, operands: List) -> None:
    graph = gm.graph
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(operands):
        raise Declined(node, f"its body takes {len(placeholders)} inputs but the call passes {len(operands)}")
    env: Dict[Node, object] = dict(zip(placeholders, operands))  # by position: the names do not match
    with graph.inserting_before(node):
        for inner in body.graph.nodes:
            if inner.op in ("placeholder", "output"):
                continue
            if inner.op == "get_attr":  # a region kept inside the body: move its sub-module along
                name = _fresh_attr(gm, inner.target)
                setattr(gm, name, fetch_attr(body, inner.target))
                new = graph.get_attr(name)
                new.meta = copy.copy(inner.meta)
            else:
                new = graph.node_copy(inner, lambda n: env[n])
            env[inner] = new
    results = map_arg(body.graph.output_node().args[0], lambda n: env[n])
    if not isinstance(results, (tuple, list)):
        raise Declined(node, "its body does not return a tuple of results")
    for index, getitems in getitem_users(node).items():
        value = results[index]
        for getitem in getitems:
            if getitem.users and not isinstance(value, Node):
                raise Declined(node, f"its output {index} is the constant {value!r}, which is used")
            if getitem.users:
                getitem.replace_all_uses_with(value)
            graph.erase_node(getitem)
    graph.erase_node(node)
    if not body_attr.users:
        graph.erase_node(body_attr)


def _where(node: Node, body: GraphModule) -> str:
    """Source line of a region call; export gives the call none, so the first body op with one stands in."""
    if node.meta.get("stack_trace"):
        return source_line(node)
    for inner in body.graph.nodes:
        if inner.meta.get("stack_trace"):
            return source_line(inner)
    return source_line(node)


def _region_note(node: Node, where: str) -> Optional[str]:
    if node.target is not _AUTOCAST or not node.args[2]:
        return None
    device = node.args[0]
    devices = {a.meta["val"].device.type for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)}
    if devices and device not in devices:
        return (f"autocast({device!r}, {node.args[1]}) at {where} holds only {sorted(devices)} tensors, "
                f"so it casts nothing here; on {device} eager autocast would have cast")
    return None


def _flatten(gm: GraphModule, state: _State, inference: bool, counts: Counter, notes: List[str],
             facts: List[str]) -> None:
    """Inline every region of ``gm``; ``notes`` collects kept regions and risks, ``facts`` what was done."""
    for node in list(calls(gm.graph, _REGIONS)):
        body_attr, operands, inner = _parts(node, state)
        body = fetch_attr(gm, body_attr.target)  # resolved in the module that owns this call
        where = _where(node, body)
        # The body's own ops first, under this region's state; then the nested regions, each under its own
        # state, inlined into the body before the body is inlined here.
        casts = _materialise_autocast(body, inner)
        _flatten(body, inner, inference, counts, notes, facts)
        if casts:
            facts.append(f"{casts} autocast cast(s) written out as {op_name(_CAST)} in the region at {where}")
        note = _region_note(node, where)
        if note:
            notes.append(note)
        if node.target is _SET_GRAD and not inference:
            notes.append(f"kept {op_name(node.target)} at {where}: the program has loss or "
                         "gradient outputs, where grad mode matters")
            continue
        with rewriting(node):
            _inline(gm, node, body_attr, body, operands)
        counts[op_name(node.target)] += 1


def _inlined(ep: ExportedProgram) -> RewriteResult:
    work = copy_program(ep)
    counts: Counter = Counter()
    notes: List[str] = []
    facts: List[str] = []
    _flatten(work.graph_module, {}, is_inference_program(ep), counts, notes, facts)
    program = finish(work) if counts else None
    for note in notes:
        log.warning("%s: %s", NAME, note)
    for fact in facts:
        log.info("%s: %s", NAME, fact)
    notes.extend(facts)
    if program is None:  # only kept regions: the caller's program stays the result
        result = RewriteResult.unchanged(NAME, ep)
        result.notes.extend(notes)
        return result
    return RewriteResult.rewritten(NAME, program, counts, notes)


@rewrite(NAME)
def inline_autocast_regions(ep: ExportedProgram) -> RewriteResult:
    require_program(ep, NAME)
    if not _has_regions(ep):
        return RewriteResult.unchanged(NAME, ep)
    return decline_on_failure(NAME, ep, lambda: _inlined(ep))
