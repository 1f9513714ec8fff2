"""split_float64_constants: float64 constants are stored as float32 (hi, lo) pairs and rebuilt in the graph.

    stored   s = stack(hi, lo)           hi = float32(c),  lo = float32(c - float64(hi))      (float32 [2, ...])
    graph    c' = float64(s[0]) + float64(s[1])                   |c' - c| <= 2^-48 |c|  (about 3.6e-15 |c|)

Why, and what declines: docs/ARCHITECTURE.md, "Rewrites".
"""

from __future__ import annotations

from collections import Counter
from typing import Dict, Tuple

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import Graph, Node

from zoo.rewrites.graph import (decline_on_failure, fake_mode_of, rebuild_program, replace_state, require_program, rewriting,
                    set_value, state_tensor, state_writer)
from zoo.rewrites.registry import rewrite
from zoo.rewrites.result import RewriteResult

NAME = "split_float64_constants"
_aten = torch.ops.aten


def split_pair(c: torch.Tensor) -> torch.Tensor:
    """float64 ``c`` -> float32 ``[2, *c.shape]`` whose float64 sum is ``c`` to 2^-48 relative."""
    hi = c.to(torch.float32)
    lo = (c - hi.to(torch.float64)).to(torch.float32)
    return torch.stack((hi, lo))


# --- matching -------------------------------------------------------------------------------------------------


def find_float64_state(ep: ExportedProgram) -> Tuple[Dict[int, str], str]:
    """{index of the input: target name} of every float64 state tensor to split, and a reason to decline
    ("" when none)."""
    sig = ep.graph_signature
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    outputs = {a for a in ep.graph.output_node().args[0] if isinstance(a, Node)}
    found: Dict[int, str] = {}
    for index, (spec, node) in enumerate(zip(sig.input_specs, placeholders)):
        if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            continue
        value = state_tensor(ep, spec)
        if not isinstance(value, torch.Tensor) or value.dtype != torch.float64:
            continue
        written_at = state_writer(ep, spec, node)
        if written_at is not None:
            return [], (f"float64 buffer {spec.target!r} is mutated by the program (at {written_at}): "
                        "its stored state must stay float64")
        if node in outputs:
            return [], f"float64 state {spec.target!r} is returned as a program output"
        found[index] = spec.target
    return found, ""


# --- rewriting ------------------------------------------------------------------------------------------------


@rewrite(NAME)
def split_float64_constants(ep: ExportedProgram) -> RewriteResult:
    require_program(ep, NAME)
    found, reason = find_float64_state(ep)
    if reason:
        return RewriteResult.decline(NAME, ep, reason)
    if not found:
        return RewriteResult.unchanged(NAME, ep)
    # A rewrite that fails half way declines the whole program: it must not leave a half-changed one.
    return decline_on_failure(NAME, ep, lambda: _rewrite(ep, found))


def _rewrite(ep: ExportedProgram, found: Dict[int, str]) -> RewriteResult:
    fake_mode = fake_mode_of(ep)
    graph = Graph()
    env: Dict[Node, Node] = {}
    old_placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    state_dict, constants = dict(ep.state_dict), dict(ep.constants)
    rebuilt_from: Dict[Node, Node] = {}
    for index, old in enumerate(old_placeholders):
        new = graph.placeholder(old.name)
        new.meta.update({k: v for k, v in old.meta.items() if k != "val"})
        if index in found:
            with rewriting(old):
                replace_state(ep, ep.graph_signature.input_specs[index], new, fake_mode, split_pair, state_dict,
                              constants, requires_grad=False)
            rebuilt_from[new] = old
        else:
            new.meta["val"] = old.meta.get("val")
        env[old] = new
    # c' = float64(s[0]) + float64(s[1]), built once per constant right after the placeholders.
    for new, old in rebuilt_from.items():
        parts = []
        with rewriting(old):
            for i, half in enumerate(("hi", "lo")):
                part = _call(graph, fake_mode, f"{old.name}_{half}", _aten.select.int, (new, 0, i))
                parts.append(_call(graph, fake_mode, f"{old.name}_{half}_f64", _aten._to_copy.default, (part,),
                                   {"dtype": torch.float64}))
            rebuilt = _call(graph, fake_mode, f"{old.name}_f64", _aten.add.Tensor, tuple(parts))
        rebuilt.meta["stack_trace"] = old.meta.get("stack_trace")
        env[old] = rebuilt
    for old in ep.graph.nodes:
        if old.op == "placeholder":
            continue
        env[old] = graph.node_copy(old, lambda n: env[n])
    graph.lint()
    program = rebuild_program(ep, graph, state_dict=state_dict, constants=constants, renamed={})
    counts = Counter({"float64 constant": len(found)})
    notes = [f"{target}: stored as float32 (hi, lo), rebuilt in float64 in the graph" for target in found.values()]
    return RewriteResult.rewritten(NAME, program, counts, notes)


def _call(graph: Graph, fake_mode, name: str, target, args: tuple, kwargs: dict = None) -> Node:
    kwargs = kwargs or {}
    node = graph.create_node("call_function", target, args, kwargs, name=name)
    vals = [a.meta["val"] if isinstance(a, Node) else a for a in args]
    with fake_mode:
        set_value(node, target(*vals, **kwargs))
    return node
