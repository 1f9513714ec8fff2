"""``python -m zoo doctor [RUN_DIR ...]``: what this machine offers zoo, and how runs went.

Without run folders it prints the environment (GPU, compute capability, driver, torch, executorch, lerobot,
flatc) and exits non-zero if something zoo needs to lower is missing. With run folders (positional, or after
``--runs``) it prints one table over them: per run, each stage, its time, the verification result, and the
latest attempt kept beside the run when it is newer than the run. It exits 1, saying why for each, when a run
did not finish, or its latest attempt failed, or (``--require-verified``) it did not verify. A run that finished
on a CPU machine, its GPU stages skipped, is healthy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from zoo.core.errors import EXIT_CHECK_FAILED, EXIT_ERROR, EXIT_OK, exit_status_help, first_line
from zoo.core.report import format_table
from zoo.contract.run_folder import NOT_GOOD, RunFolder


def environment() -> Dict[str, object]:
    env: Dict[str, object] = {"python": platform.python_version(), "machine": platform.machine()}
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda_build"] = torch.version.cuda
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
            env["compute_capability"] = "sm_%d%d" % torch.cuda.get_device_capability(0)
            env["driver"] = _driver_version()
        else:
            env["gpu"] = None
    except ImportError:
        env["torch"] = None
    for name in ("executorch", "lerobot", "transformers", "diffusers", "huggingface_hub"):
        env[name] = _version(name)
    env["flatc"] = os.environ.get("FLATC_EXECUTABLE") or shutil.which("flatc")
    env["hf_hub_cache"] = os.environ.get("HF_HUB_CACHE")
    env["hf_hub_offline"] = os.environ.get("HF_HUB_OFFLINE")
    return env


def _version(name: str) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _driver_version() -> Optional[str]:
    try:
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int()
        lib.cuDriverGetVersion(ctypes.byref(version))
        return "%d.%d" % (version.value // 1000, (version.value % 1000) // 10)
    except OSError:
        return None


def runs_table(run_dirs: Sequence[Path], require_verified: bool = False) -> Tuple[str, List[str]]:
    """The table over ``run_dirs`` and the problems found (one line each, empty when every run is healthy)."""
    rows: List[List[object]] = [["run", "stage", "status", "time (s)", "detail"]]
    problems: List[str] = []
    for run_dir in run_dirs:
        run = RunFolder(run_dir)
        name = str(run_dir)
        if not run.report_json.exists():
            rows.append([name, "-", "no report", "", "the run did not start or was killed before writing its report"])
            problems.append(f"{name}: no {run.report_json.name}: not a zoo run, or killed before its report")
            continue
        data = run.read_report().data
        for stage in data.get("stages", []):
            secs = stage.get("seconds")
            rows.append([name, stage["stage"], stage["status"], "" if secs is None else f"{secs:.1f}",
                         stage.get("detail", "")])
        status = data.get("status")
        verification = data.get("verification") or {}
        stages = {s["stage"]: s for s in data.get("stages", [])}
        if verification:
            verdict, detail = ("passed" if verification.get("passed") else "FAILED"), verification.get("summary", "")
        elif stages.get("verify", {}).get("status") == "skipped":
            verdict, detail = "skipped", stages["verify"].get("detail", "")
        else:
            verdict, detail = "not run", ""
        rows.append([name, "verification", verdict, "", detail])
        error = (data.get("error") or {}).get("message", "")
        if status in NOT_GOOD:
            problems.append(f"{name}: {status}" + (f" during {data.get('failed_stage')}" if data.get("failed_stage")
                                                   else "") + (f": {first_line(error)}" if error else ""))
        elif require_verified and verdict != "passed":
            problems.append(f"{name}: not verified (verification {verdict}{f': {detail}' if detail else ''})")
        attempt = run.latest_attempt()
        if attempt is not None:
            adata = attempt.read_report().data
            astatus = adata.get("status", "?")
            rows.append([name, "latest attempt", astatus, "", f"{attempt.path} "
                         f"({first_line((adata.get('error') or {}).get('message', '') or (adata.get('placement') or {}).get('reason', ''))})"])
            if astatus in NOT_GOOD:
                problems.append(f"{name}: its latest attempt ({attempt.path}) {astatus}"
                                + (f" during {adata.get('failed_stage')}" if adata.get("failed_stage") else "")
                                + "; the run itself is the earlier one")
    return format_table(rows), problems


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m zoo doctor", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=exit_status_help([EXIT_OK, EXIT_CHECK_FAILED, EXIT_ERROR], {
            EXIT_OK: "the environment has what zoo needs / every run given is healthy",
            EXIT_CHECK_FAILED: "a run did not finish, its latest attempt failed, or (--require-verified) it did "
                               "not verify: one line on stderr says why for each",
            EXIT_ERROR: "torch or executorch is missing, or a RUN_DIR given is no folder"}))
    parser.add_argument("run_dirs", nargs="*", type=Path, metavar="RUN_DIR", help="run folders to summarise")
    parser.add_argument("--runs", nargs="+", type=Path, default=[], help="run folders to summarise (same as RUN_DIR)")
    parser.add_argument("--require-verified", action="store_true",
                        help="a run that did not pass verification counts as a problem (a GPU box's check)")
    parser.add_argument("--json", type=Path, help="also write the environment as JSON here")
    args = parser.parse_args(argv)

    runs = list(args.run_dirs) + list(args.runs)
    absent = [str(r) for r in runs if not r.is_dir()]
    if absent:
        print(f"error: no such run folder: {', '.join(absent)}", file=sys.stderr)
        print("  what to do: give the folder `python -m zoo.export` wrote (default runs/<recipe>)", file=sys.stderr)
        return EXIT_ERROR
    if runs:
        table, problems = runs_table(runs, args.require_verified)
        print(table)
        for problem in problems:
            print(f"problem: {problem}", file=sys.stderr)
        return EXIT_CHECK_FAILED if problems else EXIT_OK

    env = environment()
    print(format_table([["what", "value"]] + [[k, "-" if v is None else v] for k, v in env.items()]))
    if args.json:
        args.json.write_text(json.dumps(env, indent=2))
    missing = [k for k in ("torch", "executorch") if not env.get(k)]
    if missing:
        print(f"missing: {', '.join(missing)} (install zoo's bundle or `pip install zoo`)", file=sys.stderr)
        return EXIT_ERROR
    if not env.get("gpu"):
        print("no CUDA GPU: zoo can export and rewrite here, but lowering and verification need one",
              file=sys.stderr)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
