"""ExportedProgram surgery shared by every zoo rewrite: the one place that names ops, finds nodes, computes fake
values and builds the rewritten program.

A rewrite never edits the caller's program. It matches on the program it is given, then either

* edits a private copy (``copy_program``) in place and hands it back through ``finish``: for rewrites that
  swap, insert or inline nodes (detach, fused SDPA, view copies, autocast regions, output safety); or
* builds a *new* ``torch.fx.Graph`` beside the old one node by node (``GraphBuilder``), with new state tensors
  where it replaces them (``replace_state``), and wraps it with ``rebuild_program``: for rewrites that change
  dtypes or shapes (complex to real, float64 narrowing and splitting).

Either way a new node's ``meta["val"]`` is computed by running its op on fake tensors (the program's own
``FakeTensorMode`` and ``ShapeEnv``, so symbolic dims stay the same symbols), never copied from the node it
replaces. Weights and constants that are not replaced are shared, not copied (a 5 B-parameter program must not
be duplicated in memory); graphs, including the sub-graphs of higher-order ops, are private to the new program.

A rewrite that cannot handle one node raises ``Declined`` (or, around a node's rewriting, ``rewriting(node)``
turns any failure into one) and ``decline_on_failure`` declines the whole program: the result hands back the
caller's program, untouched, with the reason. No per-node failure is ever skipped.
"""

from __future__ import annotations

import contextlib
import copy
import operator
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    ConstantArgument,
    CustomObjArgument,
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
)
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_arg
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from zoo.core.errors import ExportError
from zoo.rewrites.result import RewriteResult, source_line

aten = torch.ops.aten

# Metadata that describes a value and must be recomputed, never inherited by a replacement node.
VALUE_META_KEYS = ("val", "tensor_meta", "example_value", "unbacked_bindings")

# Metadata that says where a node came from; a node inserted for another inherits it (``insert_call``).
PROVENANCE_KEYS = ("stack_trace", "nn_module_stack", "source_fn_stack", "torch_fn", "from_node", "seq_nr", "custom")

# Output kinds that exist only in a joint forward-backward program.
_TRAINING_OUTPUTS = (OutputKind.LOSS_OUTPUT, OutputKind.GRADIENT_TO_PARAMETER, OutputKind.GRADIENT_TO_USER_INPUT)


# --------------------------------------------------------------------------------------------- names


def op_name(target: Any) -> str:
    """How zoo names an op in counts, notes and reasons: ``aten.mul.Tensor`` for an ATen overload and
    ``higher_order.cond`` for a higher-order op (namespace.name, as ``str`` names ATen ops), the callable's
    name otherwise (``getitem``)."""
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order.{target.name()}"
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__name__", str(target))


def node_label(node: Node) -> str:
    """The op a call node runs, or the kind and name of any other node (``placeholder p_freqs``)."""
    return op_name(node.target) if node.op == "call_function" else f"{node.op} {node.name}"


# --------------------------------------------------------------------------------------------- declining


class Declined(Exception):
    """Raised inside a rewrite when one node cannot be handled; the rewrite then declines the whole program."""

    def __init__(self, node: Node, why: str):
        super().__init__(f"{node_label(node)} at {source_line(node)}: {why}")
        self.node = node


@contextlib.contextmanager
def rewriting(node: Node) -> Iterator[None]:
    """Around the rewriting of one node: any failure becomes ``Declined`` naming that node and the error."""
    try:
        yield
    except Declined:
        raise
    except Exception as exc:
        raise Declined(node, f"rewriting it failed: {type(exc).__name__}: {exc}") from exc


def decline_on_failure(name: str, ep: ExportedProgram, rewrite: Callable[[], RewriteResult]) -> RewriteResult:
    """``rewrite()``, or the decline of the whole program when it fails anywhere, with the reason.

    ``rewrite`` works on a copy or on a new graph, so declining hands back ``ep`` exactly as it was. A failure
    that is not ``Declined`` names no node: it comes from building the rewritten program (its signature, the
    export verifier)."""
    try:
        return rewrite()
    except Declined as declined:
        return RewriteResult.decline(name, ep, str(declined))
    except Exception as exc:
        return RewriteResult.decline(name, ep, f"rewriting failed: {type(exc).__name__}: {exc}")


def require_program(ep: Any, rewrite: str) -> None:
    if not isinstance(ep, ExportedProgram):
        raise ExportError(
            f"{rewrite} expects a torch.export ExportedProgram, got {type(ep).__name__}",
            hint="pass the program torch.export.export returned (before any ExecuTorch step)",
        )


