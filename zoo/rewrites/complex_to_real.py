"""Complex tensors -> real pairs: the rewrite every rotary-embedding policy needs before ExecuTorch's CUDA backend.

Neither ``to_edge`` nor Inductor handles complex dtypes, so every complex value ``z`` of shape ``S`` is stored
as the real tensor ``P = view_as_real(z)`` of shape ``S + [2]`` (``P[..., 0]`` real, ``P[..., 1]`` imaginary):
complex64 -> float32, complex128 -> float64 (or float32 with ``complex128_as="float32"``, the recipe's
``rotary_pairs: float32``, because released ExecuTorch CUDA runtimes have no float64).

Formulas (``re(P) = select(P, -1, 0)``, ``im(P) = select(P, -1, 1)``, ``d`` = the result's pair dtype)::

    view_as_complex(x)    ->  x                       (cast to d where d differs from x's dtype)
    view_as_real(z)       ->  P                       (cast back to eager's real dtype where d differs)
    polar(r, t)           ->  stack([r * cos(t), r * sin(t)], -1)      computed in r's dtype, then cast to d
    a * b   (complex)     ->  stack([re(A)re(B) - im(A)im(B), re(A)im(B) + im(A)re(B)], -1)
    a * r   (r real)      ->  A * unsqueeze(r, -1)    (a Python scalar multiplies A directly)
    a + b, a - b          ->  A + B, A - B            (alpha kept; both operands complex)
    casts c64 <-> c128    ->  the same cast op with dtype d
    view/reshape/expand   ->  the same op with shape + [2]
    dim-taking views      ->  the same op with negative dims counted from the complex rank (so the
                              trailing pair dim is never touched): slice, select, narrow, index_select,
                              split, split_with_sizes, chunk, unbind, transpose, squeeze, unsqueeze,
                              flatten, unflatten, cat, stack, sym_size; permute gets the pair dim appended,
                              repeat a trailing 1; index, clone, contiguous, alias, detach keep their args
    complex constant      ->  its real view, stored in the program's state_dict / constants

Operands are first cast to the pair dtype of eager's *result* dtype, because eager promotes the operands
and then computes: complex64 * complex128 widens the complex64 pair to float64 and multiplies in float64,
and a polar built in complex64 and then cast to complex128 (LingBot-VA) is computed in float32 and widened,
so the rewrite matches eager rather than a more precise value.

The rewrite is stated as two passes, like ExecuTorch's ``replace_int64_floordiv``. The first (matching)
finds every node that reads or produces a complex value and checks it has a rule; the first that has none
ends the rewrite with a reason naming the op and the user's source line. Unlike upstream, no per-node
failure is swallowed: the second pass (rewriting) runs only when matching accepted everything, builds a new
graph beside the old one, and any failure there declines the whole program. A declined program comes back
as the very object that was passed in, untouched.

Declined on purpose: complex program inputs and outputs (the user would see a different signature), complex
buffers the program mutates, complex values inside higher-order ops (``torch.cond``, ``wrap_with_autocast``
...: ``inline_autocast_regions`` runs first and removes the autocast/grad ones), complex32, complex -> real
casts (eager drops the imaginary part), and any op without a rule (e.g. FFTs).
"""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, InputSpec
from torch.fx import Node
from torch.fx.node import map_arg

from zoo.core.errors import RecipeError
from zoo.rewrites.graph import (
    GraphBuilder,
    decline_on_failure,
    fake_mode_of,
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
    schema_get,
    schema_set,
    state_location,
    tensors_in,
    written_args,
)
from zoo.rewrites.registry import rewrite
from zoo.rewrites.result import RewriteResult, source_line

NAME = "replace_complex_with_real"
aten = torch.ops.aten

# Memory formats that mean the same thing for a pair (one more trailing dim) as for the complex value.
_SAFE_MEMORY_FORMATS = (None, torch.preserve_format, torch.contiguous_format)


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


# ============================================================================================ rules


@dataclass(frozen=True)
class _Rule:
    emit: Callable[["_Rewriter", Node], Node]
    check: Callable[[Node], Optional[str]]  # why this node cannot be rewritten, or None


_RULES: Dict[Any, _Rule] = {}


def _no_objection(node: Node) -> Optional[str]:
    return None


def _rule(*targets: Any, check: Callable[[Node], Optional[str]] = _no_objection):
    def register(emit: Callable[["_Rewriter", Node], Node]):
        for target in targets:
            _RULES[target] = _Rule(emit, check)
        return emit

    return register


def _is_complex(val: Any) -> bool:
    return any(t.dtype.is_complex for t in tensors_in(val))


def _complex_arg(arg: Any) -> bool:
    return isinstance(arg, Node) and _is_complex(arg.meta.get("val"))


