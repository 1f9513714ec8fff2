"""The rewritten programs against the unit's eager modules (the original complex math), on the CPU.

For each verify seed and each size case (the recipe's verify sizes plus every dynamic bound), every method
runs on fresh seeded inputs, in the unit's method order, through eager and through the rewritten program.
Stateful units (buffers written in place, e.g. LingBot's KV pool) start each sequence from the same state:
every buffer is restored in place before each run, so eager and program, and methods sharing a buffer, see
exactly what a fresh copy would, and the unit is left as it was found.

Judgement (the same rule as the GPU verification): float32 units by relative L2 <= tolerance.float32,
float64 units by tolerance.float64; bf16 units against the float32 copy of the unit: the program may be at
most ``bf16_factor`` times as far from float32 as eager bf16 is, with cosine >= ``bf16_min_cosine``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.export import ExportedProgram
from torch.utils import _pytree as pytree

from zoo.core.errors import VerificationFailed
from zoo.export.trace import HALF, example_sizes
from zoo.core.numerics import compare, judge, judge_low_precision
from zoo.core.progress import steps
from zoo.policies.base import ExportUnit
from zoo.runner.state import SharedBuffers

# Verification inputs are drawn from seed + this offset, so they are never the example inputs torch.export
# traced with (a value baked into the graph would go unnoticed on those).
SEED_OFFSET = 10_000


def check_cases(recipe, base: Optional[Dict[str, int]] = None) -> List[Dict[str, int]]:
    """Size cases: the export sizes, then each dynamic dim at its verify sizes and bounds (others at the
    export size), then all dims at their minimum and at their maximum together."""
    base = dict(base or example_sizes(recipe))
    cases = [base]

    def add(case: Dict[str, int]) -> None:
        if case not in cases:
            cases.append(case)

    for dim, rng in recipe.dynamic.items():
        for size in list(recipe.verify.sizes.get(dim, [])) + [rng.min, rng.max]:
            add({**base, dim: int(size)})
    if len(recipe.dynamic) > 1:
        add({**base, **{d: int(r.min) for d, r in recipe.dynamic.items()}})
        add({**base, **{d: int(r.max) for d, r in recipe.dynamic.items()}})
    return cases


class BufferState:
    """Every buffer of some modules, saved once by tensor identity and restored in place on demand.

    In-place restore (not fresh copies) keeps sharing intact: an exported program's module uses the very
    buffer tensors of the eager module, and two methods of one unit may share a pool.
    """

    def __init__(self, modules: Sequence[torch.nn.Module]):
        self._saved: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        for module in modules:
            for _, buf in module.named_buffers(remove_duplicate=False):
                if id(buf) not in self._saved:
                    self._saved[id(buf)] = (buf, buf.detach().clone())

    def restore(self) -> None:
        with torch.no_grad():
            for buf, initial in self._saved.values():
                buf.copy_(initial)

    def changed(self, module: torch.nn.Module) -> Dict[str, torch.Tensor]:
        """Buffers of ``module`` that differ from their saved value: name -> a copy of the current value."""
        out = {}
        for name, buf in module.named_buffers():
            saved = self._saved.get(id(buf))
            if saved is not None and not torch.equal(buf, saved[1]):
                out[name] = buf.detach().clone()
        return out


def cpu_check(unit: ExportUnit, programs: Dict[str, ExportedProgram], recipe,
              reference: Optional[ExportUnit] = None) -> Dict[str, Any]:
    """Compare ``programs`` with the unit's eager modules; return the report section, raise on a mismatch.

    ``reference`` is the float32 copy of a bf16 unit (``exporting.float32_copy``); it is required then.
    """
    dtype = recipe.unit.dtype
    if dtype == "bfloat16" and reference is None:
        raise ValueError("a bf16 unit is judged against its float32 copy: pass reference=float32_copy(unit)")
    methods = list(recipe.unit.methods)
    tol = recipe.verify.tolerance
    cases_out = []
    failures: List[str] = []
    total = 0
    with torch.no_grad():
        eager = {m: unit.methods[m].module for m in methods}
        exported = _shared_modules({m: programs[m] for m in methods})
        ref = {m: reference.methods[m].module for m in methods} if reference is not None else {}
        state = BufferState(list(eager.values()) + list(exported.values()) + list(ref.values()))
        try:
            calls = [(seed, sizes) for seed in recipe.verify.seeds for sizes in check_cases(recipe)]
            for seed, sizes in steps(calls, "CPU check", label=lambda c: f"seed {c[0]} {c[1] or ''}", unit="case"):
                inputs = draw_inputs(unit, methods, sizes, seed)
                comps = _compare_case(unit, eager, exported, ref, inputs, state, dtype, tol)
                total += len(comps)
                for c in comps:
                    if not c["ok"]:
                        failures.append(f"{c['name']} at sizes {sizes} seed {seed}: {c['why']}")
                cases_out.append({"seed": seed, "sizes": sizes, "comparisons": comps})
        finally:
            state.restore()
    result = {"passed": not failures, "compared": total, "failed": len(failures), "dtype": dtype,
              "rule": _rule_words(dtype, tol), "worst_rel_l2": _worst(cases_out), "cases": cases_out}
    if failures:
        shown = "; ".join(failures[:3]) + (f"; and {len(failures) - 3} more" if len(failures) > 3 else "")
        raise VerificationFailed(
            f"CPU check: the rewritten program does not compute what eager computes ({len(failures)} of {total} "
            f"comparisons failed): {shown}",
            "see the cpu_check section of report.md; with complex128 rope, rotary_pairs=float64 is exact",
            result=result)
    return result


def _shared_modules(programs: Dict[str, ExportedProgram]) -> Dict[str, torch.nn.Module]:
    """The programs as modules, the buffers they write one tensor per name across them, as every runtime shares
    them (zoo.runner.state): the unit's own methods share those buffers in eager PyTorch."""
    shared = SharedBuffers()
    return {method: shared.module_of(program) for method, program in programs.items()}


