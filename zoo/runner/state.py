"""State a run's methods keep inside themselves (mutable buffers, e.g. LingBot-VA's KV pool in the "buffer"
layout), shared by name across the methods of one loaded run.

A unit's methods are modules of one policy: in eager PyTorch, two methods that hold a buffer under one fully
qualified name hold one tensor, and what one method writes into it the other reads (the KV pool that
``video_step`` writes and ``action_step`` attends over). Exported, each method's program holds its own copy of the
buffer; each backend gives them one copy again, by name: the eager backend with ``SharedBuffers`` (here), torch's
AOTI runner with ``zoo.runtimes.aoti.SharedConstants``, ExecuTorch's runtime with its weight sharing across
methods (docs/runtime.md, "State on the GPU").
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Mapping, Optional, Set

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import Node

from zoo.core.errors import RunnerError
from zoo.runtimes.aoti import separate_copies


def _aliases_written(node: Node) -> bool:
    """Whether ``node`` or a view of it (followed through view ops) is written in place by some op."""
    for user in node.users:
        schema = getattr(user.target, "_schema", None)
        if schema is None:
            continue
        for i, argument in enumerate(schema.arguments):
            given = user.kwargs.get(argument.name, user.args[i] if i < len(user.args) else None)
            if given is not node or argument.alias_info is None:
                continue
            if argument.alias_info.is_write:
                return True
            # A view (``select``, ``transpose``, ...): its output aliases the argument, so a write to it is one
            # to the buffer.
            if any(r.alias_info is not None for r in schema.returns) and _aliases_written(user):
                return True
    return False


def mutated_buffers(program: ExportedProgram) -> Set[str]:
    """The names of the buffers ``program`` writes: in place in export IR (through views too), or as a
    functionalised mutation (``buffers_to_mutate``)."""
    written = set(program.graph_signature.buffers_to_mutate.values())
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    for spec in program.graph_signature.input_specs:
        node = placeholders.get(getattr(spec.arg, "name", None))
        if spec.kind == InputKind.BUFFER and node is not None and _aliases_written(node):
            written.add(spec.target)
    return written


def _set_buffer(module: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    (module.get_submodule(owner) if owner else module).register_buffer(leaf, tensor)


class SharedBuffers:
    """One tensor per mutable buffer name across the modules of a run's loaded programs.

    ``adopt(module, program)``, as each method's program is loaded (in any order): a buffer some loaded program
    writes, and that a module loaded earlier holds under the same name, becomes that very tensor in ``module``.
    A buffer no program writes stays each module's own (a constant: sharing it would only save memory)."""

    def __init__(self) -> None:
        self.tensors: Dict[str, torch.Tensor] = {}  # name -> the first loaded module's buffer of that name
        self.holders: Dict[str, List[torch.nn.Module]] = {}  # name -> the modules holding it, loading order
        self.written: Set[str] = set()  # names some loaded program writes

    def adopt(self, module: torch.nn.Module, program: Optional[ExportedProgram]) -> None:
        newly_written = (mutated_buffers(program) if program is not None else set()) - self.written
        self.written |= newly_written
        for name, tensor in module.named_buffers():
            first = self.tensors.setdefault(name, tensor)
            self.holders.setdefault(name, []).append(module)
            if first is not tensor and name in self.written:
                self._point(module, name, first)
        # A buffer written first by this program and read by modules loaded before it: theirs become one too.
        for name in newly_written:
            for holder in self.holders.get(name, []):
                self._point(holder, name, self.tensors[name])

    def module_of(self, program: ExportedProgram) -> torch.nn.Module:
        """``program`` as a module, adopted: how every loader of a run's programs makes one."""
        module = program.module()
        self.adopt(module, program)
        return module

    def _point(self, module: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
        own = module.get_buffer(name)
        if own is tensor:
            return
        if own.shape != tensor.shape or own.dtype != tensor.dtype:
            raise RunnerError(f"two methods hold buffer {name!r} with different shapes or dtypes "
                              f"({tuple(own.shape)} {own.dtype} and {tuple(tensor.shape)} {tensor.dtype}), so "
                              "they cannot share it", "export every method from the same unit")
        _set_buffer(module, name, tensor)

    def unshared(self, modules: Mapping[str, torch.nn.Module], names: Iterable[str]) -> Dict[str, str]:
        """Of ``names``, each one the ``modules`` do not all hold as one tensor: name -> why."""
        return separate_copies({method: dict(module.named_buffers()) for method, module in modules.items()}, names,
                               "buffer")
