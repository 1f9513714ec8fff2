"""The host cost of one call through ExecuTorch's runner (zoo.runtimes.executorch.RuntimeSession).

A call writes each host input to a tensor file, sends one line down the pipe, and reads the outputs back from
files. This times that round trip on a small portable program with the host inputs of a DiT step (slot indices,
the pool's visibility mask, latents, grid ids, timesteps) and one output of the latents' size, twice in one run,
the calls interleaved: each hand-over file written atomically (a temporary file, fsync, rename: how the session
wrote them before) and written in place (how it writes them now). The program's own work is the same in both, so
the difference is the write. Runs on the CPU; needs a built zoo_runner (scripts/build_runtime.sh).

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


def time_calls(pte: Path, runner: str, calls: int, work: Path) -> Dict[str, List[float]]:
    """Wall ms per call for each way of writing the hand-over files, calls alternating between the two; each
    call's output checked against eager's."""
    inputs = step_inputs()
    want = Step()(*inputs)
    times: Dict[str, List[float]] = {"atomic": [], "in place": []}
    sessions = {mode: et_runtime.RuntimeSession(pte, None, executable=runner, require_cuda=False,
                                                work_dir=work / mode.replace(" ", "-"))
                for mode in times}
    original = et_runtime.write_tensor

    def atomic(path, tensor, handover=False):  # whatever the session asks for
        return write_tensor(path, tensor)

    try:
        for n in range(calls + 10):
            for mode, session in sessions.items():
                # The old behaviour, reproduced: every hand-over file written atomically, synced to the disk.
                et_runtime.write_tensor = atomic if mode == "atomic" else original
                start = time.perf_counter()
                (got,) = session.call("step", inputs)
                elapsed = (time.perf_counter() - start) * 1e3
                if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
                    raise SystemExit(f"{mode}: the runner's output differs from eager's")
                if n >= 10:  # the first calls warm the page cache and the runner
                    times[mode].append(elapsed)
    finally:
        et_runtime.write_tensor = original
        for session in sessions.values():
            session.close()
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runner", help="a built zoo_runner (default $ZOO_ET_RUNNER)")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--work", help="where the hand-over files go (default: the system's temp folder)")
    args = parser.parse_args()
    runner = str(et_runtime.find_runner(args.runner))
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        pte = build_program(Path(tmp))
        times = time_calls(pte, runner, args.calls, Path(tmp))
    nbytes = sum(t.numel() * t.element_size() for t in step_inputs())
    print(f"{args.calls} calls each, 5 host inputs ({nbytes / 1024:.0f} KiB) and 1 output per call, "
          f"hand-over files in {args.work or tempfile.gettempdir()}")
    print(f"{'hand-over files':<16} {'median ms':>9} {'p10 ms':>7} {'p90 ms':>7}")
    medians = {}
    for mode, values in times.items():
        values.sort()
        medians[mode] = statistics.median(values)
        print(f"{mode:<16} {medians[mode]:9.3f} {values[len(values) // 10]:7.3f} {values[len(values) * 9 // 10]:7.3f}")
    print(f"atomic writes cost {medians['atomic'] - medians['in place']:.3f} ms per call "
          f"(in place / atomic: {medians['in place'] / medians['atomic']:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
