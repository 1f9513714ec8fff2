"""detach -> alias, so that no ``detach_copy`` reaches AOTInductor.

    detach(x)       ->  alias(x)
    detach_copy(x)  ->  alias_copy(x)

Both sides return x's values; they differ only in whether autograd tracks the result. ExecuTorch's CUDA
backend runs the forward pass only, so in an inference program the two are the same computation.

Why: ``to_edge`` functionalises ``detach`` into ``detach_copy``, for which Inductor (torch 2.11) has neither a
lowering nor a decomposition; AOTInductor then emits an ATen fallback that executorch 1.2.0's CUDA backend
refuses after the whole compile ("missing fallback kernels: aten::detach_copy", seen on an H200 for
``(x * 2).detach() + 1``). ``alias`` becomes ``alias_copy``, which Inductor decomposes. The node is kept
(rather than dropped) so that an output stays a node of its own: ``x`` and ``x.detach()`` both returned
remain two outputs, which ``make_outputs_safe`` then makes distinct.

A joint forward-backward program (one with a loss or gradient outputs) is declined: there detach decides
which gradients flow, and an alias would change them.
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
