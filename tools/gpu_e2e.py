#!/usr/bin/env python3
"""The whole end-to-end check on a CUDA machine, in one command, ending with one table.

    python tools/gpu_e2e.py --out OUT_DIR [--part tiny|smollm|tests|all] [--jobs N]

tiny:   the three tiny recipes, each with rotary_pairs=float32 and float64, through `python -m zoo.export`
        (pull, export, rewrite, CPU check, preflight, lower, audit, verify); then a broken artifact (a run's
        aoti_cuda_blob.ptd swapped for the one of a run with other weights) must fail verification.
smollm: the llama-rope recipe at SmolLM2-135M size with fabricated random weights, bf16, verified at sequence
        lengths 7, 33 and 300 from one artifact.
tests:  the GPU-marked pytest modules (tests/gpu).
Writes OUT_DIR/e2e.json and e2e.md, and each run's report.md as OUT_DIR/<run>.report.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Dict, List

from zoo.contract.run_folder import RunFolder
from zoo.core.report import format_table, markdown_table

ROOT = Path(__file__).resolve().parent.parent  # the checkout: the commands run there, run folders go to ROOT/runs

TINY = ("llama-rope-tiny", "lingbot-va-tiny", "fast-wam-tiny")
STAGES = ("export", "rewrite", "cpu_check", "preflight", "lower", "audit", "verify")


def run_export(name: str, recipe: str, overrides: List[str], runs: Path, timeout: int) -> Dict:
    out = runs / name
    cmd = [sys.executable, "-m", "zoo.export", recipe, *overrides, "--output-dir", str(out)]
    return _run(name, cmd, runs / f"{name}.log", timeout, out)


def _run(name: str, cmd: List[str], log: Path, timeout: int, run_dir: Path) -> Dict:
    start = time.perf_counter()
    with open(log, "w") as fh:
        try:
            rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return {"name": name, "cmd": " ".join(cmd[1:]), "rc": rc, "wall_s": round(time.perf_counter() - start, 1),
            **summarise(run_dir)}


def summarise(run_dir: Path) -> Dict:
    """The latest word on a run: its own report, or the report of a newer attempt kept beside it (a re-run that
    failed leaves the earlier run in place and its own report in attempts/)."""
    run = RunFolder(run_dir)
    run = run.latest_attempt() or run
    if not run.is_run():
        return {"stages": {}, "verdict": "no report"}
    data = run.read_report().data
    stages = {s["stage"]: (s["status"], s.get("seconds")) for s in data.get("stages", [])}
    ver = data.get("verification") or {}
    rows = ver.get("rows") or []
    worst = max((r["rel_l2"] for r in rows), default=None)
    audit = data.get("audit") or {}
    lowering = data.get("lowering") or {}
    return {
        "stages": stages,
        "verdict": "passed" if ver.get("passed") else ("FAILED" if ver else data.get("status", "?")),
        "worst_rel_l2": worst,
        "min_cosine": min((r["cosine"] for r in rows), default=None),
        "rows": len(rows),
        "loadable": [r for r, v in (audit.get("releases") or {}).items() if v.get("loadable")],
        "pte_bytes": lowering.get("pte_bytes"), "ptd_bytes": lowering.get("ptd_bytes"),
        "error": (data.get("error") or {}).get("message"),
    }


def broken_artifact(runs: Path, good: str, other: str, out_name: str, timeout: int) -> Dict:
    """A good run whose weights blob is swapped for another run's must fail verification (exit 3)."""
    broken = runs / out_name
    shutil.rmtree(broken, ignore_errors=True)
    shutil.copytree(runs / good, broken)
    shutil.copyfile(RunFolder(runs / other).ptd, RunFolder(broken).ptd)
    cmd = [sys.executable, "-m", "zoo", "lower", str(broken), "--verify-only"]
    result = _run(out_name, cmd, runs / f"{out_name}.log", timeout, broken)
    result["expected"] = "exit 3 (verification failed)"
    result["as_expected"] = result["rc"] == 3
    return result


