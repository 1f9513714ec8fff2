"""``python -m zoo doctor [--runs RUN_DIR ...]``: what this machine offers zoo, and how runs went.

Without ``--runs`` it prints the environment (GPU, compute capability, driver, torch, executorch, lerobot,
flatc) and exits non-zero if something zoo needs to lower is missing. With ``--runs`` it prints one table
over the given run folders: per recipe, each stage, its time, and the verification result; it exits
non-zero when any run did not finish or did not verify.
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

from .report import format_table
from .run_folder import RunFolder


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


def runs_table(run_dirs: Sequence[Path]) -> Tuple[str, bool]:
    rows: List[List[object]] = [["recipe", "stage", "status", "time (s)", "detail"]]
    all_ok = True
    for run_dir in run_dirs:
        run = RunFolder(run_dir)
        name = run.name
        if not run.report_json.exists():
            rows.append([name, "-", "no report", "", "the run did not start or crashed before writing its report"])
            all_ok = False
            continue
        data = run.read_report().data
        for stage in data.get("stages", []):
            secs = stage.get("seconds")
            rows.append([name, stage["stage"], stage["status"], "" if secs is None else f"{secs:.1f}",
                         stage.get("detail", "")])
            if stage["status"] == "failed":
                all_ok = False
        verification = data.get("verification") or {}
        verdict = "passed" if verification.get("passed") else ("FAILED" if verification else "not run")
        rows.append([name, "verification", verdict, "", verification.get("summary", "")])
        if verdict != "passed":
            all_ok = False
    return format_table(rows), all_ok


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zoo doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", type=Path, help="run folders to summarise")
    parser.add_argument("--json", type=Path, help="also write the environment as JSON here")
    args = parser.parse_args(argv)

    if args.runs:
        table, ok = runs_table(args.runs)
        print(table)
        return 0 if ok else 1

    env = environment()
    print(format_table([["what", "value"]] + [[k, "-" if v is None else v] for k, v in env.items()]))
    if args.json:
        args.json.write_text(json.dumps(env, indent=2))
    missing = [k for k in ("torch", "executorch") if not env.get(k)]
    if missing:
        print(f"missing: {', '.join(missing)} (install zoo's bundle or `pip install zoo`)", file=sys.stderr)
        return 2
    if not env.get("gpu"):
        print("no CUDA GPU: zoo can export and rewrite here, but lowering and verification need one",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
