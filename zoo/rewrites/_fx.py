"""Graph utilities shared by the lowering-fix rewrites (detach, fused SDPA, view copies, autocast regions,
output safety).

Every rewrite matches on the program it is given, then edits a copy made by ``copy_program`` and hands the
copy back through ``finish``. The copy shares the weights and constants of the original (no rewrite here
touches a tensor's data) but owns its graphs, including the sub-graphs of higher-order ops, so a rewrite that
declines half-way leaves the caller's program exactly as it was.
"""

from __future__ import annotations

import contextlib
import copy
import operator
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind, TensorArgument
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg

from ..errors import ExportError
from .result import source_line


aten = torch.ops.aten

# Meta entries that say where a node came from; a replacement node inherits them from the node it replaces.
_PROVENANCE_KEYS = ("stack_trace", "nn_module_stack", "source_fn_stack", "torch_fn", "from_node", "seq_nr", "custom")

# Output kinds that exist only in a joint forward-backward program.
_TRAINING_OUTPUTS = (OutputKind.LOSS_OUTPUT, OutputKind.GRADIENT_TO_PARAMETER, OutputKind.GRADIENT_TO_USER_INPUT)


class Declined(Exception):
    """Raised inside a rewrite when one node cannot be handled; the rewrite then declines the whole program."""

    def __init__(self, node: Node, why: str):
        super().__init__(f"{op_name(node.target)} at {source_line(node)}: {why}")
        self.node = node


def require_program(ep: Any, rewrite: str) -> None:
    if not isinstance(ep, ExportedProgram):
        raise ExportError(
            f"{rewrite} expects a torch.export ExportedProgram, got {type(ep).__name__}",
            hint="pass the program torch.export.export returned (before any ExecuTorch step)",
        )


