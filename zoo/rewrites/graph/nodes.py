"""Naming, finding and reading the nodes of an FX graph, and declining a program a rewrite cannot handle."""

from __future__ import annotations

import contextlib
import operator
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_arg

from zoo.core.errors import ExportError
from zoo.rewrites.result import RewriteResult, source_line

aten = torch.ops.aten

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
    """Raised inside a rewrite when one node cannot be handled; the rewrite then declines the whole program.

    No per-node failure is ever skipped: ``decline_on_failure`` hands back the caller's program, untouched,
    with the reason."""

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
