"""One constant table for every method of a unit, so that their weight blobs are byte-identical and stored once.

Why and how: docs/ARCHITECTURE.md, "One constant table per group of methods".
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Sequence, Tuple

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from zoo.core.errors import LoweringError
from zoo.rewrites.graph import state_tensor, state_writer

_STATE_KINDS = {InputKind.PARAMETER: "parameter", InputKind.BUFFER: "buffer",
                InputKind.CONSTANT_TENSOR: "constant"}
# Two methods share a constant table when the weights both read are at least this share of the smaller one's
# (``sharing_groups``).
GROUP_MIN_SHARE = 0.5
# The shared constant plan makes every method's blob hold every shared constant: on a runtime where each method
# loads its own blob (ExecuTorch 1.2) that costs the other methods' own weights. It is used when that costs at
# most this much more GPU memory than the methods' own tables (LingBot-VA: +1.4%); methods with mostly
# separate weights are lowered with their own tables.
PLAN_MAX_GPU_GROWTH = 0.05


@dataclass
class PlannedConstant:
    fqn: str
    kind: str  # parameter, buffer or constant
    dtype: str
    shape: List[int]
    nbytes: int  # the storage's bytes: what the blob holds for it on a GPU
    methods: List[str]  # the methods whose graphs read it
    # the methods that write it in place (a buffer that is state, e.g. a KV pool in the "buffer" layout): its
    # value in the blob is the state's start, and a runtime that shares constants by name shares the state
    mutated_by: List[str] = field(default_factory=list)


@dataclass
class ConstantPlan:
    constants: List[PlannedConstant]
    private: Dict[str, str] = field(default_factory=dict)  # fqn -> why each method keeps its own

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.constants)

    @property
    def read_nbytes(self) -> int:
        """The planned bytes as the methods' own tables would carry them: each constant once per method that
        reads it (what the methods' blobs hold together without the plan)."""
        return sum(c.nbytes * len(c.methods) for c in self.constants)

    def gpu_growth(self, methods: int) -> float:
        """How much more GPU memory the plan costs on a runtime where every method loads its own blob (1.2):
        each of ``methods`` blobs holds the whole plan instead of what that method reads; 0.0 for no growth."""
        return methods * self.nbytes / self.read_nbytes - 1.0 if self.read_nbytes else 0.0

    def fqns(self) -> List[str]:
        return [c.fqn for c in self.constants]

    def as_dict(self) -> Dict[str, Any]:
        return {"constants": [asdict(c) for c in self.constants], "private": dict(self.private)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ConstantPlan":
        return cls(constants=[PlannedConstant(**c) for c in data["constants"]], private=dict(data.get("private", {})))


def _same_value(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a is b:
        return True
    if a.dtype != b.dtype or a.shape != b.shape or a.stride() != b.stride():
        return False
    if a.device == b.device and a.data_ptr() == b.data_ptr():
        return True
    return bool(torch.equal(a.detach().cpu(), b.detach().cpu()))


def plan_constants(programs: Mapping[str, ExportedProgram]) -> ConstantPlan:
    """The constants that every method's ``.so`` should carry, in one order: each constant some method's graph
    reads, in the order the methods (then their signatures) first read it; without names whose values differ
    between methods (those stay each method's own, listed in ``private``).

    A buffer a method writes in place is state, and it is planned like a weight: the methods of one unit that
    hold a buffer under one name hold one tensor in eager PyTorch (LingBot-VA's KV pool in the "buffer" layout),
    and a runtime that shares constants by name (ExecuTorch's ``weight_sharing_across_methods``, zoo.runner's
    backends) gives them one copy only when their constant tables are the same."""
    mutated = _mutated_by(programs)
    planned: Dict[str, PlannedConstant] = {}
    values: Dict[str, torch.Tensor] = {}
    private: Dict[str, str] = {}
    for method, program in programs.items():
        for fqn, kind, value in _read_state(program):
            if fqn in private:
                continue
            if fqn not in planned:
                planned[fqn] = PlannedConstant(fqn=fqn, kind=kind, dtype=str(value.dtype).replace("torch.", ""),
                                               shape=list(value.shape), nbytes=_storage_bytes(value),
                                               methods=[method], mutated_by=mutated.get(fqn, []))
                values[fqn] = value
            elif _same_value(values[fqn], value):
                planned[fqn].methods.append(method)
            else:
                private[fqn] = f"{planned[fqn].methods[0]} and {method} hold different values under this name"
                del planned[fqn], values[fqn]
    # Every method's .so carries the whole plan, so every program must hold each planned tensor, with the same
    # value (methods exported from one unit module hold all of its parameters and buffers, read or not).
    for method, program in programs.items():
        held = {spec.target: spec for spec in program.graph_signature.input_specs if spec.kind in _STATE_KINDS}
        for fqn, entry in list(planned.items()):
            if method in entry.methods:
                continue
            value = state_tensor(program, held[fqn]) if fqn in held else None
            if not isinstance(value, torch.Tensor):
                private[fqn] = f"{method}'s program does not hold it (not exported from the same unit module)"
            elif not _same_value(values[fqn], value):
                private[fqn] = f"{entry.methods[0]} and {method} hold different values under this name"
            else:
                continue
            del planned[fqn], values[fqn]
    return ConstantPlan(constants=list(planned.values()), private=private)


def written_state(programs: Mapping[str, ExportedProgram]) -> List[str]:
    """The state tensors (buffers) some of ``programs`` write in place, by name."""
    return sorted(_mutated_by(programs))


def _mutated_by(programs: Mapping[str, ExportedProgram]) -> Dict[str, List[str]]:
    """Each state tensor some method writes in place: its name -> the methods that write it."""
    mutated: Dict[str, List[str]] = {}
    for method, program in programs.items():
        placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
        for spec in program.graph_signature.input_specs:
            node = placeholders.get(getattr(spec.arg, "name", None))
            if spec.kind in _STATE_KINDS and node is not None and state_writer(program, spec, node) is not None:
                mutated.setdefault(spec.target, []).append(method)
    return mutated


def _storage_bytes(value: torch.Tensor) -> int:
    """What a GPU blob holds for a constant: its whole storage."""
    return int(value.untyped_storage().nbytes())


def _read_state(program: ExportedProgram) -> Iterator[Tuple[str, str, torch.Tensor]]:
    """(name, kind, tensor) of each state tensor (parameter, buffer, lifted constant) the method's graph reads,
    in signature order."""
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    for spec in program.graph_signature.input_specs:
        kind = _STATE_KINDS.get(spec.kind)
        node = placeholders.get(getattr(spec.arg, "name", None))
        if kind is None or node is None or not node.users or spec.target is None:
            continue
        value = state_tensor(program, spec)
        if isinstance(value, torch.Tensor):
            yield spec.target, kind, value


def read_constants(program: ExportedProgram) -> Dict[str, int]:
    """The state constants a method's graph reads: name -> the bytes of its storage, as
    ``PlannedConstant.nbytes`` counts them."""
    return {fqn: _storage_bytes(value) for fqn, _, value in _read_state(program)}


def sharing_groups(reads: Mapping[str, Mapping[str, int]], min_share: float = GROUP_MIN_SHARE,
                   state: Iterable[str] = ()) -> List[List[str]]:
    """The methods (``reads``: each method's ``read_constants``) in groups that each get one constant table.

    Two methods are linked when the constants both read, by name, make up at least ``min_share`` of the bytes
    the smaller of the two reads, or when both read a buffer of ``state`` (a buffer some method writes: its one
    copy across methods needs one table, see ``plan_decision``); a group is a set of linked methods
    (transitively), in the methods' order.
    One table for a whole unit would make every method's ``.so`` carry every other method's weights: LingBot-VA's
    streaming VAE encodes and its transformer steps read disjoint weights, so with one table for all four methods
    the plan does not pay, and the transformer steps lost their shared copy too. Grouped, the two steps share
    one table (~10 GB, stored once) and the two encodes another. ``plan_constants`` then checks the values
    within each group."""
    methods = list(reads)
    parent = {m: m for m in methods}

    def root(m: str) -> str:
        while parent[m] != m:
            m = parent[m]
        return m

    totals = {m: sum(reads[m].values()) for m in methods}
    state = set(state)
    for i, a in enumerate(methods):
        for b in methods[i + 1:]:
            shared = sum(n for fqn, n in reads[a].items() if fqn in reads[b])
            smaller = min(totals[a], totals[b])
            linked = (smaller and shared >= min_share * smaller) or any(f in reads[b] for f in state & set(reads[a]))
            if linked and root(a) != root(b):
                parent[root(b)] = root(a)
    groups: Dict[str, List[str]] = {}
    for m in methods:
        groups.setdefault(root(m), []).append(m)
    return list(groups.values())


def plans_decision(plans: Sequence[Tuple[List[str], ConstantPlan]]) -> Dict[str, Any]:
    """``plan_decision`` for each group of methods (``constant_plan.sharing_groups``), and the whole: applied
    when some group's table is; ``bytes`` counts the constants the methods read, once per group."""
    groups = [{"methods": list(group), **plan_decision(plan, len(group))} for group, plan in plans]
    applied = [g for g in groups if g["applied"]]
    private: Dict[str, str] = {}
    for g in groups:  # once, for the whole
        private.update(g.pop("private"))
    if len(groups) == 1:
        why = groups[0]["why"]
    else:
        why = "; ".join(f"{' + '.join(g['methods'])}: {g['why']}" for g in groups)
    return {"applied": bool(applied), "groups": groups, "constants": sum(g["constants"] for g in applied),
            "bytes": sum(g["bytes"] for g in groups), "read_bytes": sum(g["read_bytes"] for g in groups),
            "private": private, "why": why}


def plan_decision(plan: ConstantPlan, methods: int) -> Dict[str, Any]:
    """Whether the methods get the shared constant table, and why (``PLAN_MAX_GPU_GROWTH``).

    A table with state several methods hold (a buffer one of them writes) is applied whatever it costs: ExecuTorch's
    CUDA backend shares a method's constants, that state included, only when every one of them is on the GPU
    already, that is, only for methods of one table; without it each method would keep its own copy of the state."""
    growth = plan.gpu_growth(methods)
    record = {"applied": False, "constants": len(plan.constants), "bytes": plan.nbytes,
              "read_bytes": plan.read_nbytes, "gpu_growth": round(growth, 4), "private": dict(plan.private)}
    state = [c.fqn for c in plan.constants if c.mutated_by and len(c.methods) > 1]
    if methods < 2 or not plan.constants:
        record["why"] = "one method: nothing to share" if methods < 2 else "no constant is shared"
    elif state:
        record["applied"] = True
        record["why"] = (f"{len(plan.constants)} constants, {plan.nbytes / 2**20:.1f} MiB in every method's .so, "
                         f"applied for the state the methods share ({', '.join(state[:4])}"
                         f"{', ...' if len(state) > 4 else ''}) whatever it costs ({growth:+.1%} GPU memory on "
                         "runtimes that load each method's blob)")
    elif growth > PLAN_MAX_GPU_GROWTH:
        record["why"] = (f"not applied: the methods read mostly different weights; one table for all would take "
                         f"{growth:.0%} more GPU memory on runtimes that load each method's blob (limit "
                         f"{PLAN_MAX_GPU_GROWTH:.0%})")
    else:
        record["applied"] = True
        record["why"] = (f"{len(plan.constants)} constants, {plan.nbytes / 2**20:.1f} MiB in every method's .so "
                         f"({growth:+.1%} GPU memory on runtimes that load each method's blob)")
    return record


def plan_values(program: ExportedProgram, plan: ConstantPlan) -> Dict[str, torch.Tensor]:
    """The plan's tensors as one method's program holds them (it holds every state tensor of its unit, used or
    not). A plan constant the program lacks is an error: that method's ``.so`` could not carry it."""
    specs = {spec.target: spec for spec in program.graph_signature.input_specs if spec.kind in _STATE_KINDS}
    values: Dict[str, torch.Tensor] = {}
    missing = []
    for fqn in plan.fqns():
        value = state_tensor(program, specs[fqn]) if fqn in specs else None
        if isinstance(value, torch.Tensor):
            values[fqn] = value
        else:
            missing.append(fqn)
    if missing:
        raise LoweringError(f"the program lacks {len(missing)} constant(s) of the shared plan, e.g. {missing[:3]}",
                            "export every method from the same unit module, so that each program holds all of "
                            "its parameters and buffers")
    return values


# --- the Inductor hook -----------------------------------------------------------------------------------------


def _check_inductor() -> Any:
    from torch._inductor.graph import GraphLowering

    needed = ("codegen_with_cpp_wrapper", "allocate_non_dup_const_name")
    if not all(hasattr(GraphLowering, name) for name in needed):
        raise LoweringError(f"this torch's Inductor has no GraphLowering.{'/'.join(needed)} "
                            f"(torch {torch.__version__})",
                            "the shared constant plan is written for torch 2.11; lower without it "
                            "(every method then stores its own weights)")
    return GraphLowering


def _graph_device(graph: Any) -> torch.device:
    for value in graph.constants.values():
        if value.device.type != "cpu":
            return value.device
    if "cuda" in getattr(graph, "device_types", ()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def apply_plan(graph: Any, plan: ConstantPlan, values: Mapping[str, torch.Tensor]) -> List[Dict[str, Any]]:
    """Make ``graph.constants`` (an Inductor GraphLowering after ``run``) the plan's constants in plan order,
    adding those the graph does not read, then the graph's own others; returns the resulting table."""
    by_fqn = {graph.allocated_constant_name.get(name, name): name for name in graph.constants}
    planned_fqns = set(plan.fqns())
    adopted = set()
    for name, value in list(graph.constants.items()):
        if graph.allocated_constant_name.get(name, name) in planned_fqns:
            continue
        # A constant Inductor named by position (``_tensor_constant0``: ExecuTorch hands lifted constants over
        # under new names) that holds a planned constant's value stands for it: it takes the planned FQN, so
        # every method lists it under the same name, and no second copy is added.
        for entry in plan.constants:
            if entry.fqn not in by_fqn and _same_value(values[entry.fqn], value):
                graph.allocated_constant_name[name] = entry.fqn
                by_fqn[entry.fqn] = name
                adopted.add(name)
                break
    device = _graph_device(graph)
    added = set()
    for entry in plan.constants:
        if entry.fqn in by_fqn:
            continue
        tensor = values[entry.fqn].detach().to(device)
        # Registers the tensor under the name Inductor gives a graph input of this target, or returns the
        # constant that already is this very tensor (tied weights).
        name = graph.allocate_non_dup_const_name(entry.fqn, tensor)
        by_fqn[entry.fqn] = name
        if graph.allocated_constant_name.get(name) == entry.fqn and name not in added:
            added.add(name)
            (graph.named_parameters if entry.kind == "parameter" else graph.named_buffers)[name] = tensor
    planned = [by_fqn[e.fqn] for e in plan.constants if e.fqn in by_fqn]
    ordered = {name: graph.constants[name] for name in planned}
    ordered.update((name, value) for name, value in graph.constants.items() if name not in ordered)
    graph.constants.clear()
    graph.constants.update(ordered)  # in place: codegen and the blob writer both read this dict
    return [{"name": name, "fqn": graph.allocated_constant_name.get(name, name), "dtype": str(value.dtype),
             "shape": list(value.shape), "nbytes": _storage_bytes(value),
             "planned": name in planned, "added": name in added, "adopted": name in adopted}
            for name, value in graph.constants.items()]


@contextlib.contextmanager
def inductor_follows_plan(plan: ConstantPlan, values: Mapping[str, torch.Tensor]) -> Iterator[List[List[Dict]]]:
    """While active, every AOT compile's constant table is the plan (see ``apply_plan``).

    Yields a list that gets one table per AOT compile, in the order the ``.so`` holds its constants.
    """
    graph_class = _check_inductor()
    missing = [fqn for fqn in plan.fqns() if fqn not in values]
    if missing:
        raise LoweringError(f"no values for {len(missing)} planned constant(s), e.g. {missing[:3]}",
                            "take them from the method's program with plan_values")
    tables: List[List[Dict[str, Any]]] = []
    original = graph_class.codegen_with_cpp_wrapper

    def codegen_with_cpp_wrapper(self, *args, **kwargs):
        if getattr(self, "aot_mode", False) and not getattr(self, "is_const_graph", False):
            tables.append(apply_plan(self, plan, values))
        return original(self, *args, **kwargs)

    graph_class.codegen_with_cpp_wrapper = codegen_with_cpp_wrapper
    try:
        yield tables
    finally:
        graph_class.codegen_with_cpp_wrapper = original
