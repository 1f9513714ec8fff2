"""The host cost of one call through ExecuTorch's runner (zoo.runtimes.executorch.RuntimeSession).

A call writes each host input to a tensor file, sends one line down the pipe, and reads the outputs back from
files. This times that round trip on a small portable program with the host inputs of a DiT step (slot indices,
the pool's visibility mask, latents, grid ids, timesteps) and one output of the latents' size, the calls
interleaved three ways: the same program run in this process by ExecuTorch's own Python bindings (no pipe, no
files: what the process boundary costs is the difference), the session with its hand-over files written in
place (how it writes them), and written atomically (a temporary file, fsync, rename: how it wrote them before).
For the session it also gives the median of each part of a call (``CallTiming``). Runs on the CPU; needs a
built zoo_runner (scripts/build_runtime.sh).

    python benchmarks/bench_session.py [--runner PATH] [--calls 200] [--work DIR]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

import torch
from torch import nn

from zoo.bench.roofline import split_medians
from zoo.runtimes import executorch as et_runtime
from zoo.contract.artifact import PTE_NAME
from zoo.contract.tensor_file import write_tensor


class Step(nn.Module):
    """Touches every input once and returns a tensor of the latents' shape, like a DiT step's noise prediction."""

    def forward(self, latents, slots, visible, grid_id, timesteps):
        bias = (slots.sum() + visible.sum() + grid_id.sum()).to(latents.dtype) + timesteps.mean()
        return latents * 0.5 + bias


def step_inputs() -> Tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    return (torch.randn(2, 48, 1, 24, 20), torch.arange(40), torch.rand(2160) > 0.5,
            torch.randint(0, 24, (2, 3, 480)), torch.rand(2, 480))


def build_program(folder: Path) -> Path:
    from executorch.exir import to_edge

    from zoo.contract.artifact import ensure_flatc

    ensure_flatc()  # writing a .pte needs flatc
    program = to_edge({"step": torch.export.export(Step().eval(), step_inputs())}).to_executorch()
    (folder / PTE_NAME).write_bytes(program.buffer)
    return folder / PTE_NAME


MODES = ("in process", "in place", "atomic")


def time_calls(pte: Path, runner: str, calls: int, work: Path) -> Tuple[Dict[str, List[float]], Dict[str, list]]:
    """Wall ms per call for each mode, calls alternating between them, each call's output checked against
    eager's; and each session mode's ``CallTiming`` per call."""
    from executorch.extension.pybindings.portable_lib import _load_for_executorch

    inputs = step_inputs()
    want = Step()(*inputs)
    times: Dict[str, List[float]] = {mode: [] for mode in MODES}
    parts: Dict[str, list] = {mode: [] for mode in MODES[1:]}
    in_process = _load_for_executorch(str(pte))
    sessions = {mode: et_runtime.RuntimeSession(pte, None, executable=runner, require_cuda=False,
                                                work_dir=work / mode.replace(" ", "-"))
                for mode in MODES[1:]}
    original = et_runtime.write_tensor

    def atomic(path, tensor, handover=False):  # whatever the session asks for
        return write_tensor(path, tensor)

    try:
        for n in range(calls + 10):
            for mode in MODES:
                # The old behaviour, reproduced: every hand-over file written atomically, synced to the disk.
                et_runtime.write_tensor = atomic if mode == "atomic" else original
                start = time.perf_counter()
                if mode == "in process":
                    (got,) = in_process.run_method("step", inputs)
                else:
                    (got,) = sessions[mode].call("step", inputs)
                elapsed = (time.perf_counter() - start) * 1e3
                if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
                    raise SystemExit(f"{mode}: the runtime's output differs from eager's")
                if n >= 10:  # the first calls warm the page cache and the runner
                    times[mode].append(elapsed)
                    if mode in sessions:
                        parts[mode].append(sessions[mode].last_call)
    finally:
        et_runtime.write_tensor = original
        for session in sessions.values():
            session.close()
    return times, parts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runner", help="a built zoo_runner (default $ZOO_ET_RUNNER)")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--work", help="where the hand-over files go (default: the system's temp folder)")
    args = parser.parse_args()
    runner = str(et_runtime.find_runner(args.runner))
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        pte = build_program(Path(tmp))
        times, parts = time_calls(pte, runner, args.calls, Path(tmp))
    nbytes = sum(t.numel() * t.element_size() for t in step_inputs())
    print(f"{args.calls} calls each, 5 host inputs ({nbytes / 1024:.0f} KiB) and 1 output per call, "
          f"hand-over files in {args.work or tempfile.gettempdir()}")
    print(f"{'call':<11} {'median ms':>9} {'p10 ms':>7} {'p90 ms':>7}  "
          f"{'write':>6} {'execute':>7} {'rt I/O':>6} {'pipe':>6} {'read':>6}")
    medians = {}
    for mode, values in times.items():
        values.sort()
        medians[mode] = statistics.median(values)
        split = ("  " + " ".join(f"{v:>{w}.3f}" for v, w in zip(split_medians(parts[mode]).values(),
                                                                 (6, 7, 6, 6, 6)))) if mode in parts else ""
        print(f"{mode:<11} {medians[mode]:9.3f} {values[len(values) // 10]:7.3f} "
              f"{values[len(values) * 9 // 10]:7.3f}{split}")
    print(f"the process boundary costs {medians['in place'] - medians['in process']:.3f} ms per call "
          f"(session / in process: {medians['in place'] / medians['in process']:.2f}x); atomic writes "
          f"{medians['atomic'] - medians['in place']:.3f} ms more")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
