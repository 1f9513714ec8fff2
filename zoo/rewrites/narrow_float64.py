"""narrow_float64: every float64 value inside the program is computed in float32 instead.

    float64 state c          ->  stored as float32(c)
    op(..., dtype=float64)   ->  op(..., dtype=float32)         (casts, factories, metadata asserts)

The opt-in companion of ``rotary_pairs: float32``; why, and what declines: docs/ARCHITECTURE.md, "Rewrites".
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Dict, Optional

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import Node

from zoo.rewrites.graph import (Declined, GraphBuilder, decline_on_failure, fake_mode_of, graph_modules_under, hop_bodies,
                    is_hop, op_name, rebuild_program, replace_state, require_program, rewriting, set_value,
                    state_writer)
from zoo.rewrites.registry import rewrite
from zoo.rewrites.result import RewriteResult, source_line

NAME = "narrow_float64"
F64, F32 = torch.float64, torch.float32


def _is_f64(val: Any) -> bool:
    return isinstance(val, torch.Tensor) and val.dtype == F64


def _narrowed(arg: Any) -> Any:
    """Arguments with every float64 dtype made float32 (lists and tuples included)."""
    if arg is F64:
        return F32
    if isinstance(arg, (list, tuple)):
        return type(arg)(_narrowed(a) for a in arg)
    return arg


# --- matching -------------------------------------------------------------------------------------------------


def find_reason_to_decline(ep: ExportedProgram) -> Optional[str]:
    sig = ep.graph_signature
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    for spec, node in zip(sig.input_specs, placeholders):
        if not _is_f64(node.meta.get("val")):
            continue
        if spec.kind == InputKind.USER_INPUT:
            return f"program input {node.name!r} is float64: narrowing it would change the method's signature"
        written_at = state_writer(ep, spec, node)
        if written_at is not None:
            return f"float64 buffer {spec.target!r} is mutated by the program (at {written_at})"
    for out in ep.graph.output_node().args[0]:
        if isinstance(out, Node) and _is_f64(out.meta.get("val")):
            return f"program output {out.name!r} is float64 (at {source_line(out)}): the caller would see float32"
    for node in ep.graph.nodes:
        if node.op == "call_function" and is_hop(node):
            for body in hop_bodies(node, ep.graph_module):
                for gm in graph_modules_under(body):
                    if any(_is_f64(n.meta.get("val")) for n in gm.graph.nodes):
                        return f"float64 values inside {op_name(node.target)} at {source_line(node)}"
    return None


def has_float64(ep: ExportedProgram) -> bool:
    state = {**ep.state_dict, **ep.constants}
    return any(_is_f64(n.meta.get("val")) for n in ep.graph.nodes) or any(_is_f64(v) for v in state.values())


# --- rewriting ------------------------------------------------------------------------------------------------


@rewrite(NAME)
def narrow_float64(ep: ExportedProgram) -> RewriteResult:
    require_program(ep, NAME)
    if not has_float64(ep):
        return RewriteResult.unchanged(NAME, ep)
    reason = find_reason_to_decline(ep)
    if reason:
        return RewriteResult.decline(NAME, ep, reason)
    # A rewrite that fails half way declines the whole program: it must not leave a half-changed one.
    return decline_on_failure(NAME, ep, lambda: _rewrite(ep))


def _rewrite(ep: ExportedProgram) -> RewriteResult:
    fake_mode = fake_mode_of(ep)
    builder = GraphBuilder(ep.graph_module, fake_mode)
    state_dict, constants = dict(ep.state_dict), dict(ep.constants)
    counts: Counter = Counter()
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    for spec, old in zip(ep.graph_signature.input_specs, placeholders):
        new = builder.graph.placeholder(old.name)
        new.meta.update({k: v for k, v in old.meta.items() if k not in ("val", "tensor_meta")})
        val = old.meta.get("val")
        if _is_f64(val):
            with rewriting(old):
                replace_state(ep, spec, new, fake_mode, lambda t: t.to(F32), state_dict, constants,
                              requires_grad=False)
            counts["float64 state"] += 1
        else:
            set_value(new, val)
        builder.env[old] = new
    for old in ep.graph.nodes:
        if old.op == "placeholder":
            continue
        if old.op != "call_function":
            builder.env[old] = builder.graph.node_copy(old, lambda n: builder.env[n])
            continue
        new = builder.graph.node_copy(old, lambda n: builder.env[n])
        if is_hop(old):  # its sub-graphs hold no float64 (matching checked): its values stay what they were
            builder.env[old] = new
            continue
        args, kwargs = _narrowed(new.args), {k: _narrowed(v) for k, v in new.kwargs.items()}
        if args != new.args or kwargs != new.kwargs:
            new.args, new.kwargs = args, kwargs
            counts[op_name(old.target)] += 1
        for key in ("val", "tensor_meta"):
            new.meta.pop(key, None)
        with rewriting(old):
            set_value(new, builder.fake_run(old.target, new.args, new.kwargs))
        if _is_f64(new.meta["val"]):
            raise Declined(old, "still makes float64 with every float64 argument narrowed")
        builder.env[old] = new
    builder.graph.lint()
    program = rebuild_program(ep, builder.graph, state_dict=state_dict, constants=constants, renamed={})
    return RewriteResult.rewritten(NAME, program, counts)


def float64_nodes(ep: ExportedProgram) -> Dict[str, int]:
    """How many nodes of each op hold a float64 value: what a runtime without float64 would trip over."""
    found: Counter = Counter()
    for node in ep.graph.nodes:
        if _is_f64(node.meta.get("val")):
            found[node.op if node.op != "call_function" else op_name(node.target)] += 1
    return dict(found)