def _memory_format_ok(node: Node) -> Optional[str]:
    names = [a.name for a in node.target._schema.arguments]
    if "memory_format" in names:
        # Only a format the call names: schema defaults are preserve/contiguous (stored as a bare int).
        fmt = schema_get(node.target, node.args, node.kwargs, "memory_format", default=False)
        if fmt not in _SAFE_MEMORY_FORMATS:
            return f"memory_format={fmt} has no meaning for a pair with one more dim"
    return None


def _complex_in_and_out(node: Node) -> Optional[str]:
    src = node.args[0]
    if not _complex_arg(src):
        return "it turns a real tensor into a complex one, which no rule covers"
    if not _is_complex(node.meta.get("val")):
        return "it casts complex to real, which drops the imaginary part (eager warns); cast explicitly instead"
    return _memory_format_ok(node)


# --- structural ops: same op, arguments adjusted for the trailing pair dim -----------------------------

_DIM, _NEW_DIM, _DIMS, _SIZE, _REPEATS, _PERM = "dim", "new_dim", "dims", "size", "repeats", "perm"


def _adjust(kind: str, value: Any, rank: int) -> Any:
    """Map one argument of a complex-rank-``rank`` op to the pair (rank + 1) version of the same op."""
    if kind == _DIM:
        return value + rank if value < 0 else value
    if kind == _NEW_DIM:  # a dim of a result with one more axis than the complex input (unsqueeze, stack)
        return value + rank + 1 if value < 0 else value
    if kind == _DIMS:
        return [d + rank if d < 0 else d for d in value]
    if kind == _SIZE:
        return [*value, 2]
    if kind == _REPEATS:
        return [*value, 1]
    if kind == _PERM:
        return [*(d + rank if d < 0 else d for d in value), rank]
    raise ValueError(kind)


_STRUCTURAL: Dict[Any, Dict[str, str]] = {
    aten.view.default: {"size": _SIZE},
    aten.reshape.default: {"shape": _SIZE},
    aten._unsafe_view.default: {"size": _SIZE},
    aten.expand.default: {"size": _SIZE},
    aten.slice.Tensor: {"dim": _DIM},
    aten.select.int: {"dim": _DIM},
    aten.narrow.default: {"dim": _DIM},
    aten.index_select.default: {"dim": _DIM},
    aten.index.Tensor: {},
    aten.split.Tensor: {"dim": _DIM},
    aten.split_with_sizes.default: {"dim": _DIM},
    aten.chunk.default: {"dim": _DIM},
    aten.unbind.int: {"dim": _DIM},
    aten.repeat.default: {"repeats": _REPEATS},
    aten.permute.default: {"dims": _PERM},
    aten.transpose.int: {"dim0": _DIM, "dim1": _DIM},
    aten.squeeze.default: {},  # the pair dim has size 2, so squeezing every size-1 dim never touches it
    aten.squeeze.dim: {"dim": _DIM},
    aten.squeeze.dims: {"dim": _DIMS},
    aten.unsqueeze.default: {"dim": _NEW_DIM},
    aten.flatten.using_ints: {"start_dim": _DIM, "end_dim": _DIM},
    aten.unflatten.int: {"dim": _DIM},
    aten.cat.default: {"dim": _DIM},
    aten.stack.default: {"dim": _NEW_DIM},
    aten.clone.default: {},
    aten.contiguous.default: {},
    aten.alias.default: {},
    aten.detach.default: {},
    aten.lift_fresh_copy.default: {},
    aten.sym_size.int: {"dim": _DIM},
}


def _check_structural(node: Node) -> Optional[str]:
    first = node.args[0]
    tensors = first if isinstance(first, (list, tuple)) else [first]
    if not all(_complex_arg(t) for t in tensors):
        return "it mixes complex and real tensors, which no rule covers"
    if any(_complex_arg(n) for n in input_nodes(node) if n not in tensors):
        return "a complex tensor is passed where an index or size is expected"
    return _memory_format_ok(node)


def _emit_structural(rw: "_Rewriter", node: Node) -> Node:
    args, kwargs = rw.mapped(node)
    first = node.args[0]
    tensors = list(first) if isinstance(first, (list, tuple)) else [first]
    rank = tensors[0].meta["val"].dim()
    for name, kind in _STRUCTURAL[node.target].items():
        value = schema_get(node.target, args, kwargs, name)
        adjusted = _adjust(kind, value, rank)
        if adjusted != value:
            args, kwargs = schema_set(node.target, args, kwargs, name, adjusted)
    if len(tensors) > 1:  # cat / stack promote like eager: every pair to the result's pair dtype
        dtype = rw.pair_dtype(node.meta["val"].dtype)
        args = ([rw.cast(p, dtype) for p in args[0]], *args[1:])
    if node.target is aten.view.default:
        return rw.view_or_reshape(args, kwargs)
    return rw.call(node.target, args, kwargs, tag=str(node.target.__name__).split(".")[0])