def is_inference_program(ep: ExportedProgram) -> bool:
    """True unless the program carries a loss or gradients (a joint forward-backward program)."""
    return not any(spec.kind in _TRAINING_OUTPUTS for spec in ep.graph_signature.output_specs)


# --------------------------------------------------------------------------------------------- finding


def calls(graph: Graph, targets) -> Iterator[Node]:
    for node in graph.nodes:
        if node.op == "call_function" and node.target in targets:
            yield node


def graph_modules_under(gm: GraphModule) -> Iterator[GraphModule]:
    """``gm`` and every GraphModule nested in it (HOP bodies inside HOP bodies)."""
    for m in gm.modules():
        if isinstance(m, GraphModule):
            yield m


def is_hop(node: Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator)


def hop_bodies(node: Node, root: torch.nn.Module) -> List[GraphModule]:
    """The sub-graphs a higher-order op runs (its ``get_attr`` operands that are GraphModules)."""
    found: List[GraphModule] = []
    for n in input_nodes(node):
        if n.op == "get_attr":
            attr = fetch_attr(root, n.target)
            if isinstance(attr, GraphModule):
                found.append(attr)
    return found


def input_nodes(node: Node) -> List[Node]:
    """The nodes a node reads, in argument order (lists flattened, duplicates kept once)."""
    seen: Dict[Node, None] = {}
    map_arg((node.args, node.kwargs), lambda n: seen.setdefault(n, None))
    return list(seen)


def getitem_users(node: Node) -> Dict[int, List[Node]]:
    """``{index: [getitem nodes]}`` for a node that returns several values; raises Declined for any other use."""
    out: Dict[int, List[Node]] = {}
    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int):
            out.setdefault(user.args[1], []).append(user)
        else:
            raise Declined(node, f"its result is used whole by {user.name} ({op_name(user.target)}), not by index")
    return out


