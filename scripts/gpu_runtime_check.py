"""Lowered run folders through ExecuTorch's C++ runtime (zoo_runner) next to torch's AOTI runner, on a GPU.

    python scripts/gpu_runtime_check.py RUN_DIR [RUN_DIR ...] --out OUT --runner PATH
        [--from-report | --no-verify] [--steps 3] [--latency METHOD ...] [--warmup 3] [--iters 20]

Per run folder:
1. Verification on both runtimes (zoo.verify with ``runtimes=both``: the same inputs, seeds, sizes and
   tolerances for each). ``--from-report`` reads instead what ``python -m zoo.export ... --runtime both`` already
   recorded in the run's report.json (nothing is recomputed); ``--no-verify`` skips it (a real-size run folder
   without its exported programs).
2. A LingBot-VA run in the "io" KV-pool layout (with its exported programs): ``--steps`` calls alternating
   video_step and action_step in ONE zoo_runner process (one loaded program), each call's pool outputs fed to the
   next call inside the runner, against the exported programs run eagerly with the same feeding.
3. ``--latency METHOD`` (or ``all``): that method at the first seed and size, warm-up then timed calls (median,
   p90), and the GPU memory after loading it, on the C++ runner and on torch's AOTI runner. Needs only model.pte,
   aoti_cuda_blob.ptd, io_spec.json and so/<method>.io.json: a real-size run folder lowered elsewhere will do.
One short table on stdout; everything in OUT/runtime_check.json and OUT/runtime_check.txt (nothing large: the
tensor files and extracted weights go to a temporary folder, removed at the end). Exit 0 when every check passed
(a failure of the C++ runtime that the audit predicted counts as passed, and says so), 1 when one failed, 2 for
bad arguments or no GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from zoo import et_runtime, verify  # noqa: E402
from zoo.artifact import extract_method_files  # noqa: E402
from zoo.errors import ZooError  # noqa: E402
from zoo.policies.base import InputSpec  # noqa: E402
from zoo.report import format_table  # noqa: E402
from zoo.run_folder import RunFolder  # noqa: E402
from zoo.tensor_file import write_tensor  # noqa: E402
from zoo.verify_backends import choose_runtimes  # noqa: E402

# --- 1. verification on both runtimes ----------------------------------------------------------------------------------


def verify_both(run: RunFolder, recipe, runner: Path) -> Dict[str, Any]:
    """zoo.verify over both runtimes; what report.json's "verification" holds (rows, runtimes, notes)."""
    choice = choose_runtimes(["aoti", "executorch"], runner)
    return verify.verify_artifact(run, recipe, runtimes=choice, raise_on_failure=False).as_dict()


def verification_from_report(run: RunFolder) -> Dict[str, Any]:
    report = json.loads((run.path / "report.json").read_text())
    if "verification" not in report:
        raise ZooError(f"{run.path}/report.json has no verification (the run failed or was not verified)",
                       "run it again without --from-report, or export it again with --runtime both")
    return report["verification"]


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


# --- 2. LingBot-VA: the KV pool through the host over a sequence -------------------------------------------------------


def pool_sequence(run: RunFolder, recipe, runner: Path, steps: int, device: str = "cuda",
                  require_cuda: bool = True) -> Dict[str, Any]:
    """video_step/action_step alternating, each call's ``X_next`` outputs fed to the next call's ``X`` inputs,
    in one zoo_runner process; the exported programs run eagerly with the same feeding are the reference."""
    io_spec = run.read_io_spec()
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
    result = et_runtime.run_plan(run.pte, run.ptd if run.ptd.exists() else None, plan, executable=runner,
                                 require_cuda=require_cuda)

    def eager_chain(kind: str, cast) -> List[List[torch.Tensor]]:
        modules = {m: verify._eager_module(run.program(kind, m), device) for m in methods}
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
            "passed": bool(rows) and all(r["ok"] for r in rows), "load_ms": result.summary.get("load_ms"),
            "gpu_loaded_mib": result.summary.get("gpu_loaded_mib")}


# --- 3. latency and GPU memory after loading -----------------------------------------------------------------------------


def _latency_inputs(run: RunFolder, recipe, method: str):
    io_spec = run.read_io_spec()
    per_method = io_spec.get("methods", io_spec)
    if recipe is not None:
        sizes, seed = verify.size_cases(io_spec, recipe)[0], recipe.verify.seeds[0]
    else:  # a run folder without its recipe: the smallest size of each dynamic dim, seed 0
        sizes, seed = {d: int(r["min"]) for d, r in (io_spec.get("dynamic") or {}).items()}, 0
    specs = [InputSpec(**d) for d in per_method[method]["inputs"]]
    used = {d: sizes[d] for spec in specs for d in spec.shape if isinstance(d, str)}
    return used, seed, verify.draw_inputs(specs, used, seed, method)


