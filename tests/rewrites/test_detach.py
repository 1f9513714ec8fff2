"""replace_detach_with_alias: numerics against eager, no detach_copy reaches Inductor, joint programs declined."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.export import export

from inductor_probe import inductor_input
from joint_program import as_joint
from zoo.core.errors import ZooError
from zoo.rewrites import replace_detach_with_alias

aten = torch.ops.aten


def targets(ep):
    return [n.target for n in ep.graph.nodes if n.op == "call_function"]


def is_fallback(op) -> bool:
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.lowering import lowerings

    return op not in lowerings and op not in select_decomp_table() and \
        not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")


class Detaching(nn.Module):
    def forward(self, x):
        return (x * 2).detach() + 1, x.detach()


@pytest.fixture(scope="module")
def detaching():
    return export(Detaching(), (torch.randn(3, 4),))


def test_detach_becomes_alias_and_matches_eager(detaching):
    result = replace_detach_with_alias(detaching)
    assert result.declined is None and result.changed and result.counts == {"aten.detach.default": 2}
    assert aten.detach.default not in targets(result.program)
    assert targets(result.program).count(aten.alias.default) == 2
    assert aten.detach.default in targets(detaching)  # the caller's program is untouched
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    got = result.program.module()(x)
    assert torch.equal(got[0], x * 2 + 1) and torch.equal(got[1], x)


def test_no_detach_copy_reaches_inductor(detaching):
    # Without the rewrite: the H200 failure, "missing fallback kernels: aten::detach_copy".
    assert is_fallback(aten.detach_copy.default)
    assert aten.detach_copy.default in targets(inductor_input(detaching))
    lowered = targets(inductor_input(replace_detach_with_alias(detaching).program))
    assert aten.detach_copy.default not in lowered
    assert aten.alias_copy.default in lowered and not is_fallback(aten.alias_copy.default)


def test_program_without_detach_is_unchanged():
    class Plain(nn.Module):
        def forward(self, x):
            return x.view(-1) * 3

    ep = export(Plain(), (torch.randn(2, 2),))
    result = replace_detach_with_alias(ep)
    assert result.program is ep and not result.changed and result.declined is None


def test_joint_program_is_declined_untouched(detaching):
    # A forward-backward program carries a loss output; there detach decides which gradients flow.
    joint = as_joint(detaching)
    before = str(joint.graph)
    result = replace_detach_with_alias(joint)
    assert result.program is joint and not result.changed
    assert "aten.detach.default" in result.declined and "test_detach.py" in result.declined
    assert "gradient" in result.declined
    assert str(joint.graph) == before


def test_not_a_program_is_a_zoo_error():
    with pytest.raises(ZooError, match="ExportedProgram"):
        replace_detach_with_alias(Detaching())