def written_args(node: Node) -> List[Any]:
    """The arguments ``node`` writes in place (schema ``alias_info.is_write``): export IR keeps in-place ops,
    and ``buffers_to_mutate`` fills only after functionalisation."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    written = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            written.append(node.kwargs.get(a.name, node.args[i] if i < len(node.args) else None))
    return written


def fetch_attr(root: torch.nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _set_attr(root: torch.nn.Module, target: str, value: Any) -> None:
    *path, last = target.split(".")
    obj = root
    for part in path:
        if not hasattr(obj, part):
            setattr(obj, part, torch.nn.Module())
        obj = getattr(obj, part)
    setattr(obj, last, value)


# --------------------------------------------------------------------------------------------- schema


def schema_get(target: Any, args: tuple, kwargs: dict, name: str, default: bool = True) -> Any:
    """The value of argument ``name`` of an ATen op call; when the call leaves it out, the schema default
    (``default=True``) or None."""
    for i, a in enumerate(target._schema.arguments):
        if a.name != name:
            continue
        if name in kwargs:
            return kwargs[name]
        if not a.kwarg_only and i < len(args):
            return args[i]
        return a.default_value if default and a.has_default_value() else None
    raise KeyError(f"{target} has no argument {name!r}")


def schema_set(target: Any, args: tuple, kwargs: dict, name: str, value: Any) -> Tuple[tuple, dict]:
    """``(args, kwargs)`` with argument ``name`` set to ``value``: positionally where the call passed it so,
    else as a keyword (every ATen argument can be passed by name)."""
    args, kwargs = list(args), dict(kwargs)
    for i, a in enumerate(target._schema.arguments):
        if a.name != name:
            continue
        if not a.kwarg_only and i < len(args) and name not in kwargs:
            args[i] = value
        else:
            kwargs[name] = value
        return tuple(args), kwargs
    raise KeyError(f"{target} has no argument {name!r}")


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
    replaces a copy has other strides).
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


# --------------------------------------------------------------------------------------------- editing a copy


def copy_program(ep: ExportedProgram) -> ExportedProgram:
    """An ExportedProgram whose graphs and signature may be edited in place without touching ``ep``."""
    gm = private_copy(ep.graph_module)
    return ExportedProgram(
        root=gm,
        graph=gm.graph,
        graph_signature=copy.deepcopy(ep.graph_signature),
        state_dict=ep.state_dict,
        range_constraints=dict(ep.range_constraints),
        module_call_graph=copy.deepcopy(ep.module_call_graph),
        example_inputs=ep.example_inputs,
        constants=ep.constants,
        verifiers=list(ep.verifiers),
    )


def finish(work: ExportedProgram) -> ExportedProgram:
    """The program a copy made by ``copy_program`` stands for after its graphs were edited, validated.

    Every graph is linted; output specs follow whatever the output node now returns (``rebuild_program``), and
    sub-modules no graph refers to any more are left behind."""
    for module in graph_modules_under(work.graph_module):
        module.graph.lint()
    return rebuild_program(work, work.graph, state_dict=work.state_dict, constants=work.constants, renamed={})


# --------------------------------------------------------------------------------------------- building beside


class GraphBuilder:
    """Builds a new graph from an old one node by node, computing each new node's value on fake tensors.

    ``env`` maps old nodes to the new nodes (or values) that stand for them. While a rewrite emits the
    replacement for one old node it sets ``origin``; every node created then inherits that node's
    metadata other than its value (stack trace, module stack), so decline messages and later passes can still
    point at user code.
    """

    def __init__(self, old_root: GraphModule, fake_mode):
        self.old_root = old_root
        self.graph = Graph()
        self.fake_mode = fake_mode
        self.env: Dict[Node, Any] = {}
        self.origin: Optional[Node] = None
        self.created: List[Node] = []  # nodes created for the current origin

    # values
    def value(self, arg: Any) -> Any:
        """The fake value(s) behind new-graph arguments (nodes replaced by their ``meta['val']``)."""
        return map_arg(arg, lambda n: node_value(n, self.old_root))

    def fake_run(self, target: Callable, args: tuple, kwargs: dict) -> Any:
        with self.fake_mode:
            return target(*self.value(args), **self.value(kwargs))

    # nodes
    def start(self, origin: Node) -> None:
        self.origin, self.created = origin, []

    def call(self, target: Callable, args: tuple, kwargs: Optional[dict] = None, tag: str = "") -> Node:
        """A new call_function node whose value is computed first (a failing op creates no node)."""
        kwargs = dict(kwargs or {})
        val = self.fake_run(target, args, kwargs)
        base = self.origin.name if self.origin is not None else "node"
        node = self.graph.create_node("call_function", target, args, kwargs, name=f"{base}_{tag or 'pair'}")
        self._inherit(node)
        set_value(node, val)
        self.created.append(node)
        return node

    def copy(self, old: Node, recompute: bool) -> Node:
        """Copy an old node unchanged; with ``recompute`` its value comes from the new inputs' values."""
        new = self.graph.node_copy(old, lambda n: self.env[n])
        if recompute and old.op == "call_function":
            for key in VALUE_META_KEYS:
                new.meta.pop(key, None)
            set_value(new, self.fake_run(old.target, new.args, new.kwargs))
        return new

    def finish(self, final: Node) -> None:
        """Give the node that now stands for the origin the origin's name, when it was made for it."""
        if final in self.created and self.origin is not None and final.name != self.origin.name:
            final._rename(self.origin.name)

    def _inherit(self, node: Node) -> None:
        if self.origin is None:
            return
        for key, value in self.origin.meta.items():
            if key not in VALUE_META_KEYS:
                node.meta[key] = value


# --------------------------------------------------------------------------------------------- state


def state_location(spec: InputSpec) -> Optional[str]:
    """Where a lifted input's tensor lives: 'state_dict', 'constants', or None for user inputs/tokens."""
    if spec.kind == InputKind.PARAMETER:
        return "state_dict"
    if spec.kind == InputKind.BUFFER:
        return "state_dict" if spec.persistent else "constants"
    if spec.kind == InputKind.CONSTANT_TENSOR:
        return "constants"
    return None


def state_tensor(ep: ExportedProgram, spec: InputSpec) -> Optional[torch.Tensor]:
    where = state_location(spec)
    if where is None:
        return None
    table = ep.state_dict if where == "state_dict" else ep.constants
    return table.get(spec.target)


def state_writer(ep: ExportedProgram, spec: InputSpec, node: Node) -> Optional[str]:
    """Where the program mutates the state input ``spec`` (placeholder ``node``), or None when it does not:
    a functionalised mutation (``buffers_to_mutate``) or an in-place op of export IR on the placeholder."""
    writer = next((u for u in node.users if node in written_args(u)), None)
    if writer is not None:
        return source_line(writer)
    if spec.target in set(ep.graph_signature.buffers_to_mutate.values()):
        return f"node {node.name}"
    return None