def _percentiles(times: List[float]) -> Dict[str, float]:
    times = sorted(times)
    n = len(times)
    return {"median_ms": (times[(n - 1) // 2] + times[n // 2]) / 2, "p90_ms": times[max(0, math.ceil(0.9 * n) - 1)]}


def latency(run: RunFolder, recipe, method: str, runner: Path, work: Path, warmup: int, iters: int) -> Dict[str, Any]:
    """One method on zoo_runner (its own timing: steady clock after a CUDA sync, only that method loaded) and on
    torch's AOTI runner in this process, timed the same way; the GPU memory each took to load it."""
    used, seed, inputs = _latency_inputs(run, recipe, method)
    row: Dict[str, Any] = {"method": method, "seed": seed, "sizes": used, "warmup": warmup, "iters": iters}
    files = [str(write_tensor(work / f"{method}.in{i}.zt", t)) for i, t in enumerate(inputs)]
    cmd = [str(runner), "--model", str(run.pte), "--method", method, "--inputs", ",".join(files),
           "--load", method, "--warmup", str(warmup), "--iters", str(iters)]
    if run.ptd.exists():
        cmd += ["--data", str(run.ptd)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=900)
    summary = et_runtime._last_json(proc.stdout) or {}
    row["executorch"] = {k: summary.get(k) for k in ("ok", "error", "load_ms", "median_ms", "p90_ms",
                                                     "gpu_loaded_mib", "weight_sharing_across_methods")}
    row["executorch"]["process_s"] = round(time.perf_counter() - t0, 1)
    if proc.returncode != 0 or not summary.get("ok"):
        row["executorch"]["ok"] = False
        row["executorch"]["log_tail"] = et_runtime._tail(proc.stderr, 15)
    for f in files:
        Path(f).unlink(missing_ok=True)

    from zoo.aoti_runner import AotiRunner

    so, weights = run.so_file(method), run.weights_file(method)
    if not so.exists():  # the shipped ones, out of the .pte/.ptd, as verification does
        shipped = extract_method_files(run.pte, run.ptd, work / "so", only=[method])[method]
        so, weights = shipped["so"], shipped["weights"]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0]
    t0 = time.perf_counter()
    aoti = AotiRunner(so, weights if weights is not None and Path(weights).exists() else None)
    torch.cuda.synchronize()
    load_ms = (time.perf_counter() - t0) * 1e3
    loaded_mib = (free_before - torch.cuda.mem_get_info()[0]) / 2**20
    order = run.io_order(method)
    cuda_inputs = [t.cuda() for t in inputs]
    times = []
    for i in range(warmup + iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        verify.run_in_delegate_order(aoti, order, cuda_inputs)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    row["aoti"] = {"ok": True, "load_ms": load_ms, **_percentiles(times), "gpu_loaded_mib": loaded_mib}
    del aoti, cuda_inputs
    torch.cuda.empty_cache()
    return row


# --- the report ----------------------------------------------------------------------------------------------------------


def text_report(report: Dict[str, Any]) -> str:
    lines = [f"zoo_runner: {report['runner']}", f"GPU: {report['gpu']}, torch {report['torch']}"]
    rows = [["recipe", "method", "runtime", "seed/sizes", "worst rel L2", "cosine", "pass"]]
    for res in report["results"]:
        if "verification" in res:
            rows += summary_rows(res["recipe"], res["verification"])
        elif "verification_error" in res:
            rows.append([res["recipe"], "(all)", "both", "-", "-", "-", "FAIL " + res["verification_error"][:80]])
    if len(rows) > 1:
        lines.append(format_table(rows))
    for res in report["results"]:
        ver = res.get("verification", {})
        agreement = ver.get("runtimes", {}).get("executorch", {}).get("audit")
        if agreement:
            lines.append(f"{res['recipe']}: runtime audit vs running: {agreement['verdict']}")
        seq = res.get("sequence")
        if seq and "rows" in seq:
            srows = [["step", "method", "output", "rel L2", "cosine", "tol", "pass"]]
            for r in seq["rows"]:
                srows.append([r["step"], r["method"], r["output"], f"{r['rel_l2']:.2e}", f"{r['cosine']:.6f}",
                              f"{r['tolerance']:.1e}", "ok" if r["ok"] else "FAIL " + r["why"]])
            lines.append(f"{res['recipe']}: KV pool through the host, {len(seq['steps'])} calls in one zoo_runner "
                         f"process vs eager ({'passed' if seq['passed'] else 'FAILED'}; per call ms: "
                         f"{', '.join(f'{t:.2f}' for t in seq['step_ms'])})\n" + format_table(srows))
        elif seq:
            lines.append(f"{res['recipe']} KV sequence: {seq.get('skipped') or seq.get('error')}")
        for row in res.get("latency", []):
            lrows = [["runner", "load ms", "median ms", "p90 ms", "GPU MiB after loading", "ok"]]
            for name in ("executorch", "aoti"):
                r = row[name]
                lrows.append([name, _num(r.get("load_ms")), _num(r.get("median_ms"), ".3f"),
                              _num(r.get("p90_ms"), ".3f"), _num(r.get("gpu_loaded_mib")),
                              "yes" if r.get("ok") else f"no: {r.get('error', '')}"])
            lines.append(f"{res['recipe']} {row['method']} at seed {row['seed']}, sizes {row['sizes']}: "
                         f"{row['warmup']} warm-up + {row['iters']} timed calls\n" + format_table(lrows))
            if row["executorch"].get("log_tail"):
                lines.append("zoo_runner's log:\n" + row["executorch"]["log_tail"])
        for key in ("latency_error", "verification_error"):
            if key in res:
                lines.append(f"{res['recipe']} {key}: {res[key]}")
    lines.append("RESULT: " + ("passed" if report["passed"] else "FAILED"))
    return "\n".join(lines)


def _num(value: Any, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def result_passed(res: Dict[str, Any]) -> bool:
    ok = "verification_error" not in res and "latency_error" not in res
    if "verification" in res:
        ok = ok and verification_passed(res["verification"])
    seq = res.get("sequence")
    if seq is not None and "skipped" not in seq:
        ok = ok and seq.get("passed") is True
    return ok and all(row[name].get("ok") for row in res.get("latency", []) for name in ("executorch", "aoti"))


def check_run(run_dir: Path, args, runner: Path, work: Path) -> Dict[str, Any]:
    run = RunFolder(run_dir)
    recipe = run.load_recipe() if run.recipe_file.exists() else None
    # the run folder's name: gpu_check.sh names a variant's folder RECIPE+f32pairs, the recipe keeps its own name
    name = run_dir.resolve().name
    res: Dict[str, Any] = {"run": str(run_dir), "recipe": name}
    say = lambda what: print(f"[gpu_runtime_check] {name}: {what}", file=sys.stderr, flush=True)  # noqa: E731
    has_programs = recipe is not None and run.program("exported", recipe.unit.methods[0]).exists()
    if not args.no_verify:
        try:
            if args.from_report:
                res["verification"] = verification_from_report(run)
            elif has_programs:
                say(f"verifying on both runtimes at seeds {list(recipe.verify.seeds)}")
                res["verification"] = verify_both(run, recipe, runner)
            else:
                res["verification_error"] = "no recipe.yaml or exported programs to verify against (--no-verify)"
        except ZooError as exc:
            res["verification_error"] = str(exc)
    if has_programs and recipe.family == "lingbot_va" and args.steps > 0:
        say(f"KV pool sequence, {args.steps} calls in one zoo_runner process")
        try:
            res["sequence"] = pool_sequence(run, recipe, runner, args.steps)
        except Exception as exc:  # recorded and shown: a failure here is a finding, not a crash of the check
            res["sequence"] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    methods = list(recipe.unit.methods) if recipe is not None else []
    wanted = methods if "all" in args.latency else args.latency
    res["latency"] = []
    for method in wanted:
        say(f"latency of {method}: {args.warmup} warm-up + {args.iters} timed calls on each runner")
        try:
            res["latency"].append(latency(run, recipe, method, runner, work, args.warmup, args.iters))
        except Exception as exc:
            res["latency_error"] = f"{method}: {type(exc).__name__}: {exc}"
    res["passed"] = result_passed(res)
    return res


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dirs", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--runner", help=f"a built zoo_runner (default ${et_runtime.RUNNER_ENV})")
    p.add_argument("--from-report", action="store_true",
                   help="take verification from each run's report.json (zoo.export --runtime both)")
    p.add_argument("--no-verify", action="store_true", help="no verification (a run folder without its programs)")
    p.add_argument("--steps", type=int, default=3, help="calls in the LingBot-VA KV pool sequence (0: none)")
    p.add_argument("--latency", nargs="*", default=[], metavar="METHOD", help="methods to time (all: every one)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--work", type=Path, default=None, help="temporary files (default: the system's temp folder)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("[gpu_runtime_check] needs a CUDA device", file=sys.stderr)
        return 2
    if 0 < args.steps < 3:
        p.error("--steps must be 0 or at least 3 (the issue asks for at least 3 calls)")
    try:
        runner = et_runtime.find_runner(args.runner)
        info = et_runtime.runner_info(runner)
    except ZooError as exc:
        print(f"[gpu_runtime_check] {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    report: Dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                              "runner": et_runtime.describe(info), "runner_info": info, "results": []}
    work = Path(tempfile.mkdtemp(prefix="zoo-runtime-check-", dir=args.work))
    try:
        for run_dir in args.run_dirs:
            report["results"].append(check_run(run_dir, args, runner, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["passed"] = bool(report["results"]) and all(r["passed"] for r in report["results"])
    text = text_report(report)
    print(text)
    (args.out / "runtime_check.txt").write_text(text + "\n")
    (args.out / "runtime_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
