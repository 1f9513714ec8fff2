"""Lowered run folders through ExecuTorch's C++ runtime (zoo_runner) next to torch's AOTI runner, on a GPU.

    python scripts/gpu_runtime_check.py RUN_DIR [RUN_DIR ...] --out OUT
        [--runner PATH | --build-from SRC [--build-dir DIR]] [--steps 4] [--latency] [--iters 20]

1. The runtime: ``--runner`` (or $ZOO_ET_RUNNER), else built with scripts/build_runtime.sh from ``--build-from``
   (the ExecuTorch source tarball; reused when already built in ``--build-dir``).
2. Per run folder, every method at the recipe's verify seeds and sizes (plus the dynamic bounds), through both
   runners, against eager, with verification's own inputs, references and tolerances (zoo.verify).
3. A LingBot-VA run in the "io" KV-pool layout: a sequence of ``--steps`` calls alternating video_step and
   action_step in ONE zoo_runner process (one loaded program), each call's pool outputs fed to the next call
   inside the runner, against the exported programs run eagerly with the same feeding.
4. ``--latency``: each method at its first seed and size, warm-up then timed calls, median and p90, and the GPU
   memory after loading, for both runners.
One table on stdout; everything in OUT/runtime_check.json and OUT/runtime_check.txt. Exit 0 when every check
passed, 1 when one failed (a failure to load counts: it is a finding), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from zoo import et_runtime, verify  # noqa: E402
from zoo.errors import ZooError  # noqa: E402
from zoo.lower import load_run_recipe  # noqa: E402
from zoo.lowering import PTD_NAME, PTE_NAME, load_io_order  # noqa: E402
from zoo.policies.base import InputSpec  # noqa: E402
from zoo.report import format_table  # noqa: E402


def build_runner(src: str, build_dir: Path) -> Dict[str, Any]:
    """scripts/build_runtime.sh SRC DIR (reused when built); returns its stamp (times, versions, runner path)."""
    proc = subprocess.run(["bash", str(REPO / "scripts" / "build_runtime.sh"), src, str(build_dir)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sys.stderr.write(proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"[gpu_runtime_check] building the runtime failed (exit {proc.returncode}); "
                         f"log: {build_dir / 'build.log'}")
    stamp = json.loads((build_dir / "stamp.json").read_text())
    stamp["this_call"] = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
    return stamp


# --- both runners through verification's own loop ----------------------------------------------------------------------


@contextlib.contextmanager
def _method_order_runners(device: str) -> Iterator[None]:
    """Interim, until verify.py takes a caller per runtime: verification feeds every runner in the .so's order
    (``run_in_delegate_order``); a runner whose ``order`` is "method" (zoo.et_runtime.MethodRunner: the runtime
    reorders for the .so itself) gets the method's inputs as they are, all of them, and its outputs as they come.
    Everything else in verification's loop (seeds, sizes, inputs, references, tolerances) runs unchanged."""
    original = verify.run_in_delegate_order

    def run(runner, order, inputs):
        if getattr(runner, "order", None) == "method":
            return [t.to(device) for t in runner.run(list(inputs))]
        return original(runner, order, inputs)

    verify.run_in_delegate_order = run
    try:
        yield
    finally:
        verify.run_in_delegate_order = original