def replace_state(ep: ExportedProgram, spec: InputSpec, node: Node, fake_mode, convert: Callable,
                  state_dict: Dict[str, Any], constants: Dict[str, Any],
                  requires_grad: Optional[bool] = None) -> torch.Tensor:
    """Store ``convert(old)`` in place of the state tensor behind ``spec`` (in the new program's
    ``state_dict`` or ``constants``, where the old one was; a Parameter stays a Parameter, with ``requires_grad``
    or the old flag) and give the new placeholder ``node`` its fake value."""
    old = state_tensor(ep, spec)
    if old is None:
        raise RuntimeError(f"the program's state_dict/constants hold no tensor for {spec.target!r}")
    with torch.no_grad():
        new = convert(old.detach())
    if isinstance(old, torch.nn.Parameter):
        new = torch.nn.Parameter(new, requires_grad=old.requires_grad if requires_grad is None else requires_grad)
    (state_dict if state_location(spec) == "state_dict" else constants)[spec.target] = new
    set_value(node, fake_mode.from_tensor(new, static_shapes=True))
    return new


# --------------------------------------------------------------------------------------------- programs


def rebuild_program(
    ep: ExportedProgram,
    graph: Graph,
    *,
    state_dict: Dict[str, Any],
    constants: Dict[str, Any],
    renamed: Dict[str, str],
) -> ExportedProgram:
    """A new ExportedProgram around ``graph``: signature and module call graph names follow the new nodes.

    ``renamed`` maps old node names to the names of the new nodes that stand for them; placeholders keep
    their names (the new graph creates them first, in the old order). The ExportedProgram constructor
    validates graph against signature, the check every rewritten program needs.
    """
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    old_in = ep.graph_signature.input_specs
    if len(placeholders) != len(old_in):
        raise RuntimeError(f"rewrite changed the number of inputs ({len(old_in)} -> {len(placeholders)})")
    input_specs = [
        InputSpec(s.kind, _renamed_arg(s.arg, p.name), s.target, s.persistent)
        for s, p in zip(old_in, placeholders)
    ]
    outputs = list(graph.output_node().args[0])
    old_out = ep.graph_signature.output_specs
    if len(outputs) != len(old_out):
        raise RuntimeError(f"rewrite changed the number of outputs ({len(old_out)} -> {len(outputs)})")
    output_specs = [
        OutputSpec(s.kind, _renamed_arg(s.arg, o.name if isinstance(o, Node) else None), s.target)
        for s, o in zip(old_out, outputs)
    ]
    module_call_graph = copy.deepcopy(ep.module_call_graph)
    for entry in module_call_graph:
        if entry.signature is None:
            continue
        for arg in [*entry.signature.inputs, *entry.signature.outputs]:
            name = getattr(arg, "name", None)
            if name in renamed:
                arg.name = renamed[name]
    new_ep = ExportedProgram(
        root=_private_root(ep.graph_module, graph),
        graph=graph,
        graph_signature=ExportGraphSignature(input_specs=input_specs, output_specs=output_specs),
        state_dict=state_dict,
        range_constraints=copy.copy(ep.range_constraints),
        module_call_graph=module_call_graph,
        example_inputs=ep.example_inputs,
        constants=constants,
        verifiers=list(ep.verifiers),
    )
    new_ep.graph_module.meta.update(ep.graph_module.meta)
    return new_ep


def private_copy(gm: GraphModule) -> GraphModule:
    """A GraphModule with its own graph and own copies of nested sub-graphs (tensors and meta values shared)."""
    graph = copy.deepcopy(gm.graph)  # Graph.__deepcopy__ copies nodes, shallow-copying each node's meta
    new = GraphModule(_private_root(gm, graph), graph, class_name=type(gm).__name__)
    new.meta.update(gm.meta)
    return new


def _private_root(old_root: GraphModule, graph: Graph) -> torch.nn.Module:
    """The attributes ``graph`` reads, with HOP bodies copied: a later in-place pass on the new program
    must never reach into the caller's program through a shared sub-graph."""
    holder = torch.nn.Module()
    for node in graph.nodes:
        if node.op == "get_attr":
            attr = fetch_attr(old_root, node.target)
            _set_attr(holder, node.target, private_copy(attr) if isinstance(attr, GraphModule) else attr)
    return holder


def _renamed_arg(arg: Any, name: Optional[str]) -> Any:
    if isinstance(arg, (ConstantArgument, CustomObjArgument)) or name is None or not hasattr(arg, "name"):
        return arg
    return type(arg)(name=name)
