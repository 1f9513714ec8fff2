"""The rewritten program. A rewrite never edits the caller's program: it matches on the program it is given, then

* edits a private copy (``copy_program``) in place and hands it back through ``finish``: for rewrites that swap,
  insert or inline nodes (detach, fused SDPA, view copies, autocast regions, output safety); or
* builds a new ``torch.fx.Graph`` beside the old one node by node (``GraphBuilder``), with new state tensors where
  it replaces them (``replace_state``), wrapped by ``rebuild_program``: for rewrites that change dtypes or shapes
  (complex to real, float64 narrowing and splitting).
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Optional

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    ConstantArgument,
    CustomObjArgument,
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputSpec,
)
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_arg

from zoo.rewrites.graph.nodes import fetch_attr, graph_modules_under, written_args
from zoo.rewrites.graph.values import VALUE_META_KEYS, node_value, set_value
from zoo.rewrites.result import source_line

# Weights and constants that are not replaced are shared, not copied (a 5 B-parameter program must not be
# duplicated in memory); graphs, including the sub-graphs of higher-order ops, are private to the new program.


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


def _set_attr(root: torch.nn.Module, target: str, value: Any) -> None:
    *path, last = target.split(".")
    obj = root
    for part in path:
        if not hasattr(obj, part):
            setattr(obj, part, torch.nn.Module())
        obj = getattr(obj, part)
    setattr(obj, last, value)