def verify_both(run_dir: Path, recipe, runner: Path, device: str = "cuda") -> Dict[str, Any]:
    out: Dict[str, Any] = {"run": str(run_dir), "recipe": recipe.name}
    try:
        aoti = verify.verify_artifact(run_dir, recipe, raise_on_failure=False, try_executorch=False)
        out["aoti_rows"] = [r.__dict__ for r in aoti.rows]
    except ZooError as exc:
        out["aoti_error"] = str(exc)
    ptd = run_dir / PTD_NAME
    try:
        with et_runtime.RuntimeSession(run_dir / PTE_NAME, ptd if ptd.exists() else None, executable=runner,
                                       methods=list(recipe.unit.methods)) as session:
            out["executorch_runtime"] = et_runtime.describe(session.build)
            out["executorch_load"] = {k: session.ready.get(k) for k in
                                      ("load_ms", "gpu_loaded_mib", "gpu_used_mib_after_load", "gpu",
                                       "weight_sharing_across_methods")}

            with _method_order_runners(device):
                et = verify.verify_artifact(run_dir, recipe, raise_on_failure=False, try_executorch=False,
                                            runner_factory=lambda method, so, weights, device: session.runner(method))
            for r in et.rows:
                r.runtime = "executorch"
            out["executorch_rows"] = [r.__dict__ for r in et.rows]
    except ZooError as exc:
        out["executorch_error"] = str(exc)
    out["audit"] = audit_agreement(run_dir, runner, ran="executorch_error" not in out)
    return out


def audit_agreement(run_dir: Path, runner: Path, ran: bool) -> Dict[str, Any]:
    """The symbol audit's prediction for the runtime release zoo_runner was built from, next to what running it
    showed. A disagreement either way is a finding (the audit or the artifact needs fixing)."""
    from zoo.audit import audit_artifact

    version = str(et_runtime.runner_info(runner).get("executorch_version", ""))
    release = ".".join(version.split(".")[:2])
    audit = audit_artifact(run_dir)
    if release not in audit.releases:
        return {"release": release, "verdict": f"the audit has no release {release}; ran: {ran}", "agrees": None}
    predicted = audit.loadable(release)
    missing = sorted({s for m in audit.methods for s in m.missing[release]})
    if predicted and ran:
        verdict = f"{release}: loadable by the audit, and tested by running"
    elif not predicted and not ran:
        verdict = f"{release}: not loadable by the audit (missing {', '.join(missing)}), and it did not run: agrees"
    elif predicted:
        verdict = f"FINDING {release}: the audit calls it loadable, and it failed to run"
    else:
        verdict = f"FINDING {release}: the audit says not loadable (missing {', '.join(missing)}), and it ran"
    return {"release": release, "predicted_loadable": predicted, "ran": ran, "missing": missing,
            "agrees": predicted == ran, "verdict": verdict}


# --- LingBot-VA: the KV pool through the host over a sequence ----------------------------------------------------------


