"""zoo.export.lower.constant_plan: with one constant table for every method, two methods lowered apart by ExecuTorch's AOTI
backend get byte-identical weight blobs, and the assembled .ptd holds the shared weights once.

The compile test lowers through AotiBackend.preprocess with the device set to the CPU
(tests/fixtures/aoti_cpu_probe.py), in worker processes, and runs the shipped .so files with the blob from
the assembled .ptd through torch's AOTI CPU runner, against eager PyTorch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from zoo.contract import artifact
from zoo.export.lower import constant_plan
from zoo.export.lower import workers as lowering_workers
from zoo.runtimes.aoti import promote_libtorch_global
from zoo.core.errors import LoweringError

FIXTURES = Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
from aoti_cpu_probe import PTD_NAME  # noqa: E402

DIM = 64
X = torch.randn(3, DIM, generator=torch.Generator().manual_seed(2))


class Unit(nn.Module):
    """``shared`` both methods read; ``head_a`` only ``a``; ``head_b`` only ``b``; ``scale`` a buffer ``a`` reads;
    ``table`` a plain tensor attribute both read (a lifted constant, which ExecuTorch hands to Inductor under a
    positional name); ``tiny`` a 4-element parameter (Inductor inlines it into the code); ``unused`` no method
    reads."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head_a = nn.Linear(DIM, DIM)
        self.shared = nn.Sequential(nn.Linear(DIM, DIM), nn.GELU(), nn.Linear(DIM, DIM))
        self.head_b = nn.Linear(DIM, DIM, bias=False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM))
        self.table = torch.linspace(-1.0, 1.0, DIM)
        self.tiny = nn.Parameter(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        self.unused = nn.Parameter(torch.randn(DIM))


class A(nn.Module):
    def __init__(self, unit):
        super().__init__()
        self.u = unit

    def forward(self, x):
        return self.u.shared(self.u.head_a(x)) * self.u.scale + self.u.table


class B(nn.Module):
    def __init__(self, unit):
        super().__init__()
        self.u = unit

    def forward(self, x):
        y = self.u.head_b(self.u.shared(x)) - self.u.table
        return y + self.u.tiny.repeat(DIM // 4)


def modules():
    unit = Unit()
    return {"a": A(unit), "b": B(unit)}


def programs():
    return {m: torch.export.export(mod, (X,)) for m, mod in modules().items()}


# --- the plan, without compiling ------------------------------------------------------------------------------


def test_plan_is_every_constant_a_method_reads_in_first_read_order():
    plan = constant_plan.plan_constants(programs())
    assert plan.fqns() == ["u.head_a.weight", "u.head_a.bias", "u.shared.0.weight", "u.shared.0.bias",
                           "u.shared.2.weight", "u.shared.2.bias", "u.scale", "u.table", "u.tiny",
                           "u.head_b.weight"]
    by = {c.fqn: c for c in plan.constants}
    assert by["u.shared.0.weight"].methods == ["a", "b"] and by["u.head_b.weight"].methods == ["b"]
    assert by["u.head_a.weight"].nbytes == DIM * DIM * 4 and by["u.scale"].kind == "buffer"
    assert by["u.table"].kind == "constant" and by["u.table"].methods == ["a", "b"]
    assert plan.private == {}
    assert constant_plan.ConstantPlan.from_dict(plan.as_dict()) == plan


class Counter(nn.Module):
    def __init__(self, unit, step):
        super().__init__()
        self.u, self.step = unit, step

    def forward(self, x):
        self.u.scale.add_(self.step)
        return self.u.shared(x) * self.u.scale


def test_conflicting_values_stay_private_and_a_mutated_buffer_is_planned_as_state():
    """A buffer a method writes is the unit's state, one tensor for every method that holds it (as in eager
    PyTorch): planned like a weight, so that a runtime sharing constants by name shares it; it stays private only
    where its values differ, as any constant does."""
    unit, other = Unit(), Unit()
    with torch.no_grad():
        other.head_a.weight.mul_(2.0)
    progs = {"a": torch.export.export(A(unit), (X,)), "count": torch.export.export(Counter(unit, 1.0), (X,)),
             "a2": torch.export.export(A(other), (X,))}
    plan = constant_plan.plan_constants(progs)
    by = {c.fqn: c for c in plan.constants}
    assert by["u.scale"].mutated_by == ["count"] and by["u.scale"].methods == ["a", "count", "a2"]
    assert by["u.shared.0.weight"].mutated_by == []
    assert "u.head_a.weight" not in plan.fqns() and "different values" in plan.private["u.head_a.weight"]
    assert "u.shared.0.weight" in plan.fqns() and "u.head_a.bias" in plan.fqns()
    with torch.no_grad():
        other.scale.add_(1.0)  # the state starts elsewhere in a2: not one state, so not shared
    progs["a2"] = torch.export.export(A(other), (X,))
    assert "different values" in constant_plan.plan_constants(progs).private["u.scale"]


def test_values_come_from_each_methods_program_and_a_missing_one_is_an_error():
    progs = programs()
    plan = constant_plan.plan_constants(progs)
    values = constant_plan.plan_values(progs["b"], plan)  # b holds head_a although it never reads it
    assert torch.equal(values["u.head_a.weight"], modules()["a"].u.head_a.weight)
    alone = torch.export.export(nn.Linear(DIM, DIM), (X,))
    with pytest.raises(LoweringError, match="lacks 10 constant"):
        constant_plan.plan_values(alone, plan)


# --- compiled: identical blobs, one copy in the .ptd -----------------------------------------------------------


@pytest.fixture(scope="module")
def lowered(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    progs = programs()
    plan = constant_plan.plan_constants(progs)
    jobs = []
    for method, ep in progs.items():
        path = root / f"rewritten.{method}.pt2"
        torch.export.save(ep, path)
        jobs.append(lowering_workers.MethodJob(method, path, {"constant_plan": plan.as_dict()}))
    assembled, parts = lowering_workers.lower_and_assemble(
        jobs, "aoti_cpu_probe:lower_probe", root / "work", root / "out", max_workers=2,
        env={"PYTHONPATH": str(FIXTURES)}, say=lambda line: None)
    files = artifact.extract_method_files(assembled.pte, root / "out" / PTD_NAME, root / "out" / "so")
    return {"plan": plan, "assembled": assembled, "parts": parts, "files": files}


def _padded(tensor: torch.Tensor) -> bytes:
    """A constant as a CPU AOTI blob holds it: its storage, padded to 64 bytes (codecache.py ``_to_bytes``)."""
    data = tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()
    return data + b"\0" * (-len(data) % 64)


@pytest.mark.e2e  # a CPU lowering of the toy methods (~55 s on 2 cores); tests/test_lowering_orchestration.py keeps the plan's groups and the .ptd in the default run
def test_each_method_so_carries_the_plan_in_plan_order(lowered):
    plan = lowered["plan"]
    for method, part in lowered["parts"].items():
        (table,) = part.record["constant_tables"]  # one AOT compile per method
        assert [row["fqn"] for row in table] == plan.fqns(), method
        assert all(row["planned"] for row in table)
    added = {row["fqn"] for row in lowered["parts"]["b"].record["constant_tables"][0] if row["added"]}
    assert {"u.head_a.weight", "u.head_a.bias", "u.scale"} <= added  # b's graph never reads them
    for method, part in lowered["parts"].items():  # the lifted constant reaches Inductor under another name
        (table,) = part.record["constant_tables"]
        assert [(row["name"].startswith("_tensor_constant"), row["adopted"]) for row in table
                if row["fqn"] == "u.table"] == [(True, True)], method


@pytest.mark.e2e  # a CPU lowering of the toy methods (~55 s on 2 cores); tests/test_lowering_orchestration.py keeps the plan's groups and the .ptd in the default run
def test_weight_blobs_are_the_plan_tensors_byte_for_byte_and_identical(lowered):
    unit = modules()["a"].u
    state = dict(unit.named_parameters(prefix="u")) | dict(unit.named_buffers(prefix="u")) | {"u.table": unit.table}
    expected = b"".join(_padded(state[fqn]) for fqn in lowered["plan"].fqns())
    for method, entry in lowered["files"].items():
        assert Path(entry["weights"]).read_bytes() == expected, method


@pytest.mark.e2e  # a CPU lowering of the toy methods (~55 s on 2 cores); tests/test_lowering_orchestration.py keeps the plan's groups and the .ptd in the default run
def test_the_ptd_holds_the_shared_weights_once(lowered):
    summary = lowered["assembled"].data_files[PTD_NAME]
    assert summary.segments == [["a_weights_blob", "b_weights_blob"]]
    blob = summary.entries["a_weights_blob"]
    assert summary.shared_bytes == blob
    used = sum(c.nbytes for c in lowered["plan"].constants)  # the parameter bytes the two methods read
    assert summary.file_bytes <= 1.05 * used


@pytest.mark.e2e  # a CPU lowering of the toy methods (~55 s on 2 cores); tests/test_lowering_orchestration.py keeps the plan's groups and the .ptd in the default run
def test_each_shipped_so_with_the_shared_blob_computes_what_eager_computes(lowered):
    promote_libtorch_global()
    eager = modules()
    for method, entry in lowered["files"].items():
        runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(entry["so"]), 1)
        runner.update_constant_buffer_from_blob(str(entry["weights"]))
        assert set(runner.get_constant_names_to_original_fqns().values()) == set(lowered["plan"].fqns())
        with torch.no_grad():
            torch.testing.assert_close(runner.run([X])[0], eager[method](X))


@pytest.mark.e2e  # a CPU lowering of the toy methods (~55 s on 2 cores); tests/test_lowering_orchestration.py keeps the plan's groups and the .ptd in the default run
def test_one_method_extracted_alone_is_the_same_bytes(lowered, tmp_path):
    """``methods``: the method's .so and weights, byte for byte those of the full extraction, and nothing else."""
    assembled = lowered["assembled"]
    ptd = Path(assembled.pte).parent / PTD_NAME
    alone = artifact.extract_method_files(assembled.pte, ptd, tmp_path, methods=["b"])
    assert list(alone) == ["b"]
    full = lowered["files"]["b"]
    assert alone["b"]["so"].read_bytes() == Path(full["so"]).read_bytes()
    assert alone["b"]["weights"].read_bytes() == Path(full["weights"]).read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != artifact.EXTRACTED_JSON) == sorted(
        [alone["b"]["so"].name, alone["b"]["weights"].name])


def test_methods_sharing_state_are_one_group_with_the_table_applied_whatever_it_costs():
    """Two methods that read mostly different weights but hold one written buffer (LingBot-VA's DiT steps at a
    tiny size, with the pool in the "buffer" layout): one group, and its table applied past the memory limit,
    since ExecuTorch shares a method's constants, the state included, only for methods of one table."""
    reads = {"write": {"pool": 64, "w_write": 4000}, "read": {"pool": 64, "w_read": 4000}, "other": {"w_o": 10}}
    assert constant_plan.sharing_groups(reads) == [["write"], ["read"], ["other"]]
    assert constant_plan.sharing_groups(reads, state=["pool"]) == [["write", "read"], ["other"]]
    pool = constant_plan.PlannedConstant("pool", "buffer", "float32", [16], 64, ["write", "read"], ["write"])
    weights = [constant_plan.PlannedConstant(f"w_{m}", "parameter", "float32", [1000], 4000, [m])
               for m in ("write", "read")]
    decision = constant_plan.plan_decision(constant_plan.ConstantPlan([pool, *weights]), 2)
    assert decision["applied"] and decision["gpu_growth"] > constant_plan.PLAN_MAX_GPU_GROWTH
    assert "state the methods share (pool)" in decision["why"]
    alone = constant_plan.plan_decision(constant_plan.ConstantPlan(weights), 2)  # the same without the state
    assert not alone["applied"] and "not applied" in alone["why"]