def op_name(target: Any) -> str:
    """'aten.mul.Tensor' for ATen overloads, 'higher_order.wrap_with_autocast' for HOPs, the name otherwise."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order.{target.name()}"
    return getattr(target, "__name__", str(target))


def is_inference_program(ep: ExportedProgram) -> bool:
    """True unless the program carries a loss or gradients (a joint forward-backward program)."""
    return not any(spec.kind in _TRAINING_OUTPUTS for spec in ep.graph_signature.output_specs)


def fetch_attr(gm: torch.nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _set_attr(gm: torch.nn.Module, target: str, value: Any) -> None:
    *path, last = target.split(".")
    owner = fetch_attr(gm, ".".join(path)) if path else gm
    setattr(owner, last, value)


def copy_graph_module(gm: GraphModule) -> GraphModule:
    """A GraphModule with its own graph (node meta copied shallowly, so fake values are shared) and its own
    copies of every sub-GraphModule a ``get_attr`` names; other attributes are shared."""
    graph = copy.deepcopy(gm.graph)
    new = GraphModule(gm, graph, class_name=type(gm).__name__)
    for node in graph.nodes:
        if node.op == "get_attr":
            obj = fetch_attr(new, node.target)
            if isinstance(obj, GraphModule):
                _set_attr(new, node.target, copy_graph_module(obj))
    new.meta.update(gm.meta)
    return new


def copy_program(ep: ExportedProgram) -> ExportedProgram:
    """An ExportedProgram whose graphs and signature may be edited without touching ``ep``."""
    return _rebuild(ep, copy_graph_module(ep.graph_module), copy.deepcopy(ep.graph_signature))


def _rebuild(ep: ExportedProgram, gm: GraphModule, signature) -> ExportedProgram:
    # The public constructor validates graph against signature, which is the check every rewrite needs.
    return ExportedProgram(
        root=gm,
        graph=gm.graph,
        graph_signature=signature,
        state_dict=ep.state_dict,
        range_constraints=dict(ep.range_constraints),
        module_call_graph=copy.deepcopy(ep.module_call_graph),
        example_inputs=ep.example_inputs,
        constants=ep.constants,
        verifiers=list(ep.verifiers),
    )


def finish(work: ExportedProgram) -> ExportedProgram:
    """Validate a copy made by ``copy_program`` after its graphs were edited and return it as a fresh program.

    Output specs name output nodes, so they are re-pointed at whatever the output node now returns; graphs
    are linted and recompiled, innermost first, and sub-modules no graph refers to any more are dropped.
    """
    gm = work.graph_module
    outputs = list(output_node(gm.graph).args[0])
    signature = copy.deepcopy(work.graph_signature)
    if len(outputs) != len(signature.output_specs):
        raise AssertionError("a rewrite changed the number of program outputs")
    for spec, value in zip(signature.output_specs, outputs):
        if isinstance(spec.arg, TensorArgument) and isinstance(value, Node):
            spec.arg = TensorArgument(name=value.name)
    for module in reversed(list(gm.modules())):
        if isinstance(module, GraphModule):
            module.graph.lint()
            module.delete_all_unused_submodules()
            module.recompile()
    return _rebuild(work, gm, signature)


def output_node(graph: torch.fx.Graph) -> Node:
    return next(n for n in reversed(graph.nodes) if n.op == "output")


def calls(graph: torch.fx.Graph, targets) -> Iterator[Node]:
    for node in graph.nodes:
        if node.op == "call_function" and node.target in targets:
            yield node


def all_graph_modules(gm: GraphModule) -> Iterator[GraphModule]:
    for module in gm.modules():
        if isinstance(module, GraphModule):
            yield module


@contextlib.contextmanager
def no_autocast() -> Iterator[None]:
    """Fake evaluation must see the ops as written, whatever autocast state the caller runs under."""
    with contextlib.ExitStack() as stack:
        for device in ("cpu", "cuda"):
            stack.enter_context(torch.autocast(device_type=device, enabled=False))
        yield


def fake_eval(target: Callable, args: tuple, kwargs: Optional[Dict[str, Any]] = None) -> Any:
    """Run ``target`` on the fake values of the node arguments, in the program's fake mode, without autocast.

    This is how a new node gets its ``val``: computed, never copied from the node it replaces (a view that
    replaces a copy has other strides).
    """
    kwargs = kwargs or {}
    vals = map_arg((args, kwargs), lambda n: n.meta["val"])
    flat = [v for v in torch.utils._pytree.tree_leaves(vals) if isinstance(v, torch.Tensor)]
    fake_mode = torch._guards.detect_fake_mode(flat)
    ctx = fake_mode if fake_mode is not None else contextlib.nullcontext()
    with ctx, no_autocast():
        return target(*vals[0], **vals[1])


def set_val(node: Node, val: Any, like: Optional[Node] = None) -> None:
    """Give ``node`` its value meta, and the provenance (source line, module stack) of ``like``."""
    if like is not None:
        for key in _PROVENANCE_KEYS:
            if key in like.meta:
                node.meta[key] = like.meta[key]
    node.meta["val"] = val
    if isinstance(val, torch.Tensor):
        from torch.fx.passes.shape_prop import _extract_tensor_metadata

        node.meta["tensor_meta"] = _extract_tensor_metadata(val)
    else:
        node.meta.pop("tensor_meta", None)


def insert_call(graph: torch.fx.Graph, before: Node, target: Callable, args: tuple, kwargs=None,
                like: Optional[Node] = None) -> Node:
    """Insert ``target(*args, **kwargs)`` before ``before``, with a computed ``val``."""
    kwargs = dict(kwargs or {})
    with graph.inserting_before(before):
        node = graph.call_function(target, args, kwargs)
    set_val(node, fake_eval(target, args, kwargs), like=like if like is not None else before)
    return node


def getitem_users(node: Node) -> Dict[int, List[Node]]:
    """``{index: [getitem nodes]}`` for a node that returns several values; raises Declined for any other use."""
    out: Dict[int, List[Node]] = {}
    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int):
            out.setdefault(user.args[1], []).append(user)
        else:
            raise Declined(node, f"its result is used whole by {user.name} ({op_name(user.target)}), not by index")
    return out


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


def _known_equal(a: Any, b: Any) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return statically_known_true(a == b)


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when two (fake) tensors provably have the same sizes, strides and storage offset."""
    if a.dim() != b.dim() or a.dtype != b.dtype:
        return False
    pairs = list(zip(a.shape, b.shape)) + list(zip(a.stride(), b.stride()))
    pairs.append((a.storage_offset(), b.storage_offset()))
    return all(_known_equal(x, y) for x, y in pairs)