def pool_sequence(run_dir: Path, recipe, runner: Path, steps: int, device: str = "cuda",
                  require_cuda: bool = True) -> Dict[str, Any]:
    """video_step/action_step alternating, each call's ``X_next`` outputs fed to the next call's ``X`` inputs,
    in one zoo_runner process; the exported programs run eagerly with the same feeding are the reference."""
    io_spec = json.loads((run_dir / "io_spec.json").read_text())
    per_method = io_spec.get("methods", io_spec)
    methods = list(recipe.unit.methods)
    specs = {m: [InputSpec(**d) for d in per_method[m]["inputs"]] for m in methods}
    outputs = {m: list(per_method[m]["outputs"]) for m in methods}
    # input i of method m takes the previous call's output named "<input name>_next" (k_pool <- k_pool_next)
    stateful = {m: [i for i, spec in enumerate(specs[m]) if spec.name + "_next" in outputs[m]] for m in methods}
    if not all(stateful.values()):
        return {"skipped": f"{recipe.name}: no method passes state in and out (X -> X_next); layout is not io"}
    order = [methods[s % len(methods)] for s in range(steps)]

    def source(s: int, i: int) -> int:
        return outputs[order[s - 1]].index(specs[order[s]][i].name + "_next")

    sizes = verify.size_cases(io_spec, recipe)[0]
    drawn = []
    for s, m in enumerate(order):
        used = {d: sizes[d] for spec in specs[m] for d in spec.shape if isinstance(d, str)}
        drawn.append(verify.draw_inputs(specs[m], used, seed=s, method=m))
    low = recipe.unit.dtype == "bfloat16"
    plan = []
    for s, m in enumerate(order):
        inputs: List[Any] = list(drawn[s])
        for i in stateful[m]:  # zero state to start with, as the host does (the pool is zero-initialised)
            inputs[i] = torch.zeros_like(drawn[s][i]) if s == 0 else (s - 1, source(s, i))
        plan.append((m, inputs))
    result = et_runtime.run_plan(run_dir / PTE_NAME, run_dir / PTD_NAME if (run_dir / PTD_NAME).exists() else None,
                                 plan, executable=runner, require_cuda=require_cuda)

    def eager_chain(kind: str, cast) -> List[List[torch.Tensor]]:
        modules = {m: verify._eager_module(run_dir / f"{kind}.{m}.pt2", device) for m in methods}
        outs: List[List[torch.Tensor]] = []
        with torch.no_grad(), verify.full_fp32_precision():
            for s, m in enumerate(order):
                inputs = [cast(t).to(device) for t in drawn[s]]
                for i in stateful[m]:
                    inputs[i] = torch.zeros_like(inputs[i]) if s == 0 else outs[-1][source(s, i)]
                outs.append(verify._flat_tensors(modules[m](*inputs)))
        return outs

    want = eager_chain("exported", lambda t: t)
    want32 = eager_chain("reference_fp32", verify._to_fp32) if low else None
    rows = []
    for s, m in enumerate(order):
        got = [t.to(device) for t in result.outputs[s] if t is not None]
        judged = verify.compare_outputs(outputs[m], got, want[s], recipe.verify.tolerance,
                                        ref_fp32=want32[s] if want32 else None)
        for c, bound, facts in judged:
            rows.append({"step": s, "method": m, "output": c.name, "rel_l2": c.rel_l2, "cosine": c.cosine,
                         "max_abs": c.max_abs, "tolerance": bound, "ok": c.ok, "why": c.why})
    return {"recipe": recipe.name, "steps": order, "step_ms": result.step_ms, "rows": rows,
            "passed": all(r["ok"] for r in rows), "load_ms": result.summary.get("load_ms"),
            "gpu_loaded_mib": result.summary.get("gpu_loaded_mib")}


# --- latency and memory ------------------------------------------------------------------------------------------------


