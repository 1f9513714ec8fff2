"""Lowered run folders through ExecuTorch's C++ runtime (zoo_runner) next to torch's AOTI runner, on a GPU.

    python benchmarks/gpu_runtime_check.py RUN_DIR [RUN_DIR ...] --out OUT --runner PATH
        [--from-report | --no-verify] [--steps 3] [--latency METHOD ...] [--warmup 3] [--iters 20] [--memory]

What each check does, the files it writes and its exit status: benchmarks/README.md, "gpu_runtime_check.py".
"""

from __future__ import annotations

import argparse
import json
import os
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

import torch  # noqa: E402

from zoo.runtimes import executorch as et_runtime
from zoo.export import verify  # noqa: E402
from zoo.contract.artifact import extract_method_files  # noqa: E402
from zoo.core.errors import ZooError  # noqa: E402
from zoo.core.report import format_table  # noqa: E402
from zoo.contract.run_folder import RunFolder  # noqa: E402
from zoo.export.runtime_sequence import (IO_MODES, io_positions, method_inputs, pool_sequence,  # noqa: E402
                                         result_passed, state_positions, summary_rows)
from zoo.contract.tensor_file import write_tensor  # noqa: E402
from zoo.export.verify_runtimes import choose_runtimes  # noqa: E402

# --- 1. verification on both runtimes ----------------------------------------------------------------------------------


def verify_both(run: RunFolder, recipe, runner: Path) -> Dict[str, Any]:
    """zoo.export.verify over both runtimes; what report.json's "verification" holds (rows, runtimes, notes)."""
    choice = choose_runtimes(["aoti", "executorch"], runner)
    return verify.verify_artifact(run, recipe, runtimes=choice, raise_on_failure=False).as_dict()


def verification_from_report(run: RunFolder) -> Dict[str, Any]:
    report = json.loads(run.report_json.read_text())
    if "verification" not in report:
        raise ZooError(f"{run.report_json} has no verification (the run failed or was not verified)",
                       "run it again without --from-report, or export it again with --runtime both")
    return report["verification"]


# --- latency and GPU memory after loading --------------------------------------------------------------------------------


