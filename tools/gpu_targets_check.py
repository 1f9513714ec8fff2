#!/usr/bin/env python3
"""GPU targets on a CUDA machine, in one command: llama-rope-tiny lowered for this GPU and for each --target,
the audit of each (kernel images and host read from the binary), and one table of every GPU in zoo's table:
produced here, verified here (and how), or left to the target machine and why.

    python tools/gpu_targets_check.py --out OUT_DIR [--targets a100 ...] [--tests]

Steps: ``python -m zoo.export llama-rope-tiny`` into OUT_DIR/native (on a GPU machine it lowers, audits and
verifies); the run copied to OUT_DIR/<target> and ``python -m zoo lower OUT_DIR/<target> --target <target>`` for
each --target (default: a100); ``python -m zoo audit`` of each; the runner's check against a stubbed A100 (the
native artifact must be refused before loading); with --tests, the GPU and CPU test modules of the targets work.
Writes OUT_DIR/targets.md (the audits and the table) and OUT_DIR/targets.json; exit 0 when every step did what
it should.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent  # the checkout: commands run from it (its tests, its recipes)


import torch

from zoo.contract import gpu_targets
from zoo.core.errors import GpuTargetMismatch
from zoo.core.report import format_table
from zoo.contract import run_folder
from zoo.contract.run_folder import RunFolder

RECIPE = "llama-rope-tiny"
TESTS = ["tests/gpu/test_gpu_lowering_targets.py", "tests/test_gpu_targets.py", "tests/test_gpu_targets_cpp.py",
         "tests/test_lowering_target.py"]


def run(cmd: List[str], log: Path, timeout: int = 900) -> Dict:
    start = time.perf_counter()
    with open(log, "w") as fh:
        try:
            rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return {"cmd": " ".join(cmd[1:]), "rc": rc, "seconds": round(time.perf_counter() - start, 1), "log": str(log)}


def audit_text(run_dir: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "zoo", "audit", str(run_dir)], capture_output=True, text=True,
                          cwd=ROOT)
    return done.stdout + done.stderr


def lowered_facts(run_dir: Path, target: Optional[str] = None) -> Dict:
    """From the run's report: status, the kernels the audit read, how this GPU ran them in verification. A run
    lowered for ``target`` counts only when its report's lowering names that target."""
    folder = RunFolder(run_dir)
    folder = folder if folder.pte.is_file() else (folder.latest_attempt() or folder)
    data = folder.read_report().data if folder.is_run() else {}
    lowered_for = (((data.get("lowering") or {}).get("gpu") or {}).get("target") or {}).get("name")
    if target is not None and lowered_for != target:
        return {"status": data.get("status", "not lowered"), "images": [], "hosts": [], "ran_here_as": None,
                "verified": False, "error": (data.get("error") or {}).get("message") or f"no lowering for {target}"}
    audit = data.get("audit") or {}
    methods = audit.get("methods") or []
    images = sorted({i for m in methods for i in (m.get("targets") or {}).get("images", [])})
    hosts = sorted({(m.get("targets") or {}).get("machine", "?") for m in methods})
    here = None
    if methods and folder.pte.is_file():
        read = {m: gpu_targets.read_targets(so) for m, so in folder.compiled_methods().items()}
        device = local_device()
        verdicts = [t.runs_on(device) for t in read.values()]
        here = "ptx" if any(v.how == "ptx" for v in verdicts) else "sass" if all(v.ok for v in verdicts) else "no"
    verification = data.get("verification") or {}
    return {"status": data.get("status"), "images": images, "hosts": hosts, "ran_here_as": here,
            "verified": bool(verification.get("passed")), "error": (data.get("error") or {}).get("message")}


def local_device() -> gpu_targets.Device:
    import torch

    major, minor = torch.cuda.get_device_capability()
    return gpu_targets.Device(torch.cuda.get_device_name(), (major, minor), platform.machine())


def refused_on_a_stubbed_a100(native: Path) -> Dict:
    """The runner's artifact backend over the native run, with torch answering as an A100 does."""
    import torch

    from zoo.runner.backends import make_backend

    real = torch.cuda.get_device_capability, torch.cuda.get_device_name
    torch.cuda.get_device_capability = lambda device=None: (8, 0)
    torch.cuda.get_device_name = lambda device=None: "NVIDIA A100-SXM4-80GB (stubbed)"
    try:
        make_backend("artifact", RunFolder(native), "cuda").close()
        return {"refused": False, "message": "loaded"}
    except GpuTargetMismatch as exc:
        return {"refused": True, "message": str(exc)}
    finally:
        torch.cuda.get_device_capability, torch.cuda.get_device_name = real