def latency(run_dir: Path, recipe, runner: Path, work: Path, warmup: int, iters: int) -> List[Dict[str, Any]]:
    """Per method, first seed and size: zoo_runner's own timing (steady clock, CUDA sync) and torch's AOTI runner
    timed the same way in this process; GPU memory after loading for each."""
    from zoo.aoti_runner import AotiRunner
    from zoo.lowering import extract_method_files
    from zoo.tensor_file import write_tensor

    io_spec = json.loads((run_dir / "io_spec.json").read_text())
    per_method = io_spec.get("methods", io_spec)
    sizes = verify.size_cases(io_spec, recipe)[0]
    seed = recipe.verify.seeds[0]
    out = []
    for m in recipe.unit.methods:
        specs = [InputSpec(**d) for d in per_method[m]["inputs"]]
        used = {d: sizes[d] for spec in specs for d in spec.shape if isinstance(d, str)}
        inputs = verify.draw_inputs(specs, used, seed, m)
        files = [str(write_tensor(work / f"{m}.in{i}.zt", t)) for i, t in enumerate(inputs)]
        cmd = [str(runner), "--model", str(run_dir / PTE_NAME), "--method", m, "--inputs", ",".join(files),
               "--load", m, "--warmup", str(warmup), "--iters", str(iters)]
        if (run_dir / PTD_NAME).exists():
            cmd += ["--data", str(run_dir / PTD_NAME)]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
        summary = et_runtime._last_json(proc.stdout) or {}
        row = {"method": m, "sizes": used, "executorch": {k: summary.get(k) for k in
                                                          ("ok", "error", "median_ms", "p90_ms", "gpu_loaded_mib")}}
        if proc.returncode != 0:
            row["executorch"]["log_tail"] = et_runtime._tail(proc.stderr, 15)
        # torch's AOTI runner on the same .so and weights, timed the same way
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        shipped = extract_method_files(run_dir / PTE_NAME, run_dir / PTD_NAME, work / f"so-{m}")
        aoti = AotiRunner(shipped[m]["so"], shipped[m]["weights"])
        torch.cuda.synchronize()
        loaded_mib = (free_before - torch.cuda.mem_get_info()[0]) / 2**20
        order = load_io_order(run_dir, m)
        cuda_inputs = [t.cuda() for t in inputs]
        times = []
        for i in range(warmup + iters):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            verify.run_in_delegate_order(aoti, order, cuda_inputs)
            torch.cuda.synchronize()
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        row["aoti"] = {"median_ms": (times[(iters - 1) // 2] + times[iters // 2]) / 2,
                       "p90_ms": times[max(0, math.ceil(0.9 * iters) - 1)], "gpu_loaded_mib": loaded_mib}
        del aoti
        out.append(row)
    return out


# --- the table ---------------------------------------------------------------------------------------------------------


def _worst(rows: List[Dict[str, Any]]) -> Dict[tuple, Dict[str, Any]]:
    """Per (method, seed, sizes): the worst relative L2 and cosine over the outputs, and whether all passed."""
    out: Dict[tuple, Dict[str, Any]] = {}
    for r in rows:
        key = (r["method"], r["seed"], verify._sizes_text(r["sizes"]))
        w = out.setdefault(key, {"rel_l2": 0.0, "cosine": 1.0, "ok": True, "why": ""})
        w["rel_l2"] = max(w["rel_l2"], r["rel_l2"]) if not math.isnan(r["rel_l2"]) else math.nan
        w["cosine"] = min(w["cosine"], r["cosine"])
        if not r["ok"]:
            w["ok"], w["why"] = False, f"{r['output']}: {r['why']}"
    return out


def table(results: List[Dict[str, Any]]) -> str:
    lines = []
    rows = [["recipe", "method", "seed", "sizes", "aoti rel L2", "aoti cos", "ET rel L2", "ET cos", "result"]]
    for res in results:
        a, e = _worst(res.get("aoti_rows", [])), _worst(res.get("executorch_rows", []))
        for key in sorted(set(a) | set(e), key=str):
            ra, re_ = a.get(key), e.get(key)
            fmt = lambda w, f: "-" if w is None else (f"{w['rel_l2']:.2e}" if f == "l2" else f"{w['cosine']:.6f}")
            ok = all(w is not None and w["ok"] for w in (ra, re_))
            why = "; ".join(w["why"] for w in (ra, re_) if w is not None and not w["ok"])
            rows.append([res["recipe"], key[0], key[1], key[2], fmt(ra, "l2"), fmt(ra, "cos"), fmt(re_, "l2"),
                         fmt(re_, "cos"), "ok" if ok else "FAIL " + (why or "(missing)")])
        for side in ("aoti_error", "executorch_error"):
            if side in res:
                rows.append([res["recipe"], "(all)", "-", "-", "", "", "", "", f"{side}: {res[side].splitlines()[0]}"])
    lines.append(format_table(rows))
    for res in results:
        if "executorch_runtime" in res:
            lines.append(f"{res['recipe']}: {res['executorch_runtime']}; load {res['executorch_load']}")
        if res.get("audit"):
            lines.append(f"{res['recipe']} audit vs running: {res['audit']['verdict']}")
        for side in ("aoti_error", "executorch_error"):
            if side in res:
                lines.append(f"{res['recipe']} {side}:\n{res[side]}")
        seq = res.get("sequence")
        if seq and "rows" in seq:
            srows = [["step", "method", "output", "rel L2", "cosine", "tol", "result"]]
            for r in seq["rows"]:
                srows.append([r["step"], r["method"], r["output"], f"{r['rel_l2']:.2e}", f"{r['cosine']:.6f}",
                              f"{r['tolerance']:.1e}", "ok" if r["ok"] else "FAIL " + r["why"]])
            lines.append(f"{res['recipe']}: KV pool through the host, {len(seq['steps'])} calls in one zoo_runner "
                         f"process (per call ms: {', '.join(f'{t:.2f}' for t in seq['step_ms'])})\n"
                         + format_table(srows))
        elif seq:
            lines.append(f"{res['recipe']} sequence: {seq.get('skipped') or seq.get('error')}")
        for row in res.get("latency", []):
            lines.append(f"{res['recipe']} {row['method']} latency: ExecuTorch {row['executorch']}, AOTI {row['aoti']}")
    return "\n".join(lines)


def passed(res: Dict[str, Any]) -> bool:
    """Both runners matched eager, or the ExecuTorch runtime failed exactly where the audit said it would."""
    audit = res.get("audit", {})
    expected_failure = "executorch_error" in res and audit.get("agrees") is True
    rows = res.get("aoti_rows", []) + ([] if expected_failure else res.get("executorch_rows", []))
    seq = res.get("sequence")
    seq_ok = seq is None or "skipped" in seq or seq.get("passed") is True or (expected_failure and "error" in seq)
    return (bool(rows) and all(r["ok"] for r in rows) and "aoti_error" not in res and seq_ok
            and ("executorch_error" not in res or expected_failure) and audit.get("agrees") is not False)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dirs", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--runner", help=f"a built zoo_runner (default ${et_runtime.RUNNER_ENV})")
    p.add_argument("--build-from", help="ExecuTorch source tarball or tree to build the runtime from")
    p.add_argument("--build-dir", type=Path, default=REPO / "build" / "runtime")
    p.add_argument("--steps", type=int, default=4, help="calls in the LingBot-VA pool sequence (>= 3)")
    p.add_argument("--latency", action="store_true", help="also time each method through both runners")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("[gpu_runtime_check] needs a CUDA device", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    report: Dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    if args.build_from and not args.runner:
        report["build"] = build_runner(args.build_from, args.build_dir.resolve())
        args.runner = report["build"]["runner"]
    runner = et_runtime.find_runner(args.runner)
    report["runner_info"] = et_runtime.runner_info(runner)
    results = []
    for run_dir in args.run_dirs:
        recipe = load_run_recipe(run_dir)
        print(f"[gpu_runtime_check] {recipe.name}: both runners at seeds {list(recipe.verify.seeds)}", file=sys.stderr)
        res = verify_both(run_dir, recipe, runner)
        if recipe.family == "lingbot_va":
            try:
                res["sequence"] = pool_sequence(run_dir, recipe, runner, max(3, args.steps))
            except Exception as exc:  # recorded and shown: a failure here is a finding, not a crash of the check
                res["sequence"] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        if args.latency:
            try:
                res["latency"] = latency(run_dir, recipe, runner, args.out / f"latency-{recipe.name}", args.warmup,
                                         args.iters)
            except Exception as exc:
                res["latency_error"] = f"{type(exc).__name__}: {exc}"
        res["passed"] = passed(res)
        results.append(res)
    report["results"] = results
    text = table(results)
    if "build" in report:
        b = report["build"]
        text = (f"runtime build: {b['this_call']}; first build {b['seconds']} s ({b['ninja_steps']} steps, "
                f"{b['jobs']} jobs, cmake {b['cmake']}, nvcc {b['nvcc']}, torch {b['torch']})\n") + text
    text = f"zoo_runner: {et_runtime.describe(report['runner_info'])}\n" + text
    print(text)
    (args.out / "runtime_check.txt").write_text(text + "\n")
    (args.out / "runtime_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    return 0 if results and all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