def table(results: List[Dict]) -> List[List[str]]:
    rows = [["run", "rc", *STAGES, "verify result", "worst rel L2", "min cos", "loads on", "pte MB", "ptd MB"]]
    for r in results:
        st = r.get("stages", {})
        cells = []
        for s in STAGES:
            status, secs = st.get(s, ("-", None))
            cells.append(status if secs is None else f"{status} {secs:.0f}s")
        mb = lambda b: "" if not b else f"{b / 1e6:.1f}"  # noqa: E731
        worst = r.get("worst_rel_l2")
        rows.append([r["name"], str(r["rc"]), *cells, r.get("verdict", ""),
                     "" if worst is None else f"{worst:.2e}",
                     "" if r.get("min_cosine") is None else f"{r['min_cosine']:.6f}",
                     ",".join(r.get("loadable") or []) or ("none" if r.get("stages", {}).get("audit") else ""),
                     mb(r.get("pte_bytes")), mb(r.get("ptd_bytes"))])
    return rows


def run_tiny(args: argparse.Namespace, results: List[Dict], save: Callable[[], None]) -> None:
    """The tiny recipes at each rotary_pairs value, side by side, then the broken-artifact check."""
    jobs = [(f"{r}.{p}", r, [f"rotary_pairs={p}"]) for r in args.recipes for p in args.pairs]
    if "llama-rope-tiny" in args.recipes:  # the other weights for the broken-artifact check
        jobs.append(("llama-rope-tiny.seed1", "llama-rope-tiny", ["rotary_pairs=float32", "source.seed=1"]))
    with ThreadPoolExecutor(args.jobs) as pool:
        for res in pool.map(lambda j: run_export(*j, args.runs, args.timeout), jobs):
            results.append(res)
            print(f"[e2e] {res['name']}: rc={res['rc']} {res['verdict']} in {res['wall_s']} s", flush=True)
            save()
    if (args.runs / "llama-rope-tiny.float32").exists():
        results.append(broken_artifact(args.runs, "llama-rope-tiny.float32", "llama-rope-tiny.seed1",
                                       "broken-weights", args.timeout))
    save()


def run_gpu_tests(out: Path, timeout: int) -> Dict:
    """pytest tests/gpu, its log saved beside the results; the result row with each test's outcome."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu", "-rA"],
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    (out / "gpu_tests.log").write_text(proc.stdout + proc.stderr)
    tail = [ln for ln in proc.stdout.splitlines() if ln.startswith(("PASSED", "FAILED", "ERROR", "SKIPPED"))]
    return {"name": "pytest tests/gpu", "rc": proc.returncode, "wall_s": round(time.perf_counter() - start, 1),
            "verdict": proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "no output", "tests": tail}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", type=Path, default=ROOT / "runs")
    parser.add_argument("--part", choices=("tiny", "smollm", "tests", "all"), default="all")
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--recipes", nargs="+", default=list(TINY), help="tiny recipes to run (part tiny)")
    parser.add_argument("--pairs", nargs="+", default=["float32", "float64"], help="rotary_pairs values (part tiny)")
    parser.add_argument("--timeout", type=int, default=540)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.runs.mkdir(parents=True, exist_ok=True)
    results: List[Dict] = []
    started = time.perf_counter()

    def save() -> None:
        (args.out / "e2e.json").write_text(json.dumps({"results": results,
                                                       "wall_s": round(time.perf_counter() - started, 1)}, indent=2))

    if args.part in ("tiny", "all"):
        run_tiny(args, results, save)
    if args.part in ("smollm", "all"):
        results.append(run_export("llama-rope.smollm2-135m-random", "llama-rope", ["source.fabricate=true"],
                                  args.runs, args.timeout))
        save()
    if args.part in ("tests", "all"):
        results.append(run_gpu_tests(args.out, args.timeout))
        save()
    for r in results:
        report = RunFolder(args.runs / r["name"]).report_md
        if report.exists():
            shutil.copyfile(report, args.out / f"{r['name']}.{report.name}")
    rows = table(results)
    (args.out / "e2e.md").write_text(markdown_table(rows) + "\n")
    save()
    for r in results:
        if r.get("tests"):
            print("\n".join(r["tests"]))
        if r.get("error"):
            print(f"{r['name']}: {r['error'][:300]}")
    print(format_table(rows))
    ok = all(r["rc"] == 0 for r in results if "as_expected" not in r) and all(
        r["as_expected"] for r in results if "as_expected" in r)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
