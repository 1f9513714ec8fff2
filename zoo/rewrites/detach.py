"""detach -> alias, so that no ``detach_copy`` reaches AOTInductor.

    detach(x)       ->  alias(x)
    detach_copy(x)  ->  alias_copy(x)

The same values in an inference program; why, and what declines: docs/ARCHITECTURE.md, "Rewrites".
"""

from __future__ import annotations

from collections import Counter
from typing import List

from torch.export import ExportedProgram
from torch.fx import Node

from zoo.rewrites.graph import (aten, calls, copy_program, decline_on_failure, finish, graph_modules_under,
                    is_inference_program, op_name, require_program)
from zoo.rewrites.registry import rewrite
from zoo.rewrites.result import RewriteResult, source_line

NAME = "replace_detach_with_alias"

_REPLACEMENTS = {
    aten.detach.default: aten.alias.default,
    aten.detach_copy.default: aten.alias_copy.default,
}


def _match(ep: ExportedProgram) -> List[Node]:
    return [n for gm in graph_modules_under(ep.graph_module) for n in calls(gm.graph, _REPLACEMENTS)]


def _rewrite(nodes: List[Node]) -> Counter:
    counts: Counter = Counter()
    for node in nodes:
        counts[op_name(node.target)] += 1
        # Same argument, same value meta: detach and alias are both views of x with x's strides.
        node.target = _REPLACEMENTS[node.target]
    return counts


def _rewritten_copy(ep: ExportedProgram) -> RewriteResult:
    work = copy_program(ep)
    counts = _rewrite(_match(work))
    return RewriteResult.rewritten(NAME, finish(work), counts)


@rewrite(NAME)
def replace_detach_with_alias(ep: ExportedProgram) -> RewriteResult:
    require_program(ep, NAME)
    found = _match(ep)
    if not found:
        return RewriteResult.unchanged(NAME, ep)
    if not is_inference_program(ep):
        node = found[0]
        return RewriteResult.decline(
            NAME, ep,
            f"{op_name(node.target)} at {source_line(node)}: the program has loss or gradient outputs, "
            "where detach decides which gradients flow; export the forward (inference) program instead",
        )
    return decline_on_failure(NAME, ep, lambda: _rewritten_copy(ep))
