"""make_outputs_safe: every user output contiguous and in memory of its own; values as eager; nothing else moved."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.export import Dim, export

from zoo.rewrites import make_outputs_safe

aten = torch.ops.aten


class Unsafe(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 16))
        self.register_buffer("table", torch.randn(4, 16))

    def forward(self, x):
        y = x * 2 + self.weight
        return (
            y.view(4, 1, 16)[:, :, :14],  # strided view
            y.t(),  # transpose
            y,  # returned ...
            y,  # ... twice
            x,  # an input as is
            y.view(-1),  # contiguous, but over y's memory
            self.weight,  # a parameter
            self.table[1:3],  # a contiguous view of a buffer
            y + 1,  # fresh and contiguous: stays as it is
            y.split(2)[1],  # contiguous, but a piece of y
        )


def storages_distinct(tensors):
    ptrs = [t.untyped_storage().data_ptr() for t in tensors]
    return len(set(ptrs)) == len(ptrs)


@pytest.fixture(scope="module")
def unsafe():
    torch.manual_seed(0)
    module = Unsafe()
    with torch.no_grad():
        return module, export(module, (torch.randn(4, 16),))


def test_outputs_become_contiguous_distinct_and_equal_to_eager(unsafe):
    module, ep = unsafe
    before = str(ep.graph)
    result = make_outputs_safe(ep)
    assert result.declined is None and result.changed and result.program is not ep
    assert result.counts == {"aten.clone.default": 8}  # all but outputs 2 and 8
    reasons = dict(note.split(" ", 2)[1:] for note in result.notes)
    assert "is not contiguous" in reasons["0"] and "is not contiguous" in reasons["1"]
    assert "shares memory with output 2" in reasons["3"] and "shares memory with output 2" in reasons["5"]
    assert "program input x" in reasons["4"] and "program input p_weight" in reasons["6"]
    assert "program input b_table" in reasons["7"] and "shares memory with output 2" in reasons["9"]
    assert "2" not in reasons and "8" not in reasons  # the first y and y + 1 are left as they are
    assert str(ep.graph) == before

    torch.manual_seed(1)
    x = torch.randn(4, 16)
    with torch.no_grad():
        want, got = module(x), result.program.module()(x)
    assert all(torch.equal(w, g) for w, g in zip(want, got))
    assert all(g.is_contiguous() for g in got)
    params = [result.program.state_dict["weight"], result.program.constants.get("table",
              result.program.state_dict.get("table"))]
    assert storages_distinct(list(got) + [x] + params)


def test_output_specs_follow_the_clones(unsafe):
    _, ep = unsafe
    program = make_outputs_safe(ep).program
    returned = [n.name for n in program.graph.output_node().args[0]]
    assert [spec.arg.name for spec in program.graph_signature.output_specs] == returned
    clones = [n for n in program.graph.nodes if n.target is aten.clone.default]
    assert all(n.kwargs["memory_format"] == torch.contiguous_format for n in clones)


def test_strided_output_with_a_dynamic_dimension():
    class Tail(nn.Module):
        def forward(self, x):
            return (x + 1)[:, 1:]

    ep = export(Tail(), (torch.randn(3, 6),), dynamic_shapes=({0: Dim("b", min=2, max=8)},))
    result = make_outputs_safe(ep)
    assert result.changed
    for rows in (2, 5):
        x = torch.randn(rows, 6)
        got = result.program.module()(x)
        assert got.is_contiguous() and torch.equal(got, (x + 1)[:, 1:])


def test_contiguous_distinct_outputs_are_unchanged():
    class Safe(nn.Module):
        def forward(self, x):
            y = x @ x.t()
            return y, (x * 3).view(-1), y.sum(0)

    ep = export(Safe(), (torch.randn(3, 4),))
    result = make_outputs_safe(ep)
    assert result.program is ep and not result.changed and result.declined is None and result.notes == []
