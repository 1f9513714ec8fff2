"""A two-method unit sharing weights and a mutated buffer, its call sequence and its eager outputs, and the
ExecuTorch program files written and run (zoo.export.lower.assemble, zoo.export.lower.workers)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from zoo.export.lower.assemble import ProgramPart

X = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))


class Unit(nn.Module):
    """A parameter both methods use (``shared``), one only ``a`` uses (``head``), a constant buffer both read
    (``scale``) and a buffer ``a`` mutates (``count``, kept with its initial value)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))
        self.register_buffer("count", torch.full((8,), 3.0))


class MethodA(nn.Module):
    def __init__(self, unit: Unit) -> None:
        super().__init__()
        self.u = unit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.u.count.add_(1.0)
        return self.u.head(torch.relu(self.u.shared(x)) * self.u.scale + self.u.count)


class MethodB(nn.Module):
    def __init__(self, unit: Unit) -> None:
        super().__init__()
        self.u = unit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.u.shared(x) - self.u.scale


def programs():
    unit = Unit()
    return {"a": torch.export.export(MethodA(unit), (X,)), "b": torch.export.export(MethodB(unit), (X,))}


def eager_calls(calls):
    """Eager outputs of a call sequence [(method, input)], on one unit (so ``count`` carries over)."""
    unit = Unit()
    methods = {"a": MethodA(unit), "b": MethodB(unit)}
    with torch.no_grad():
        return [methods[m](x) for m, x in calls]


CALLS = [("a", X), ("b", X), ("a", X * 2), ("b", X - 1)]


def write(manager, folder: Path, name: str) -> ProgramPart:
    folder.mkdir(parents=True, exist_ok=True)
    pte = folder / f"{name}.pte"
    pte.write_bytes(manager.buffer)
    manager.write_tensor_data_to_file(str(folder))
    return ProgramPart(label=name, pte=pte, data_files={p.name: p for p in sorted(folder.glob("*.ptd"))})


def run_calls(pte: Path, data_files, calls):
    from executorch.extension.pybindings.portable_lib import _load_for_executorch

    files = list(data_files)
    assert len(files) <= 1
    module = _load_for_executorch(str(pte), str(files[0])) if files else _load_for_executorch(str(pte))
    return [module.run_method(m, (x,))[0] for m, x in calls]
