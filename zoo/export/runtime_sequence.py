"""Checks of an artifact across the two runtimes (torch's AOTI runner and ExecuTorch's C++ runtime), for
``benchmarks/gpu_runtime_check.py`` and the GPU box.

- ``summary_rows``: a two-runtime verification (``zoo.export.verify`` rows, as report.json holds them) as one short
  table: per method, runtime, seed and size, the worst relative L2 and cosine over the outputs, and pass;
  ``result_passed``: one run folder's checks (verification, sequence, latency) together.
- ``pool_sequence``: LingBot-VA's KV pool over a sequence of calls in ONE zoo_runner process, against the
  exported programs run eagerly the same way. In the "io" layout each call's ``X_next`` outputs are fed to the
  next call's ``X`` inputs inside the runner (held there, on the GPU), and the pool must never cross to the host
  on its way (no input copied to the host for planned memory, no named value copied to survive a call). In the
  "buffer" layout the pool is buffers inside the methods, which the runtime must share by name (its weight
  sharing across methods): the eager chain shares them, so a runtime that gave each method its own pool
  computes other numbers from the second call on.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from zoo.runtimes import executorch as et_runtime
from zoo.export import verify
from zoo.contract.artifact import io_memory_planning
from zoo.contract.host_settings import NoHostSettings
from zoo.contract.run_folder import RunFolder
from zoo.runner.loading import RUNNERS
from zoo.contract.releases import requirement_for

# LingBot-VA's two DiT methods, which read and write the one KV pool (the "io" layout hands it over via the host)
POOL_METHODS = ("video_step", "action_step")


def summary_rows(recipe_name: str, verification: Dict[str, Any]) -> List[List[Any]]:
    """(recipe, method, runtime, seed/sizes, worst rel L2, worst cosine, pass) per method, runtime, seed and size;
    one row for a runtime that produced none (not run, expected by the audit, or failed)."""
    groups: Dict[tuple, Dict[str, Any]] = {}
    for r in verification.get("rows", []):
        key = (r["method"], r["runtime"], f"{r['seed']}/{verify._sizes_text(r['sizes'])}")
        g = groups.setdefault(key, {"rel_l2": 0.0, "cosine": 1.0, "ok": True, "why": ""})
        if not (r["tolerance"] == 0.0 and r["ok"]):  # exact (integer) outputs carry no error to report
            g["rel_l2"] = math.nan if math.isnan(r["rel_l2"]) or math.isnan(g["rel_l2"]) else max(g["rel_l2"],
                                                                                                 r["rel_l2"])
            g["cosine"] = min(g["cosine"], r["cosine"])
        if not r["ok"]:
            g["ok"], g["why"] = False, g["why"] or f"{r['output']}: {r['why']}"
    rows = [[recipe_name, m, rt, case, f"{g['rel_l2']:.2e}", f"{g['cosine']:.6f}",
             "ok" if g["ok"] else "FAIL " + g["why"][:60]] for (m, rt, case), g in groups.items()]
    rows.sort(key=lambda row: (row[1], row[3], row[2]))
    for name, outcome in verification.get("runtimes", {}).items():
        status = outcome.get("status", verify.RAN)
        if status != verify.RAN:
            words = verify._status_text(outcome)
            rows.append([recipe_name, "(all)", name, "-", "-", "-",
                         words if status != verify.FAILED else "FAIL " + words])
    return rows


def verification_passed(verification: Dict[str, Any]) -> bool:
    """Every row within tolerance and no runtime failed unexpectedly (verification's own verdict)."""
    return bool(verification.get("passed"))


def result_passed(res: Dict[str, Any]) -> bool:
    ok = "verification_error" not in res and "latency_error" not in res
    if "verification" in res:
        ok = ok and verification_passed(res["verification"])
    seq = res.get("sequence")
    if seq is not None and "skipped" not in seq:
        ok = ok and seq.get("passed") is True
    check = res.get("policy_check")
    ok = ok and (check is None or "skipped" in check or bool(check.get("ok")))
    ok = ok and "memory_error" not in res and all(
        res["memory"][label].get("ok") for label in ("shared", "own_copy") if "memory" in res)
    return ok and all(value.get("ok") for row in res.get("latency", []) for key, value in row.items()
                      if key.startswith(("executorch", "aoti")) and isinstance(value, dict))


def pool_sequence(run: RunFolder, recipe, runner: Path, steps: int, device: str = "cuda",
                  require_cuda: bool = True, methods: Sequence[str] = POOL_METHODS) -> Dict[str, Any]:
    """video_step/action_step alternating in one zoo_runner process, each call's ``X_next`` outputs fed to the
    next call's ``X`` inputs ("io" layout) or the pool kept inside the methods ("buffer" layout); the exported
    programs run eagerly the same way (their buffers shared by name) are the reference."""
    io_spec = run.read_io_spec()
    # the methods that share the pool, alternating; the recipe's other methods (the VAE encodes) keep no pool
    methods = [m for m in methods if m in recipe.unit.methods]
    if len(methods) < 2:
        return {"skipped": f"{recipe.name}: not both of {', '.join(POOL_METHODS)} among its methods"}
    specs = {m: list(io_spec.methods[m].inputs) for m in methods}
    outputs = {m: list(io_spec.methods[m].outputs) for m in methods}
    # input i of method m takes the previous call's output named "<input name>_next" (k_pool <- k_pool_next)
    stateful = {m: [i for i, spec in enumerate(specs[m]) if spec.name + "_next" in outputs[m]] for m in methods}
    inside = sorted(set.intersection(*(set(run.mutable_buffers(m)) for m in methods)))
    feeding = all(stateful.values())
    if not feeding and not inside:
        return {"skipped": f"{recipe.name}: the methods neither pass state in and out (X -> X_next) nor write "
                           "buffers of the same names in place"}
    if not feeding:
        stateful = {m: [] for m in methods}  # the "buffer" layout: the state stays inside, nothing is fed
    order = [methods[s % len(methods)] for s in range(steps)]

    def source(s: int, i: int) -> int:
        return outputs[order[s - 1]].index(specs[order[s]][i].name + "_next")

    sizes = verify.size_cases(io_spec, recipe)[0]
    drawn = []
    for s, m in enumerate(order):
        used = {d: sizes[d] for spec in specs[m] for d in spec.shape if isinstance(d, str)}
        drawn.append(verify.draw_inputs(specs[m], used, seed=s, method=m))
    plan = []
    for s, m in enumerate(order):
        inputs: List[Any] = list(drawn[s])
        for i in stateful[m]:  # zero state to start with, as the host does (the pool is zero-initialised)
            inputs[i] = torch.zeros_like(drawn[s][i]) if s == 0 else (s - 1, source(s, i))
        plan.append((m, inputs))
    requirement = requirement_for(run, io_memory_planning)
    result = et_runtime.run_plan(run.pte, run.ptd if run.ptd.exists() else None, plan, executable=runner,
                                 require_cuda=require_cuda, requirement=requirement)
    chain = dict(methods=methods, order=order, drawn=drawn, stateful=stateful, source=source, device=device)
    want = _eager_chain(run, "exported", lambda t: t, **chain)
    want32 = _eager_chain(run, "reference_fp32", verify._to_fp32, **chain) if recipe.unit.dtype == "bfloat16" else None
    rows = _sequence_rows(order, outputs, result.outputs, want, want32, recipe.verify.tolerance, device)
    crossing = _state_crossing(result)
    state_ok = crossing["rescued"] == 0 and (crossing["host_copies"] == 0 or not requirement.device_io)
    return {"recipe": recipe.name, "layout": "io" if feeding else "buffer", "shared_buffers": inside,
            "steps": order, "step_ms": result.step_ms, "rows": rows, "state": crossing,
            "passed": bool(rows) and all(r["ok"] for r in rows) and state_ok,
            "load_ms": result.summary.get("load_ms"), "gpu_loaded_mib": result.summary.get("gpu_loaded_mib")}


def _eager_chain(run: RunFolder, kind: str, cast: Callable[[torch.Tensor], torch.Tensor], *,
                 methods: Sequence[str], order: List[str],
                 drawn: List[Sequence[torch.Tensor]], stateful: Dict[str, List[int]],
                 source: Callable[[int, int], int], device: str) -> List[List[torch.Tensor]]:
    """The run's ``kind`` programs called in ``order`` eagerly, each call's state inputs fed from the previous
    call's outputs as the runner feeds them: the sequence's reference."""
    modules = verify.eager_modules(run, kind, methods, device)
    outs: List[List[torch.Tensor]] = []
    with torch.no_grad(), verify.full_fp32_precision():
        for s, m in enumerate(order):
            inputs = [cast(t).to(device) for t in drawn[s]]
            for i in stateful[m]:
                inputs[i] = torch.zeros_like(inputs[i]) if s == 0 else outs[-1][source(s, i)]
            outs.append(verify._flat_tensors(modules[m](*inputs)))
    return outs


def _sequence_rows(order: List[str], outputs: Dict[str, List[str]], got_outputs: Sequence[Sequence[Any]],
                   want: List[List[torch.Tensor]], want32: Optional[List[List[torch.Tensor]]], tolerance: Any,
                   device: str) -> List[Dict[str, Any]]:
    """One row per call and output: the runner's output against the eager chain's."""
    rows = []
    for s, m in enumerate(order):
        got = [t.to(device) for t in got_outputs[s] if t is not None]
        judged = verify.compare_outputs(outputs[m], got, want[s], tolerance, ref_fp32=want32[s] if want32 else None)
        for c, bound, facts in judged:
            rows.append({"step": s, "method": m, "output": c.name, "rel_l2": c.rel_l2, "cosine": c.cosine,
                         "max_abs": c.max_abs, "tolerance": bound, "ok": c.ok, "why": c.why})
    return rows


def _state_crossing(result: Any) -> Dict[str, Any]:
    """How the pool was handed over inside the runner: on the GPU (where the backend left it), never copied to the
    host for planned input memory, never copied to outlive a call (zoo_runner's counts; docs/runtime.md)."""
    on_gpu = all(reply["device"][k] for reply in result.replies for k in range(len(reply["device"]))
                 if reply["outputs"][k] is None)
    return {"host_copies": int(result.summary.get("host_copies", 0)),
            "rescued": int(result.summary.get("rescued", 0)), "kept_on_gpu": on_gpu}


def method_inputs(run: RunFolder, recipe, method: str) -> Tuple[Dict[str, int], int, List[torch.Tensor]]:
    """Inputs for timing ``method`` as verification draws them: the recipe's first size case and seed (without a
    recipe: each dynamic dim's smallest size, seed 0). Returns the sizes used, the seed and the inputs."""
    io_spec = run.read_io_spec()
    if recipe is not None:
        sizes, seed = verify.size_cases(io_spec, recipe)[0], recipe.verify.seeds[0]
    else:
        sizes, seed = {d: r.min for d, r in io_spec.dynamic.items()}, 0
    specs = list(io_spec.methods[method].inputs)
    used = {d: sizes[d] for spec in specs for d in spec.shape if isinstance(d, str)}
    return used, seed, verify.draw_inputs(specs, used, seed, method)


def state_positions(run: RunFolder, method: str) -> Dict[str, List[int]]:
    """The inputs and outputs of ``method`` that are state (the family's ``device_state``): an output kept for a
    later call, an input fed from one (the input named as the slot it is kept under)."""
    settings = run.read_host_settings() if run.host_settings_file.exists() else NoHostSettings()
    family = RUNNERS.get(settings.policy_type)
    state = family.device_state(settings) if family else {}
    io = run.read_io_spec().methods[method]
    slots = {slot for outs in state.values() for slot in outs.values()}
    return {"inputs": [i for i, spec in enumerate(io.inputs) if spec.name in slots],
            "outputs": [k for k, name in enumerate(io.outputs) if name in state.get(method, {})]}


# How a timed call gets its inputs and leaves its outputs (gpu_runtime_check's --latency): every input on the GPU and
# every output left there; the state on the GPU, the rest through the host; everything through the host.
IO_MODES = ("device", "state", "host_io")


def io_positions(mode: str, state: Dict[str, List[int]], n_in: int, n_out: int) -> Tuple[List[int], List[int]]:
    """The inputs on the GPU and the outputs kept there, in one of ``IO_MODES``."""
    if mode == "device":
        return list(range(n_in)), list(range(n_out))
    if mode == "state":
        return state["inputs"], state["outputs"]
    return [], []
