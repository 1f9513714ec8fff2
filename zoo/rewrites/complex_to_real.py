"""Complex tensors -> real pairs: the rewrite every rotary-embedding policy needs before ExecuTorch's CUDA
backend, which (like ``to_edge`` and Inductor) handles no complex dtype. Each complex value becomes its
``view_as_real`` pair; the op-by-op rules are in ``zoo.rewrites.complex_rules``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Union

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, InputSpec
from torch.fx import Node

from zoo.core.errors import RecipeError
from zoo.rewrites.complex_rules import RULES, PairBuilder, complex_arg, is_complex
from zoo.rewrites.graph import (
    decline_on_failure,
    graph_modules_under,
    hop_bodies,
    input_nodes,
    is_hop,
    node_value,
    op_name,
    rebuild_program,
    replace_state,
    require_program,
    rewriting,
    same_size,
    same_value_meta,
    state_location,
    tensors_in,
    written_args,
)
from zoo.rewrites.registry import rewrite
from zoo.rewrites.result import RewriteResult, source_line

NAME = "replace_complex_with_real"


# ============================================================================================ entry point


@rewrite(NAME, complex128_as="rotary_pairs")
def replace_complex_with_real(ep: ExportedProgram, complex128_as: str = "float64") -> RewriteResult:
    """Rewrite every complex value of ``ep`` as a real pair, or decline and return ``ep`` untouched."""
    require_program(ep, NAME)
    pairs = _pair_dtypes(complex128_as)
    found = _match(ep)
    if isinstance(found, str):
        return RewriteResult.decline(NAME, ep, found)
    if not found.placeholders and not found.nodes:
        return RewriteResult.unchanged(NAME, ep)
    # Any failure while rewriting (one node, or building the new program) declines the whole program.
    return decline_on_failure(NAME, ep, lambda: _rewrite(ep, found, pairs))


def _pair_dtypes(complex128_as: str) -> Dict[torch.dtype, torch.dtype]:
    allowed = {"float64": torch.float64, "float32": torch.float32}
    if complex128_as not in allowed:
        raise RecipeError(
            f"complex128_as={complex128_as!r} is not a real dtype complex128 can become",
            "use 'float64' (faithful) or 'float32' (loads on ExecuTorch CUDA runtimes without float64); "
            "the recipe key is rotary_pairs",
        )
    return {torch.complex64: torch.float32, torch.complex128: allowed[complex128_as]}


# ============================================================================================ pass 1: matching
#
# The rewrite is stated as two passes, like ExecuTorch's ``replace_int64_floordiv``. The first (matching) finds
# every node that reads or produces a complex value and checks it has a rule; the first that has none ends the
# rewrite with a reason naming the op and the user's source line. Unlike upstream, no per-node failure is
# swallowed: the second pass (rewriting) runs only when matching accepted everything, builds a new graph beside
# the old one, and any failure there declines the whole program. A declined program comes back as the very
# object that was passed in, untouched.
#
# Declined on purpose: complex program inputs and outputs (the user would see a different signature), complex
# buffers the program mutates, complex values inside higher-order ops (``torch.cond``, ``wrap_with_autocast``
# ...: ``inline_autocast_regions`` runs first and removes the autocast/grad ones), complex32, complex -> real
# casts (eager drops the imaginary part), and any op without a rule (e.g. FFTs).


@dataclass
class _Found:
    placeholders: Dict[Node, InputSpec] = field(default_factory=dict)  # complex constants/params/buffers
    nodes: Set[Node] = field(default_factory=set)  # call_function nodes that read or produce complex values


def _where(node: Node) -> str:
    return source_line(node)


def _match(ep: ExportedProgram) -> Union[_Found, str]:
    """Every complex-valued node and its rule, or the reason the first unsupported one cannot be rewritten."""
    root = ep.graph_module
    signature = ep.graph_signature
    specs = dict(zip((n for n in ep.graph.nodes if n.op == "placeholder"), signature.input_specs))
    mutated = set(signature.buffers_to_mutate.values())
    found = _Found()
    for node in ep.graph.nodes:
        reason = _complex32(node) or _check_node(node, root, signature, specs, mutated, found)
        if reason is not None:
            return reason
    return found


def _check_node(node: Node, root, signature, specs, mutated: Set[str], found: _Found) -> Optional[str]:
    """Why ``node`` cannot be rewritten, or None; records the complex nodes pass 2 must rewrite."""
    touches_complex = is_complex(node.meta.get("val")) or any(complex_arg(n) for n in input_nodes(node))
    if node.op == "placeholder" and touches_complex:
        found.placeholders[node] = specs[node]
        return _check_placeholder(node, specs[node], mutated)
    if node.op == "get_attr":
        attr = node_value(node, root)
        if isinstance(attr, torch.Tensor) and attr.dtype.is_complex:
            return f"complex attribute {node.target!r} is read directly, not lifted by torch.export"
        return None
    if is_hop(node):
        return _check_hop(node, root)
    if node.op == "call_function" and touches_complex:
        found.nodes.add(node)
        return _check_call(node, specs)
    if node.op == "output":
        return _check_outputs(node, signature)
    if node.op in ("call_module", "call_method") and touches_complex:
        return f"{node.op} {node.target} at {_where(node)}: no rule rewrites it"
    return None


def _check_call(node: Node, specs: Dict[Node, InputSpec]) -> Optional[str]:
    reason = _check_in_place(node, specs)
    if reason is not None:
        return reason
    rule = RULES.get(node.target)
    if rule is None:
        return f"{op_name(node.target)} at {_where(node)}: no rule rewrites this op on complex values"
    why = rule.check(node)
    return None if why is None else f"{op_name(node.target)} at {_where(node)}: {why}"


def _complex32(node: Node) -> Optional[str]:
    if any(t.dtype == torch.complex32 for t in tensors_in(node.meta.get("val"))):
        return (
            f"complex32 value {node.name} at {_where(node)}: half-precision complex has no faithful real-pair "
            "rewrite here; compute the rotary math in float32 (complex64)"
        )
    return None


def _check_placeholder(node: Node, spec: InputSpec, mutated: Set[str]) -> Optional[str]:
    if spec.kind == InputKind.USER_INPUT:
        return (
            f"complex program input {node.name!r}: the caller would have to pass real pairs instead; pass "
            "view_as_real(x) and call view_as_complex inside the model"
        )
    if spec.kind == InputKind.BUFFER and spec.target in mutated:
        return (
            f"complex buffer {spec.target!r} is mutated by the program: rewriting it would change the mutation "
            "outputs; keep the mutated state real (store view_as_real of it)"
        )
    if state_location(spec) is None:
        return f"complex input {node.name!r} of kind {spec.kind.name} is not a tensor the rewrite can store"
    return None


def _check_in_place(node: Node, specs: Dict[Node, InputSpec]) -> Optional[str]:
    """Export IR keeps in-place ops (``buffers_to_mutate`` fills only after functionalisation): name the write."""
    for written in written_args(node):
        if not complex_arg(written):
            continue
        spec = specs.get(written)
        what = f"complex buffer {spec.target!r}" if spec is not None else f"complex value {written.name}"
        return (
            f"{op_name(node.target)} at {_where(node)}: it mutates {what} in place; rewriting it would change "
            "what the program writes back; keep mutated state real (store view_as_real of it)"
        )
    return None


def _check_hop(node: Node, root: torch.nn.Module) -> Optional[str]:
    operands = is_complex(node.meta.get("val")) or any(complex_arg(n) for n in input_nodes(node))
    inside = any(
        is_complex(n.meta.get("val")) for body in hop_bodies(node, root) for gm in graph_modules_under(body)
        for n in gm.graph.nodes
    )
    if not (operands or inside):
        return None
    return (
        f"complex values {'pass through' if operands else 'live inside'} higher-order op {op_name(node.target)} "
        f"({node.name}) at {_where(node)}: the rewrite does not enter HOP bodies; inline autocast/grad regions "
        "first (inline_autocast_regions) or keep the complex math outside torch.cond/map"
    )


def _check_outputs(node: Node, signature) -> Optional[str]:
    for arg, spec in zip(node.args[0], signature.output_specs):
        if isinstance(arg, Node) and is_complex(arg.meta.get("val")):
            return (
                f"complex program output {arg.name!r} ({spec.kind.name}) at {_where(arg)}: the caller would get "
                "real pairs instead; return torch.view_as_real(...) from the model"
            )
    return None


# ============================================================================================ pass 2: rewriting




def _rewrite(ep: ExportedProgram, found: _Found, pairs: Dict[torch.dtype, torch.dtype]) -> RewriteResult:
    rw = PairBuilder(ep, pairs)
    state_dict, constants = dict(ep.state_dict), dict(ep.constants)
    counts: Counter = Counter()
    changed: Set[Node] = set()  # old nodes whose new value differs (dtype, shape, strides) from the old one
    renamed: Dict[str, str] = {}
    for node in ep.graph.nodes:
        rw.start(node)
        with rewriting(node):
            if node in found.placeholders:
                new = rw.copy(node, recompute=False)
                replace_state(ep, found.placeholders[node], new, rw.fake_mode,
                              lambda t: torch.view_as_real(t.resolve_conj()).to(pairs[t.dtype]).clone(),
                              state_dict, constants)
                counts["constant"] += 1
            elif node in found.nodes:
                new = RULES[node.target].emit(rw, node)
                _check_pair(node, new, pairs)
                rw.finish(new)
                counts[op_name(node.target)] += 1
            else:
                dirty = any(n in changed for n in input_nodes(node))
                new = rw.copy(node, recompute=dirty)
                if dirty and not same_value_meta(node.meta.get("val"), new.meta.get("val"), strides=False):
                    raise RuntimeError("a real op downstream of the rewrite changed its dtype or shape")
        rw.env[node] = new
        if node.op != "output" and not same_value_meta(node.meta.get("val"), new.meta.get("val")):
            changed.add(node)
        if new.name != node.name:
            renamed[node.name] = new.name
    rw.graph.lint()
    program = rebuild_program(ep, rw.graph, state_dict=state_dict, constants=constants, renamed=renamed)
    return RewriteResult.rewritten(NAME, program, counts, _notes(found, pairs))


def _check_pair(old: Node, new: Node, pairs: Dict[torch.dtype, torch.dtype]) -> None:
    """The replacement must hold exactly the pair of the old value (or, off the complex path, the old value)."""
    old_val, new_val = old.meta.get("val"), new.meta.get("val")
    if not is_complex(old_val):
        if not same_value_meta(old_val, new_val, strides=False):
            raise RuntimeError(f"expected a value like {old_val}, built {new_val}")
        return
    olds, news = list(tensors_in(old_val)), list(tensors_in(new_val))
    if len(olds) != len(news):
        raise RuntimeError(f"expected {len(olds)} tensors, built {len(news)}")
    for o, n in zip(olds, news):
        ok = (
            n.dtype == pairs[o.dtype]
            and n.dim() == o.dim() + 1
            and all(same_size(a, b) for a, b in zip(n.shape, [*o.shape, 2]))
        )
        if not ok:
            raise RuntimeError(
                f"expected the pair {pairs[o.dtype]}{[*o.shape, 2]} of {o.dtype}{list(o.shape)}, "
                f"built {n.dtype}{list(n.shape)}"
            )


def _notes(found: _Found, pairs: Dict[torch.dtype, torch.dtype]) -> List[str]:
    notes = [f"{len(found.nodes)} complex-valued ops and {len(found.placeholders)} complex constants rewritten"]
    uses_c128 = any(
        t.dtype == torch.complex128
        for n in [*found.nodes, *found.placeholders]
        for t in tensors_in(n.meta.get("val"))
    )
    if uses_c128 and pairs[torch.complex128] == torch.float32:
        notes.append("complex128 values are stored as float32 pairs (rotary_pairs: float32): float32 precision")
    return notes
