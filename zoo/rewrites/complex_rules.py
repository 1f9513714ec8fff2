"""The rules of ``replace_complex_with_real``: for each op on complex values, whether it can be rewritten
(``check``) and the nodes that compute it on real pairs (``emit``), written in ``PairBuilder``'s vocabulary.

A complex value ``z`` of shape ``S`` is the real tensor ``P = view_as_real(z)`` of shape ``S + [2]`` (``P[..., 0]``
real, ``P[..., 1]`` imaginary): complex64 -> float32, complex128 -> float64 (or float32, the recipe's
``rotary_pairs: float32``, because released ExecuTorch CUDA runtimes have no float64).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch.export import ExportedProgram
from torch.fx import Node
from torch.fx.node import map_arg

from zoo.rewrites.graph import GraphBuilder, fake_mode_of, input_nodes, schema_get, schema_set, tensors_in

aten = torch.ops.aten

# Memory formats that mean the same thing for a pair (one more trailing dim) as for the complex value.
_SAFE_MEMORY_FORMATS = (None, torch.preserve_format, torch.contiguous_format)

# The formulas (``re(P) = select(P, -1, 0)``, ``im(P) = select(P, -1, 1)``, ``d`` = the result's pair dtype):
#
#     view_as_complex(x)    ->  x                       (cast to d where d differs from x's dtype)
#     view_as_real(z)       ->  P                       (cast back to eager's real dtype where d differs)
#     polar(r, t)           ->  stack([r * cos(t), r * sin(t)], -1)      computed in r's dtype, then cast to d
#     a * b   (complex)     ->  stack([re(A)re(B) - im(A)im(B), re(A)im(B) + im(A)re(B)], -1)
#     a * r   (r real)      ->  A * unsqueeze(r, -1)    (a Python scalar multiplies A directly)
#     a + b, a - b          ->  A + B, A - B            (alpha kept; both operands complex)
#     casts c64 <-> c128    ->  the same cast op with dtype d
#     view/reshape/expand   ->  the same op with shape + [2]
#     dim-taking views      ->  the same op with negative dims counted from the complex rank (so the
#                               trailing pair dim is never touched): slice, select, narrow, index_select,
#                               split, split_with_sizes, chunk, unbind, transpose, squeeze, unsqueeze,
#                               flatten, unflatten, cat, stack, sym_size; permute gets the pair dim appended,
#                               repeat a trailing 1; index, clone, contiguous, alias, detach keep their args
#     complex constant      ->  its real view, stored in the program's state_dict / constants
#
# Operands are first cast to the pair dtype of eager's *result* dtype, because eager promotes the operands and
# then computes: complex64 * complex128 widens the complex64 pair to float64 and multiplies in float64, and a
# polar built in complex64 and then cast to complex128 (LingBot-VA) is computed in float32 and widened, so the
# rewrite matches eager rather than a more precise value.


class PairBuilder(GraphBuilder):
    """GraphBuilder plus the pair vocabulary the rules are written in (``pairs``: complex dtype -> pair dtype)."""

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


@dataclass(frozen=True)
class Rule:
    emit: Callable[[PairBuilder, Node], Node]
    check: Callable[[Node], Optional[str]]  # why this node cannot be rewritten, or None


RULES: Dict[Any, Rule] = {}


def no_objection(node: Node) -> Optional[str]:
    return None


def _rule(*targets: Any, check: Callable[[Node], Optional[str]] = no_objection):
    def register(emit: Callable[[PairBuilder, Node], Node]):
        for target in targets:
            RULES[target] = Rule(emit, check)
        return emit

    return register


def is_complex(val: Any) -> bool:
    return any(t.dtype.is_complex for t in tensors_in(val))


def complex_arg(arg: Any) -> bool:
    return isinstance(arg, Node) and is_complex(arg.meta.get("val"))


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
    if not complex_arg(src):
        return "it turns a real tensor into a complex one, which no rule covers"
    if not is_complex(node.meta.get("val")):
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
    if not all(complex_arg(t) for t in tensors):
        return "it mixes complex and real tensors, which no rule covers"
    if any(complex_arg(n) for n in input_nodes(node) if n not in tensors):
        return "a complex tensor is passed where an index or size is expected"
    return _memory_format_ok(node)


def _emit_structural(rw: PairBuilder, node: Node) -> Node:
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
    RULES[_target] = Rule(_emit_structural, _check_structural)


@_rule(operator.getitem)
def _emit_getitem(rw: PairBuilder, node: Node) -> Node:
    src, index = node.args
    return rw.call(operator.getitem, (rw.env[src], index), tag="getitem")


# --- boundaries ---------------------------------------------------------------------------------------


def _check_view_as_complex(node: Node) -> Optional[str]:
    src = node.args[0].meta.get("val")
    if not isinstance(src, torch.Tensor) or src.dtype not in (torch.float32, torch.float64):
        return f"its input is {getattr(src, 'dtype', src)}, not float32/float64"
    return None


@_rule(aten.view_as_complex.default, check=_check_view_as_complex)
def _emit_view_as_complex(rw: PairBuilder, node: Node) -> Node:
    # The real [..., 2] input already is the pair.
    return rw.cast(rw.env[node.args[0]], rw.pair_dtype(node.meta["val"].dtype))


@_rule(aten.view_as_real.default)
def _emit_view_as_real(rw: PairBuilder, node: Node) -> Node:
    # Back in the real world the program sees eager's dtype (float64 for complex128), whatever the pair's.
    return rw.cast(rw.env[node.args[0]], node.meta["val"].dtype)


@_rule(aten.polar.default)
def _emit_polar(rw: PairBuilder, node: Node) -> Node:
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
def _emit_mul(rw: PairBuilder, node: Node) -> Node:
    a, b = node.args[:2]
    dtype = rw.pair_dtype(node.meta["val"].dtype)
    if complex_arg(a) and complex_arg(b):
        ar, ai = rw.parts(rw.cast(rw.env[a], dtype))
        br, bi = rw.parts(rw.cast(rw.env[b], dtype))
        mul = aten.mul.Tensor
        rr, ii = rw.call(mul, (ar, br), tag="rr"), rw.call(mul, (ai, bi), tag="ii")
        ri, ir = rw.call(mul, (ar, bi), tag="ri"), rw.call(mul, (ai, br), tag="ir")
        re = rw.call(aten.sub.Tensor, (rr, ii), tag="re")
        im = rw.call(aten.add.Tensor, (ri, ir), tag="im")
        return rw.call(aten.stack.default, ([re, im], -1), tag="stack")
    z, r = (a, b) if complex_arg(a) else (b, a)
    pair = rw.cast(rw.env[z], dtype)
    if isinstance(r, Node) and isinstance(r.meta.get("val"), torch.Tensor):
        # A real tensor scales both halves: broadcast it over the pair dim.
        r = rw.call(aten.unsqueeze.default, (rw.cast(rw.env[r], dtype), -1), tag="real")
        return rw.call(aten.mul.Tensor, (pair, r), tag="scaled")
    scalar = rw.env[r] if isinstance(r, Node) else r  # a Python number, or a SymInt/SymFloat node
    return rw.call(node.target, (pair, scalar), tag="scaled")


def _check_add_sub(node: Node) -> Optional[str]:
    if not (complex_arg(node.args[0]) and complex_arg(node.args[1])):
        return "only complex +/- complex is supported, not a mix with real tensors or scalars"
    if isinstance(node.kwargs.get("alpha"), complex):
        return "alpha is complex"
    return None


@_rule(aten.add.Tensor, aten.sub.Tensor, check=_check_add_sub)
def _emit_add_sub(rw: PairBuilder, node: Node) -> Node:
    dtype = rw.pair_dtype(node.meta["val"].dtype)
    a, b = (rw.cast(rw.env[x], dtype) for x in node.args[:2])
    return rw.call(node.target, (a, b), dict(node.kwargs), tag="pairwise")


# --- casts --------------------------------------------------------------------------------------------


@_rule(aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, check=_complex_in_and_out)
def _emit_cast(rw: PairBuilder, node: Node) -> Node:
    args, kwargs = rw.mapped(node)
    if schema_get(node.target, node.args, node.kwargs, "dtype") is not None:
        pair = rw.pair_dtype(node.meta["val"].dtype)
        args, kwargs = schema_set(node.target, args, kwargs, "dtype", pair)
    return rw.call(node.target, args, kwargs, tag="to")


def _check_type_as(node: Node) -> Optional[str]:
    if not complex_arg(node.args[1]):
        return "it casts complex to real, which drops the imaginary part (eager warns); cast explicitly instead"
    return _complex_in_and_out(node)


@_rule(aten.type_as.default, check=_check_type_as)
def _emit_type_as(rw: PairBuilder, node: Node) -> Node:
    return rw.call(aten.type_as.default, (rw.env[node.args[0]], rw.env[node.args[1]]), tag="type_as")


@_rule(aten._assert_tensor_metadata.default)
def _emit_assert_metadata(rw: PairBuilder, node: Node) -> Node:
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
