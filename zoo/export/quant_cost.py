"""What quantization costs, measured eagerly: the quantized unit against the same unit before quantization (its
float32 copy, and for a bf16 unit its bf16 self), over the CPU check's seeds and sizes (``quantization_cost``); and
the policy's actions, LeRobot's policy quantized as the unit against its unquantized float32 policy, over the
policy check's episodes (``policy_cost``).

This is the second half of the quantization rule (docs/quantization.md). The first half, what rewriting and
lowering add, is the CPU check, the verification and the policy check as they are: the program against the
*quantized* unit run eagerly, the runner against LeRobot's policy quantized the same way. Here nothing is exported;
only torchao's quantization is measured, and a recipe may bound it (``unit.quantize.bound``). With seeded random
weights the figure says how far the outputs move, not how a policy's task success changes.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence

import torch

from zoo.core.errors import VerificationFailed
from zoo.core.numerics import compare
from zoo.core.report import format_table
from zoo.export.cpu_check import HALF, BufferState, check_cases, draw_inputs, output_names, run_sequence
from zoo.export.quantize import Baselines
from zoo.export.verify import full_fp32_precision
from zoo.policies.base import ExportUnit

SEEDED_NOTE = ("seeded random weights: this is how far quantization moves the outputs, not a task-success "
               "figure; a real checkpoint's cost is measured on it")
ACTIONS_NOTE = ("seeded synthetic observations (and, where the run's weights are seeded or fabricated, seeded random "
                "weights): how far quantization moves the policy's actions, not a task-success figure")

Actions = Mapping[int, Sequence[torch.Tensor]]  # per episode seed, one action per observation


def quantization_cost(unit: ExportUnit, baselines: Baselines, recipe, device: str = "cpu") -> Dict[str, Any]:
    """Per output, the worst over every case of the quantized unit against its unquantized float32 copy (and
    of the unquantized low-precision unit against float32, for scale), run on ``device`` (the modules are moved
    there for the measurement and back to the CPU after it). Raises ``VerificationFailed`` past the recipe's
    bound."""
    methods = list(recipe.unit.methods)
    quantized = {m: unit.methods[m].module for m in methods}
    wide = {m: baselines.float32.methods[m].module for m in methods}
    low = {m: baselines.low.methods[m].module for m in methods} if baselines.low is not None else {}
    worst: Dict[str, Dict[str, Any]] = {}
    with _moved([*quantized.values(), *wide.values(), *low.values()], device), torch.no_grad():
        state = BufferState(list(quantized.values()) + list(wide.values()) + list(low.values()))
        try:
            for seed in recipe.verify.seeds:
                for sizes in check_cases(recipe):
                    drawn = draw_inputs(unit, methods, sizes, seed)
                    inputs = {m: tuple(x.to(device) for x in args) for m, args in drawn.items()}
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


@contextlib.contextmanager
def _moved(modules: Sequence[torch.nn.Module], device: str) -> Iterator[None]:
    """The modules on ``device`` (with float32 matmuls in full precision on a GPU: TF32 would move the float32
    reference itself) for the block, and back on the CPU after it, whatever the outcome."""
    if torch.device(device).type == "cpu":
        yield
        return
    holder = torch.nn.ModuleList(modules)  # a module shared by several methods or copies is moved once
    holder.to(device)
    try:
        with full_fp32_precision():
            yield
    finally:
        holder.to("cpu")
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()


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


def policy_cost(quantized: Actions, unquantized: Actions, chunks: Mapping[int, Sequence[int]], recipe,
                quantized_float32: Optional[Actions] = None) -> Dict[str, Any]:
    """What quantization costs the policy's actions: per episode and action chunk (``chunks[seed]``: the actions of
    each of the runner's chunks, in order), LeRobot's policy in the unit's dtype quantized as the unit
    (``quantized``) against LeRobot's unquantized policy in float32 (``unquantized``), from the same seeds and noise;
    for a bf16 unit also LeRobot's float32 policy quantized the same way (``quantized_float32``: the quantization
    alone, without bf16 rounding). Reported as numbers; a chunk fails only past the recipe's unit.quantize.bound
    (or on non-finite actions)."""
    bound = recipe.unit.quantize.bound
    rows: List[Dict[str, Any]] = []
    for seed, sizes in chunks.items():
        start = 0
        for chunk, size in enumerate(sizes, start=1):
            got, ref = (torch.stack(list(actions[seed][start:start + size])) for actions in (quantized, unquantized))
            c = compare(f"seed {seed} chunk {chunk}", got, ref)
            row = {"seed": seed, "chunk": chunk, "actions": size, "rel_l2": c.rel_l2, "cosine": c.cosine,
                   "max_abs": c.max_abs, "usable": c.ok, "quantized_float32_rel_l2": None}
            if quantized_float32 is not None:
                alone = torch.stack(list(quantized_float32[seed][start:start + size]))
                row["quantized_float32_rel_l2"] = compare(c.name, alone, ref).rel_l2
            rows.append(_judged(c.name, row, bound))
            start += size
    every = compare("all actions", _chunked_actions(quantized, chunks), _chunked_actions(unquantized, chunks))
    result = {"scheme": recipe.unit.quantize.words(), "dtype": recipe.unit.dtype,
              "against": "LeRobot's unquantized policy in float32", "rows": rows,
              "bound": {"rel_l2": bound.rel_l2, "min_cosine": bound.min_cosine},
              "all_actions": {"actions": sum(r["actions"] for r in rows), "rel_l2": every.rel_l2,
                              "cosine": every.cosine},
              "passed": all(r["ok"] for r in rows), "note": ACTIONS_NOTE}
    result["table"] = _policy_cost_table(result, low_precision=quantized_float32 is not None)
    return result


def _chunked_actions(actions: Actions, chunks: Mapping[int, Sequence[int]]) -> torch.Tensor:
    """Every action of every episode that falls in a chunk, stacked."""
    return torch.stack([a for seed, sizes in chunks.items() for a in actions[seed][:sum(sizes)]])


def _policy_cost_table(cost: Dict[str, Any], low_precision: bool) -> str:
    bound = ", ".join(f"{k} {v:g}" for k, v in cost["bound"].items() if v is not None) or "none: reported only"
    head = [f"what quantization costs ({cost['scheme']}): LeRobot's policy in {cost['dtype']} quantized as the unit "
            f"against its unquantized float32 policy, same seeds and noise (bound: {bound})"]
    rows = [["seed", "chunk", "actions", "rel L2", "cosine", "max|diff|"]
            + (["quantization alone (float32) rel L2"] if low_precision else []) + ["result"]]
    for r in cost["rows"]:
        rows.append([r["seed"], r["chunk"], r["actions"], f"{r['rel_l2']:.3e}", f"{r['cosine']:.6f}",
                     f"{r['max_abs']:.3e}"]
                    + ([f"{r['quantized_float32_rel_l2']:.3e}"] if low_precision else [])
                    + ["ok" if r["ok"] else f"FAIL: {r['why']}"])
    every = cost["all_actions"]
    tail = [f"all {every['actions']} actions: rel L2 {every['rel_l2']:.3e}, cosine {every['cosine']:.6f}",
            f"note: {cost['note']}"]
    return "\n".join(head + [format_table(rows)] + tail)
