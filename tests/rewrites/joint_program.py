"""A forward-backward (joint) version of an exported program, for the rewrites that must treat one differently."""

from __future__ import annotations

import copy

from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind, OutputSpec


def as_joint(ep: ExportedProgram) -> ExportedProgram:
    """The same graph declared a forward-backward program: its first output a loss, which grad mode and detach
    matter to."""
    signature = copy.deepcopy(ep.graph_signature)
    first = signature.output_specs[0]
    signature.output_specs[0] = OutputSpec(kind=OutputKind.LOSS_OUTPUT, arg=first.arg, target=None)
    return ExportedProgram(root=ep.graph_module, graph=ep.graph, graph_signature=signature, state_dict=ep.state_dict,
                           range_constraints=ep.range_constraints, module_call_graph=ep.module_call_graph,
                           constants=ep.constants)
