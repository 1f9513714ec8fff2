"""What quantization costs, measured on the CPU: the quantized unit run eagerly against the same unit before
quantization (its float32 copy, and for a bf16 unit its bf16 self), over the CPU check's seeds and sizes.

This is the second half of the quantization rule (docs/quantization.md). The first half, what rewriting and
lowering add, is the CPU check and the verification as they are: the program against the *quantized* unit run
eagerly. Here nothing is exported; only torchao's quantization is measured, and a recipe may bound it
(``unit.quantize.bound``). With seeded random weights the figure says how far the outputs move, not how a
policy's task success changes.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch

from zoo.core.errors import VerificationFailed
from zoo.core.numerics import compare
from zoo.export.cpu_check import HALF, BufferState, check_cases, draw_inputs, output_names, run_sequence
from zoo.export.quantize import Baselines
from zoo.policies.base import ExportUnit

SEEDED_NOTE = ("seeded random weights: this is how far quantization moves the outputs, not a task-success "
               "figure; a real checkpoint's cost is measured on it")


def quantization_cost(unit: ExportUnit, baselines: Baselines, recipe) -> Dict[str, Any]:
    """Per output, the worst over every case of the quantized unit against its unquantized float32 copy (and
    of the unquantized low-precision unit against float32, for scale). Raises ``VerificationFailed`` past the
    recipe's bound."""
    methods = list(recipe.unit.methods)
    quantized = {m: unit.methods[m].module for m in methods}
    wide = {m: baselines.float32.methods[m].module for m in methods}
    low = {m: baselines.low.methods[m].module for m in methods} if baselines.low is not None else {}
    state = BufferState(list(quantized.values()) + list(wide.values()) + list(low.values()))
    worst: Dict[str, Dict[str, Any]] = {}
    with torch.no_grad():
        try:
            for seed in recipe.verify.seeds:
                for sizes in check_cases(recipe):
                    inputs = draw_inputs(unit, methods, sizes, seed)
                    for name, got, ref, own in _case_outputs(unit, quantized, wide, low, inputs, state):
                        _keep_worst(worst, name, compare(name, got, ref),
                                    compare(name, own, ref) if own is not None else None)
        finally:
            state.restore()
    bound = recipe.unit.quantize.bound
    rows = [_judged(name, row, bound) for name, row in worst.items()]
    result = {"scheme": recipe.unit.quantize.words(), "against": "the unquantized unit in float32",
              "bound": {"rel_l2": bound.rel_l2, "min_cosine": bound.min_cosine},
              "passed": all(r["ok"] for r in rows), "rows": rows, "note": SEEDED_NOTE}
    failed = [r for r in rows if not r["ok"]]
    if failed:
        raise VerificationFailed(
            f"quantization costs more than the recipe allows: {'; '.join(f'{r['name']}: {r['why']}' for r in failed[:3])}",
            "exclude the layers that matter from quantization (unit.quantize.exclude), use a finer group, or loosen "
            "unit.quantize.bound; the quantization section of report.md has every output", result=result)
    return result


def _case_outputs(unit, quantized, wide, low, inputs, state: BufferState):
    """(name, quantized, float32 reference, unquantized low precision or None) for each output and written
    buffer of one case."""
    state.restore()
    got, got_state = run_sequence(quantized, inputs, state)
    state.restore()
    widened = {m: tuple(x.float() if x.dtype in HALF else x for x in args) for m, args in inputs.items()}
    ref, ref_state = run_sequence(wide, widened, state)
    own: Dict[str, List[torch.Tensor]] = {}
    own_state: Dict[str, torch.Tensor] = {}
    if low:
        state.restore()
        own, own_state = run_sequence(low, inputs, state)
    for m in quantized:
        names = output_names(unit.methods[m].output_names, len(got[m]))
        for i, name in enumerate(names):
            yield f"{m}.{name}", got[m][i], ref[m][i], (own[m][i] if own else None)
    for key in sorted(set(got_state) & set(ref_state)):
        yield f"state:{key}", got_state[key], ref_state[key], own_state.get(key)


def _keep_worst(worst: Dict[str, Dict[str, Any]], name: str, c, own) -> None:
    """Fold one case into ``name``'s worst: ``c`` the quantized unit against float32, ``own`` the unquantized
    low-precision unit against float32 (its own error, to read the cost against), or None."""
    row = worst.setdefault(name, {"cases": 0, "rel_l2": None, "cosine": None, "max_abs": None,
                                  "unquantized_low_rel_l2": None, "usable": True})
    row["cases"] += 1
    row["usable"] = row["usable"] and c.ok
    for key, value, pick in (("rel_l2", c.rel_l2, max), ("cosine", c.cosine, min), ("max_abs", c.max_abs, max)):
        row[key] = value if row[key] is None else pick(row[key], value)
    if own is not None:
        prior = row["unquantized_low_rel_l2"]
        row["unquantized_low_rel_l2"] = own.rel_l2 if prior is None else max(prior, own.rel_l2)


def _judged(name: str, row: Dict[str, Any], bound) -> Dict[str, Any]:
    why = []
    if not row["usable"]:
        why.append("non-finite values or a shape mismatch")
    if bound.rel_l2 is not None and not row["rel_l2"] <= bound.rel_l2:
        why.append(f"relative L2 {row['rel_l2']:.3e} > bound {bound.rel_l2:g}")
    if bound.min_cosine is not None and not row["cosine"] >= bound.min_cosine:
        why.append(f"cosine {row['cosine']:.6f} < bound {bound.min_cosine}")
    out = {k: v for k, v in row.items() if k != "usable"}
    return {"name": name, **out, "ok": not why, "why": "; ".join(why)}
