"""The values of graph nodes: comparing fake values, and computing a new node's value on fake tensors."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, Optional

import torch
from torch.export import ExportedProgram
from torch.fx import Graph, Node
from torch.fx.node import map_arg
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from zoo.rewrites.graph.nodes import fetch_attr

# Metadata that describes a value and must be recomputed, never inherited by a replacement node.
VALUE_META_KEYS = ("val", "tensor_meta", "example_value", "unbacked_bindings")

# Metadata that says where a node came from; a node inserted for another inherits it (``insert_call``).
PROVENANCE_KEYS = ("stack_trace", "nn_module_stack", "source_fn_stack", "torch_fn", "from_node", "seq_nr", "custom")


# --------------------------------------------------------------------------------------------- values


def tensors_in(val: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside a node value (a tensor, or a list/tuple of them as ``split`` returns)."""
    if isinstance(val, torch.Tensor):
        yield val
    elif isinstance(val, (list, tuple)):
        for v in val:
            yield from tensors_in(v)


def node_value(node: Node, root: Optional[torch.nn.Module] = None) -> Any:
    """``meta["val"]``, or for a ``get_attr`` node the attribute itself (HOP bodies carry no val)."""
    if node.op == "get_attr" and root is not None:
        return fetch_attr(root, node.target)
    return node.meta.get("val")


def same_size(a: Any, b: Any) -> bool:
    """Whether two sizes (ints or SymInts) are provably equal, without adding guards."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    # Imported here: symbolic_shapes imports sympy (seconds), and ``import zoo.rewrites`` (recipe validation)
    # must stay cheap; any program with a symbolic size has loaded it already.
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(a == b))


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, and the same strides wherever a dimension holds more than one element (a size-1 dimension's
    stride is never read), provably."""
    return a.dim() == b.dim() and all(same_size(x, y) for x, y in zip(a.shape, b.shape)) and all(
        same_size(sa, sb) for n, sa, sb in zip(a.shape, a.stride(), b.stride()) if not same_size(n, 1))


def same_tensor_meta(a: torch.Tensor, b: torch.Tensor, strides: bool = True) -> bool:
    """Same dtype, device, shape and (optionally) strides and storage offset, provably: downstream fake values
    would not change."""
    if a.dtype != b.dtype or a.dim() != b.dim() or a.device != b.device:
        return False
    if not all(same_size(x, y) for x, y in zip(a.shape, b.shape)):
        return False
    if not strides:
        return True
    return all(same_size(x, y) for x, y in zip(a.stride(), b.stride())) and same_size(
        a.storage_offset(), b.storage_offset()
    )


def same_value_meta(a: Any, b: Any, strides: bool = True) -> bool:
    """``same_tensor_meta`` lifted to node values: tensors, lists of tensors, SymInts, None."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return same_tensor_meta(a, b, strides)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value_meta(x, y, strides) for x, y in zip(a, b))
    if isinstance(a, (int, torch.SymInt)) and isinstance(b, (int, torch.SymInt)):
        return same_size(a, b)
    return type(a) is type(b) and not isinstance(a, torch.Tensor)


def same_dtypes(a: Any, b: Any) -> bool:
    """Same structure and, tensor by tensor, the same dtype and rank (shapes are symbolic and never in doubt)."""
    la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    if len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor) and (x.dtype != y.dtype or x.dim() != y.dim()):
            return False
    return True


# --------------------------------------------------------------------------------------------- fake values


def fake_mode_of(ep: ExportedProgram):
    """The FakeTensorMode the program was traced under (its ShapeEnv holds the dynamic dims' symbols)."""
    vals = [n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder"]
    mode = torch._guards.detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if mode is None:
        # A program with no tensor inputs at all: any fresh mode computes its (static) values.
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=True)
    return mode


@contextlib.contextmanager
def no_autocast() -> Iterator[None]:
    """Fake evaluation must see the ops as written, whatever autocast state the caller runs under."""
    with contextlib.ExitStack() as stack:
        for device in ("cpu", "cuda"):
            stack.enter_context(torch.autocast(device_type=device, enabled=False))
        yield


def fake_eval(target: Callable, args: tuple, kwargs: Optional[Dict[str, Any]] = None) -> Any:
    """Run ``target`` on the fake values of the node arguments, in their fake mode, without autocast.

    This is how a new node gets its ``val``: computed, never copied from the node it replaces (a view that
    replaces a copy has other strides). The program's own ``FakeTensorMode`` and ``ShapeEnv`` are used, so
    symbolic dims stay the same symbols.
    """
    kwargs = kwargs or {}
    vals = map_arg((args, kwargs), lambda n: n.meta["val"])
    flat = [v for v in torch.utils._pytree.tree_leaves(vals) if isinstance(v, torch.Tensor)]
    fake_mode = torch._guards.detect_fake_mode(flat)
    ctx = fake_mode if fake_mode is not None else contextlib.nullcontext()
    with ctx, no_autocast():
        return target(*vals[0], **vals[1])


def set_value(node: Node, val: Any) -> None:
    """Set ``meta['val']`` and, for tensors, the ``tensor_meta`` summary export keeps beside it."""
    node.meta["val"] = val
    node.meta.pop("tensor_meta", None)
    if isinstance(val, torch.Tensor):
        node.meta["tensor_meta"] = _extract_tensor_metadata(val)


def inherit_provenance(node: Node, like: Node) -> None:
    """Give ``node`` the source line and module stack of ``like``, so reasons and later passes still point at
    user code."""
    for key in PROVENANCE_KEYS:
        if key in like.meta:
            node.meta[key] = like.meta[key]


def insert_call(graph: Graph, before: Node, target: Callable, args: tuple, kwargs=None,
                like: Optional[Node] = None) -> Node:
    """Insert ``target(*args, **kwargs)`` before ``before``, with a computed ``val`` and the provenance of
    ``like`` (default: ``before``)."""
    kwargs = dict(kwargs or {})
    with graph.inserting_before(before):
        node = graph.call_function(target, args, kwargs)
    inherit_provenance(node, like if like is not None else before)
    set_value(node, fake_eval(target, args, kwargs))
    return node