def _percentiles(times: List[float]) -> Dict[str, float]:
    times = sorted(times)
    n = len(times)
    return {"median_ms": (times[(n - 1) // 2] + times[n // 2]) / 2, "p90_ms": times[max(0, math.ceil(0.9 * n) - 1)]}


def et_latency(run: RunFolder, method: str, runner: Path, files: List[str], n_out: int, mode: str,
               state: Dict[str, List[int]], warmup: int, iters: int) -> Dict[str, Any]:
    """One zoo_runner process: ``method`` alone loaded, timed by the runner itself in one I/O mode."""
    on_gpu, kept = io_positions(mode, state, len(files), n_out)
    cmd = [str(runner), "--model", str(run.pte), "--method", method, "--inputs", ",".join(files),
           "--load", method, "--warmup", str(warmup), "--iters", str(iters),
           "--device-inputs", ",".join(map(str, on_gpu)) or "none", "--keep-outputs", ",".join(map(str, kept)) or "none"]
    if run.ptd.exists():
        cmd += ["--data", str(run.ptd)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=900)
    summary = et_runtime._last_json(proc.stdout) or {}
    row = {k: summary.get(k) for k in ("ok", "error", "load_ms", "median_ms", "p90_ms", "median_execute_ms",
                                       "median_io_ms", "gpu_loaded_mib", "gpu_used_mib_peak", "host_copies",
                                       "weight_sharing_across_methods", "memory_planned")}
    row.update(process_s=round(time.perf_counter() - t0, 1), device_inputs=on_gpu, kept_outputs=kept)
    if proc.returncode != 0 or not summary.get("ok"):
        row["ok"] = False
        row["log_tail"] = et_runtime._tail(proc.stderr, 15)
    return row


def aoti_latency(run: RunFolder, method: str, inputs: List[torch.Tensor], state: Dict[str, List[int]],
                 work: Path, warmup: int, iters: int) -> Dict[str, Dict[str, Any]]:
    """torch's AOTI runner over the same .so and weights in this process, timed the same way in each I/O mode:
    inputs not on the GPU are copied from host memory in each call, outputs not kept are copied back."""
    from zoo.runtimes.aoti import AotiRunner, run_in_delegate_order

    so, weights = run.so_file(method), run.weights_file(method)
    if not so.exists():  # the shipped ones, out of the .pte/.ptd, as verification does
        shipped = extract_method_files(run.pte, run.ptd, work / "shipped", methods=[method])[method]
        so, weights = shipped["so"], shipped["weights"]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0]
    t0 = time.perf_counter()
    aoti = AotiRunner(so, weights if weights is not None and Path(weights).exists() else None)
    torch.cuda.synchronize()
    loaded = {"ok": True, "load_ms": (time.perf_counter() - t0) * 1e3,
              "gpu_loaded_mib": (free_before - torch.cuda.mem_get_info()[0]) / 2**20}
    order = run.io_order(method)
    n_out = len(order["output_order"])
    rows = {}
    for mode in IO_MODES:
        on_gpu, kept = io_positions(mode, state, len(inputs), n_out)
        staged = [t.cuda() if i in on_gpu else t for i, t in enumerate(inputs)]

        def call() -> None:
            outs = run_in_delegate_order(aoti, order, [t.cuda() for t in staged])
            for k, t in enumerate(outs):
                if k not in kept:
                    t.cpu()

        times = []
        for i in range(warmup + iters):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            call()
            torch.cuda.synchronize()
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        rows[mode] = {**(loaded if mode == "device" else {"ok": True}), **_percentiles(times),
                      "device_inputs": on_gpu, "kept_outputs": kept}
        del staged
    del aoti
    torch.cuda.empty_cache()
    return rows


def latency(run: RunFolder, recipe, method: str, runner: Path, work: Path, warmup: int, iters: int) -> Dict[str, Any]:
    """One method on zoo_runner and on torch's AOTI runner, each in every I/O mode (``IO_MODES``)."""
    used, seed, inputs = method_inputs(run, recipe, method)
    state = state_positions(run, method)
    row: Dict[str, Any] = {"method": method, "seed": seed, "sizes": used, "warmup": warmup, "iters": iters,
                           "state": state}
    files = [str(write_tensor(work / f"{method}.in{i}.zt", t)) for i, t in enumerate(inputs)]
    n_out = len(run.read_io_spec().methods[method].outputs)
    for mode in IO_MODES:
        row[f"executorch_{mode}"] = et_latency(run, method, runner, files, n_out, mode, state, warmup, iters)
    for f in files:
        Path(f).unlink(missing_ok=True)
    for mode, r in aoti_latency(run, method, inputs, state, work, warmup, iters).items():
        row[f"aoti_{mode}"] = r
    return row


def load_memory(run: RunFolder, runner: Path, methods: Sequence[str]) -> Dict[str, Any]:
    """Every method loaded in one zoo_runner (a plan that ends at once), with and without weight sharing: the GPU
    memory each took, against the .ptd and the sum of the methods' weights blobs."""
    from zoo.contract.artifact import read_ptd_entries

    entries = read_ptd_entries(run.ptd) if run.ptd.exists() else []
    blobs = {e.key: e.size for e in entries if e.key.endswith("_weights_blob")}
    record: Dict[str, Any] = {"methods": list(methods), "ptd_mib": run.ptd.stat().st_size / 2**20 if entries else 0,
                              "blobs_mib": sum(blobs.values()) / 2**20}
    for label, extra in (("shared", []), ("own_copy", ["--no-weight-sharing"])):
        cmd = [str(runner), "--model", str(run.pte), "--plan", "-", *extra]
        if run.ptd.exists():
            cmd += ["--data", str(run.ptd)]
        proc = subprocess.run(cmd, input="quit\n", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              timeout=900)
        summary = et_runtime._last_json(proc.stdout) or {}
        record[label] = {k: summary.get(k) for k in ("ok", "error", "load_ms", "gpu_loaded_mib",
                                                     "weight_sharing_across_methods")}
        if proc.returncode != 0 or not summary.get("ok"):
            record[label].update(ok=False, log_tail=et_runtime._tail(proc.stderr, 15))
    return record


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
            how = ("inside the methods, shared by the runtime" if seq.get("layout") == "buffer"
                   else "handed from call to call")
            lines.append(f"{res['recipe']}: KV pool {how}, {len(seq['steps'])} calls in one zoo_runner "
                         f"process vs eager ({'passed' if seq['passed'] else 'FAILED'}; per call ms: "
                         f"{', '.join(f'{t:.2f}' for t in seq['step_ms'])})\n" + format_table(srows))
        elif seq:
            lines.append(f"{res['recipe']} KV sequence: {seq.get('skipped') or seq.get('error')}")
        lines += latency_lines(res)
        check = res.get("policy_check")
        if check:
            words = check.get("skipped") or ("passed" if check.get("ok") else f"FAILED {check.get('error', '')}")
            lines.append(f"{res['recipe']}: policy check, zoo.runner on backend=executorch vs LeRobot: {words}"
                         + (f"\n{check['table']}" if check.get("table") else ""))
        memory = res.get("memory")
        if memory:
            mrows = [["every method loaded", "GPU MiB after loading", "load ms", "ok"]]
            for label, words in (("shared", "weights shared across methods"), ("own_copy", "each method its own copy")):
                r = memory.get(label, {})
                mrows.append([words, _num(r.get("gpu_loaded_mib")), _num(r.get("load_ms")),
                              "yes" if r.get("ok") else f"no: {r.get('error', '')}"])
            lines.append(f"{res['recipe']}: {', '.join(memory['methods'])} in one zoo_runner; the .ptd holds "
                         f"{memory['ptd_mib']:.0f} MiB, the methods' weights blobs {memory['blobs_mib']:.0f} MiB together "
                         f"({memory.get('shared', {}).get('weight_sharing_across_methods', '?')})\n"
                         + format_table(mrows))
            for label in ("shared", "own_copy"):
                if memory.get(label, {}).get("log_tail"):
                    lines.append("zoo_runner's log:\n" + memory[label]["log_tail"])
        for key in ("latency_error", "verification_error", "memory_error"):
            if key in res:
                lines.append(f"{res['recipe']} {key}: {res[key]}")
    lines.append("RESULT: " + ("passed" if report["passed"] else "FAILED"))
    return "\n".join(lines)


def latency_lines(res: Dict[str, Any]) -> List[str]:
    """Per timed method: one row per runner and I/O mode (``IO_MODES``)."""
    lines = []
    words = {"device": "all inputs on the GPU, all outputs left there", "state": "state on the GPU, the rest host",
             "host_io": "every input from the host, every output back"}
    for row in res.get("latency", []):
        # The peak over every call against what loading took: memory that grows with the calls is a leak (ExecuTorch
        # 1.2 as released kept every call's outputs: ~1.8 GB a LingBot-VA DiT call).
        lrows = [["runner", "I/O in each call", "median ms", "p90 ms", "execute ms", "load ms", "GPU MiB after loading",
                  "GPU MiB peak", "ok"]]
        for runner in ("executorch", "aoti"):
            for mode in IO_MODES:
                r = row.get(f"{runner}_{mode}", {})
                lrows.append([runner, words[mode], _num(r.get("median_ms"), ".3f"), _num(r.get("p90_ms"), ".3f"),
                              _num(r.get("median_execute_ms"), ".3f"), _num(r.get("load_ms")),
                              _num(r.get("gpu_loaded_mib")), _num(r.get("gpu_used_mib_peak")),
                              "yes" if r.get("ok") else f"no: {r.get('error', '')}"])
        state = row.get("state", {})
        lines.append(f"{res['recipe']} {row['method']} at seed {row['seed']}, sizes {row['sizes']}: {row['warmup']} "
                     f"warm-up + {row['iters']} timed calls; state inputs {state.get('inputs')}, state outputs "
                     f"{state.get('outputs')}\n" + format_table(lrows))
        for mode in IO_MODES:
            if row.get(f"executorch_{mode}", {}).get("log_tail"):
                lines.append(f"zoo_runner's log ({mode}):\n" + row[f"executorch_{mode}"]["log_tail"])
    return lines


def _num(value: Any, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def executorch_policy_check(run: RunFolder, recipe, verification: Optional[Dict[str, Any]], say) -> Dict[str, Any]:
    """zoo.runner on backend="executorch" against LeRobot's policy on the GPU (the pipeline's GPU policy check with
    the other backend); ``skipped`` with the reason where it cannot run."""
    from zoo.export.policy_check import checkpoint_in_reach, check_run as policy_check_run, why_skipped

    status = ((verification or {}).get("runtimes") or {}).get("executorch", {}).get("status")
    reason = why_skipped(recipe, "gpu") or (
        "the ExecuTorch runtime cannot load this artifact (verification: expected)" if status == verify.EXPECTED
        else None)
    if reason:
        return {"skipped": reason}
    say("policy check with zoo.runner on backend=executorch against LeRobot")
    try:
        with checkpoint_in_reach(recipe) as folder:
            result = policy_check_run(run, recipe, folder, backend="executorch", device="cuda")
        return {"ok": result.ok, "table": result.table(), "result": result.as_dict()}
    except Exception as exc:  # recorded: a failure here is a finding
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


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
    methods = list(recipe.unit.methods) if recipe is not None else list(run.read_io_spec().methods)
    wanted = methods if "all" in args.latency else args.latency
    res["latency"] = []
    for method in wanted:
        say(f"latency of {method}: {args.warmup} warm-up + {args.iters} timed calls on each runner")
        try:
            res["latency"].append(latency(run, recipe, method, runner, work, args.warmup, args.iters))
        except Exception as exc:
            res["latency_error"] = f"{method}: {type(exc).__name__}: {exc}"
    if args.policy_check and has_programs:
        res["policy_check"] = executorch_policy_check(run, recipe, res.get("verification"), say)
    if args.memory:
        say("GPU memory with every method loaded, weights shared and not")
        try:
            res["memory"] = load_memory(run, runner, list(run.read_io_spec().methods))
        except Exception as exc:
            res["memory_error"] = f"{type(exc).__name__}: {exc}"
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
    p.add_argument("--policy-check", action="store_true",
                   help="zoo's policy check with the runner on backend=executorch against LeRobot (needs lerobot)")
    p.add_argument("--memory", action="store_true",
                   help="GPU memory with every method loaded, weights shared across methods and not")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--work", type=Path, default=None, help="temporary files (default: the system's temp folder)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("[gpu_runtime_check] needs a CUDA device", file=sys.stderr)
        return 2
    if 0 < args.steps < 3:
        p.error("--steps must be 0 or at least 3 (a median needs at least 3 timed calls)")
    try:
        runner = et_runtime.find_runner(args.runner)
        info = et_runtime.runner_info(runner)
    except ZooError as exc:
        print(f"[gpu_runtime_check] {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ[et_runtime.RUNNER_ENV] = str(runner)  # zoo.runner's executorch backend (--policy-check) finds it here
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