for _target in _STRUCTURAL:
    _RULES[_target] = _Rule(_emit_structural, _check_structural)


@_rule(operator.getitem)
def _emit_getitem(rw: "_Rewriter", node: Node) -> Node:
    src, index = node.args
    return rw.call(operator.getitem, (rw.env[src], index), tag="getitem")


# --- boundaries ---------------------------------------------------------------------------------------


def _check_view_as_complex(node: Node) -> Optional[str]:
    src = node.args[0].meta.get("val")
    if not isinstance(src, torch.Tensor) or src.dtype not in (torch.float32, torch.float64):
        return f"its input is {getattr(src, 'dtype', src)}, not float32/float64"
    return None


@_rule(aten.view_as_complex.default, check=_check_view_as_complex)
def _emit_view_as_complex(rw: "_Rewriter", node: Node) -> Node:
    # The real [..., 2] input already is the pair.
    return rw.cast(rw.env[node.args[0]], rw.pair_dtype(node.meta["val"].dtype))


@_rule(aten.view_as_real.default)
def _emit_view_as_real(rw: "_Rewriter", node: Node) -> Node:
    # Back in the real world the program sees eager's dtype (float64 for complex128), whatever the pair's.
    return rw.cast(rw.env[node.args[0]], node.meta["val"].dtype)


@_rule(aten.polar.default)
def _emit_polar(rw: "_Rewriter", node: Node) -> Node:
    r, t = (rw.env[a] for a in node.args[:2])
    re = rw.call(aten.mul.Tensor, (r, rw.call(aten.cos.default, (t,), tag="cos")), tag="re")
    im = rw.call(aten.mul.Tensor, (r, rw.call(aten.sin.default, (t,), tag="sin")), tag="im")
    pair = rw.call(aten.stack.default, ([re, im], -1), tag="stack")
    return rw.cast(pair, rw.pair_dtype(node.meta["val"].dtype))


# --- arithmetic ---------------------------------------------------------------------------------------


def _check_mul(node: Node) -> Optional[str]:
    if any(isinstance(a, complex) for a in node.args):
        return "it multiplies by a complex Python scalar, which no rule covers"
    return None


@_rule(aten.mul.Tensor, aten.mul.Scalar, check=_check_mul)
def _emit_mul(rw: "_Rewriter", node: Node) -> Node:
    a, b = node.args[:2]
    dtype = rw.pair_dtype(node.meta["val"].dtype)
    if _complex_arg(a) and _complex_arg(b):
        ar, ai = rw.parts(rw.cast(rw.env[a], dtype))
        br, bi = rw.parts(rw.cast(rw.env[b], dtype))
        mul = aten.mul.Tensor
        rr, ii = rw.call(mul, (ar, br), tag="rr"), rw.call(mul, (ai, bi), tag="ii")
        ri, ir = rw.call(mul, (ar, bi), tag="ri"), rw.call(mul, (ai, br), tag="ir")
        re = rw.call(aten.sub.Tensor, (rr, ii), tag="re")
        im = rw.call(aten.add.Tensor, (ri, ir), tag="im")
        return rw.call(aten.stack.default, ([re, im], -1), tag="stack")
    z, r = (a, b) if _complex_arg(a) else (b, a)
    pair = rw.cast(rw.env[z], dtype)
    if isinstance(r, Node) and isinstance(r.meta.get("val"), torch.Tensor):
        # A real tensor scales both halves: broadcast it over the pair dim.
        r = rw.call(aten.unsqueeze.default, (rw.cast(rw.env[r], dtype), -1), tag="real")
        return rw.call(aten.mul.Tensor, (pair, r), tag="scaled")
    scalar = rw.env[r] if isinstance(r, Node) else r  # a Python number, or a SymInt/SymFloat node
    return rw.call(node.target, (pair, scalar), tag="scaled")


def _check_add_sub(node: Node) -> Optional[str]:
    if not (_complex_arg(node.args[0]) and _complex_arg(node.args[1])):
        return "only complex +/- complex is supported, not a mix with real tensors or scalars"
    if isinstance(node.kwargs.get("alpha"), complex):
        return "alpha is complex"
    return None


@_rule(aten.add.Tensor, aten.sub.Tensor, check=_check_add_sub)
def _emit_add_sub(rw: "_Rewriter", node: Node) -> Node:
    dtype = rw.pair_dtype(node.meta["val"].dtype)
    a, b = (rw.cast(rw.env[x], dtype) for x in node.args[:2])
    return rw.call(node.target, (a, b), dict(node.kwargs), tag="pairwise")


# --- casts --------------------------------------------------------------------------------------------