def target_rows(device: gpu_targets.Device, produced: Dict[str, Dict]) -> List[List[str]]:
    from zoo.export.lower.target import plan_target

    rows = [["target", "sm", "host", "produced here", "kernels (read from the .so)", "verified here",
             "left to the target machine"]]
    for g in gpu_targets.GPUS.values():
        facts = produced.get(g.name)
        try:
            plan = plan_target(g.name, device)
            can = f"yes ({plan.mode})"
            why_not = ""
        except GpuTargetMismatch as exc:
            can, why_not = "no", exc.message.split(" is not possible: ", 1)[-1]
        if facts:
            verified = (f"yes, {'through the PTX JIT' if facts['ran_here_as'] == 'ptx' else 'SASS as is'}"
                        if facts["verified"] else f"NO ({facts['status']}: {facts['error']})")
            left = ("nothing: this GPU is one" if g.arch == device.arch and g.machine == device.machine
                    else f"a run on a {g.label} itself (its SASS as is)")
            rows.append([g.name, str(g.arch), g.machine, "yes", "/".join(facts["images"]) + " " + ",".join(
                facts["hosts"]), verified, left])
        elif can.startswith("yes"):
            rows.append([g.name, str(g.arch), g.machine, f"can be ({plan.mode}; not run by this script)", "-", "-",
                         f"`--target {g.name}` here, then a run on a {g.label}"])
        else:
            rows.append([g.name, str(g.arch), g.machine, "no", "-", "-", f"lowering and running it there: {why_not}"])
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--targets", nargs="*", default=["a100"], help="GPUs to lower for here besides this one")
    parser.add_argument("--tests", action="store_true", help="also run the targets' test modules (GPU and CPU)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("[gpu_targets_check] needs a CUDA device: it lowers and verifies on this machine's GPU", file=sys.stderr)
        return 2
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    device = local_device()
    print(f"this machine: {device.text()}", flush=True)
    steps: Dict[str, Dict] = {}
    native = out / "native"
    shutil.rmtree(native, ignore_errors=True)
    steps["native"] = run([sys.executable, "-m", "zoo.export", RECIPE, "--output-dir", str(native)], out / "native.log")
    produced = {}
    texts = [f"# GPU targets of {RECIPE} on {device.text()}", ""]
    for name in [None, *args.targets]:
        folder = native if name is None else out / name
        if name is not None:
            shutil.rmtree(folder, ignore_errors=True)
            # the export's files only: what this lowering makes must not be mistaken for the native artifact
            shutil.copytree(native, folder, ignore=shutil.ignore_patterns(
                run_folder.ATTEMPTS_DIR, run_folder.MANIFEST_JSON, run_folder.PUBLISH_DIR,
                *run_folder.ARTIFACT_OUTPUTS))
            steps[name] = run([sys.executable, "-m", "zoo", "lower", str(folder), "--target", name], out / f"{name}.log")
        facts = lowered_facts(folder, name)
        key = name or next((g.name for g in gpu_targets.GPUS.values() if g.label.lower() in device.name.lower()),
                           next((g.name for g in gpu_targets.GPUS.values()
                                 if g.arch == device.arch and g.machine == device.machine), "native"))
        produced[key] = facts
        texts += [f"## {name or 'this GPU'}: `{steps[name or 'native']['cmd']}` exit {steps[name or 'native']['rc']}",
                  "", "```", audit_text(folder).rstrip(), "```", ""]
        print("\n".join(texts[-6:]), flush=True)
    refusal = refused_on_a_stubbed_a100(native)
    table = format_table(target_rows(device, produced))
    texts += ["## The runner on a stubbed A100 over this GPU's artifact", "", refusal["message"], "",
              "## Targets", "", "```", table, "```", ""]
    ok = all(s["rc"] == 0 for s in steps.values()) and refusal["refused"] == (device.arch != 80)
    ok = ok and all(f["verified"] for f in produced.values())
    if args.tests:
        os.environ["ZOO_TARGET_RUNS"] = str(out)  # the GPU tests reuse native/ and a100/
        tests = run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", *TESTS],
                    out / "tests.log", timeout=1800)
        texts += [f"## Tests: `{tests['cmd']}` exit {tests['rc']}", "", "```",
                  "\n".join(Path(tests["log"]).read_text().splitlines()[-15:]), "```"]
        ok = ok and tests["rc"] == 0
    (out / "targets.md").write_text("\n".join(texts) + "\n")
    (out / "targets.json").write_text(json.dumps({"device": device.text(), "steps": steps, "produced": produced,
                                                  "refusal": refusal, "ok": ok}, indent=2))
    print(f"\nrunner on a stubbed A100: {'refused' if refusal['refused'] else 'NOT refused'}: {refusal['message']}")
    print(table)
    print(f"\n{'OK' if ok else 'FAILED'}: {out / 'targets.md'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