def draw_inputs(unit: ExportUnit, methods: Sequence[str], sizes: Dict[str, int], seed: int):
    """Fresh inputs for one sequence: one generator per (seed, sizes), drawn method after method."""
    g = torch.Generator().manual_seed(SEED_OFFSET + int(seed))
    return {m: tuple(spec.sample(g, sizes) for spec in unit.methods[m].inputs) for m in methods}


def _compare_case(unit, eager, exported, ref, inputs, state: BufferState, dtype: str, tol) -> List[Dict]:
    state.restore()
    eager_out, eager_state = run_sequence(eager, inputs, state)
    state.restore()
    prog_out, prog_state = run_sequence(exported, inputs, state)
    ref_out: Dict[str, List[torch.Tensor]] = {}
    ref_state: Dict[str, torch.Tensor] = {}
    if ref:
        state.restore()
        wide = {m: tuple(x.float() if x.dtype in HALF else x for x in args) for m, args in inputs.items()}
        ref_out, ref_state = run_sequence(ref, wide, state)

    comps = []
    for m in eager:
        if len(prog_out[m]) != len(eager_out[m]):
            comps.append({"name": f"{m}", "ok": False, "why": f"the program returns {len(prog_out[m])} tensors, "
                          f"eager {len(eager_out[m])}"})
            continue
        names = output_names(unit.methods[m].output_names, len(eager_out[m]))
        refs = ref_out.get(m) or [None] * len(names)
        for i, name in enumerate(names):
            comps.append(_judge(f"{m}.{name}", prog_out[m][i], eager_out[m][i], refs[i], dtype, tol))
    # In-place state (a KV pool) is an output too: the program must leave it as eager does.
    for key in sorted(set(eager_state) | set(prog_state)):
        if key not in prog_state or key not in eager_state:
            who = "eager" if key in eager_state else "the program"
            comps.append({"name": f"state:{key}", "ok": False, "why": f"only {who} writes this buffer"})
            continue
        comps.append(_judge(f"state:{key}", prog_state[key], eager_state[key], ref_state.get(key), dtype, tol))
    return comps


def run_sequence(modules: Dict[str, torch.nn.Module], inputs, state: BufferState):
    outs, changed = {}, {}
    for m, module in modules.items():
        leaves = pytree.tree_leaves(module(*inputs[m]))
        outs[m] = [t.detach().clone() for t in leaves if isinstance(t, torch.Tensor)]
    for m, module in modules.items():
        for name, value in state.changed(module).items():
            changed.setdefault(name, value)
    return outs, changed


def _judge(name: str, got: torch.Tensor, eager: torch.Tensor, ref32: Optional[torch.Tensor], dtype: str, tol) -> Dict:
    if dtype != "bfloat16":
        bound = tol.float64 if dtype == "float64" else tol.float32
        return judge(compare(name, got, eager), bound).as_dict()
    # bf16: both eager bf16 and the program are measured against float32; the program may be no further.
    c, _, eager_err = judge_low_precision(name, got, eager, ref32, tol)
    d = c.as_dict()
    d["eager_bf16_rel_l2_vs_fp32"] = eager_err.rel_l2
    d["vs_eager_bf16"] = compare(name, got, eager).as_dict()
    return d


def output_names(declared: Sequence[str], count: int) -> List[str]:
    if len(declared) == count:
        return list(declared)
    return [f"out{i}" for i in range(count)]


def _worst(cases: List[Dict]) -> Optional[Dict[str, Any]]:
    worst = None
    for case in cases:
        for c in case["comparisons"]:
            rel = c.get("rel_l2")
            if rel is not None and (worst is None or not rel <= worst["rel_l2"]):
                worst = {"name": c["name"], "rel_l2": rel, "sizes": case["sizes"], "seed": case["seed"]}
    return worst


def _rule_words(dtype: str, tol) -> str:
    if dtype == "bfloat16":
        return (f"bf16 vs float32 copy: rel L2 <= {tol.bf16_factor} x eager bf16's own (at least "
                f"{tol.float32:g}), cosine >= {tol.bf16_min_cosine}")
    bound = tol.float64 if dtype == "float64" else tol.float32
    return f"{dtype}: rel L2 vs eager <= {bound:g}"


def summary_detail(result: Dict[str, Any]) -> str:
    """One line for the summary table."""
    worst = result.get("worst_rel_l2") or {}
    rel = worst.get("rel_l2")
    tail = f", worst rel L2 {rel:.2e} ({worst.get('name')})" if rel is not None else ""
    return f"{result['compared'] - result['failed']}/{result['compared']} within tolerance{tail}"