@_rule(aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, check=_complex_in_and_out)
def _emit_cast(rw: "_Rewriter", node: Node) -> Node:
    args, kwargs = rw.mapped(node)
    if schema_get(node.target, node.args, node.kwargs, "dtype") is not None:
        pair = rw.pair_dtype(node.meta["val"].dtype)
        args, kwargs = schema_set(node.target, args, kwargs, "dtype", pair)
    return rw.call(node.target, args, kwargs, tag="to")


def _check_type_as(node: Node) -> Optional[str]:
    if not _complex_arg(node.args[1]):
        return "it casts complex to real, which drops the imaginary part (eager warns); cast explicitly instead"
    return _complex_in_and_out(node)


@_rule(aten.type_as.default, check=_check_type_as)
def _emit_type_as(rw: "_Rewriter", node: Node) -> Node:
    return rw.call(aten.type_as.default, (rw.env[node.args[0]], rw.env[node.args[1]]), tag="type_as")


@_rule(aten._assert_tensor_metadata.default)
def _emit_assert_metadata(rw: "_Rewriter", node: Node) -> Node:
    # Keep the check, stated for the pair: its dtype, its shape (strides of the pair are not eager's).
    args, kwargs = rw.mapped(node)
    target = node.target
    old = node.args[0].meta["val"]
    if schema_get(target, node.args, node.kwargs, "dtype") is not None:
        args, kwargs = schema_set(target, args, kwargs, "dtype", rw.pair_dtype(old.dtype))
    size = schema_get(target, args, kwargs, "size")
    if size is not None:
        args, kwargs = schema_set(target, args, kwargs, "size", [*size, 2])
    if schema_get(target, node.args, node.kwargs, "stride") is not None:
        args, kwargs = schema_set(target, args, kwargs, "stride", None)
    return rw.call(target, args, kwargs, tag="assert")


# ============================================================================================ pass 1: matching


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
    touches_complex = _is_complex(node.meta.get("val")) or any(_complex_arg(n) for n in input_nodes(node))
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
    rule = _RULES.get(node.target)
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
        if not _complex_arg(written):
            continue
        spec = specs.get(written)
        what = f"complex buffer {spec.target!r}" if spec is not None else f"complex value {written.name}"
        return (
            f"{op_name(node.target)} at {_where(node)}: it mutates {what} in place; rewriting it would change "
            "what the program writes back; keep mutated state real (store view_as_real of it)"
        )
    return None


def _check_hop(node: Node, root: torch.nn.Module) -> Optional[str]:
    operands = _is_complex(node.meta.get("val")) or any(_complex_arg(n) for n in input_nodes(node))
    inside = any(
        _is_complex(n.meta.get("val")) for body in hop_bodies(node, root) for gm in graph_modules_under(body)
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
        if isinstance(arg, Node) and _is_complex(arg.meta.get("val")):
            return (
                f"complex program output {arg.name!r} ({spec.kind.name}) at {_where(arg)}: the caller would get "
                "real pairs instead; return torch.view_as_real(...) from the model"
            )
    return None


# ============================================================================================ pass 2: rewriting


class _Rewriter(GraphBuilder):
    """GraphBuilder plus the pair vocabulary the rules are written in."""

    def __init__(self, ep: ExportedProgram, pairs: Dict[torch.dtype, torch.dtype]):
        super().__init__(ep.graph_module, fake_mode_of(ep))
        self.pairs = pairs

    def pair_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.pairs[dtype]

    def mapped(self, node: Node) -> Tuple[tuple, dict]:
        return map_arg(node.args, self.env.__getitem__), map_arg(node.kwargs, self.env.__getitem__)

    def cast(self, pair: Node, dtype: torch.dtype) -> Node:
        if pair.meta["val"].dtype == dtype:
            return pair
        return self.call(aten._to_copy.default, (pair,), {"dtype": dtype}, tag="cast")

    def parts(self, pair: Node) -> Tuple[Node, Node]:
        return (
            self.call(aten.select.int, (pair, -1, 0), tag="real"),
            self.call(aten.select.int, (pair, -1, 1), tag="imag"),
        )

    def view_or_reshape(self, args: tuple, kwargs: dict) -> Node:
        # A pair built by arithmetic is contiguous where eager's complex result may have kept its inputs'
        # layout, so a view eager could take may need a copy here; reshape is the same value either way.
        try:
            return self.call(aten.view.default, args, kwargs, tag="view")
        except (RuntimeError, ValueError):  # what fake tensors raise for "cannot view with these strides"
            return self.call(aten.reshape.default, args, kwargs, tag="reshape")


def _rewrite(ep: ExportedProgram, found: _Found, pairs: Dict[torch.dtype, torch.dtype]) -> RewriteResult:
    rw = _Rewriter(ep, pairs)
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
                new = _RULES[node.target].emit(rw, node)
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
    if not _is_complex(old_val):
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
