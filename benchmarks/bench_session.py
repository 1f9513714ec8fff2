"""The host cost of one call through ExecuTorch's runtime: in this process (zoo.runtimes.inprocess) against the
zoo_runner session over a pipe (zoo.runtimes.executorch.RuntimeSession).

A session call writes each host input to a tensor file, sends one line down the pipe, and reads the outputs back
from files; an in-process call hands the runtime its tensors' own memory. Calls alternate between the modes, so
each sees the same machine state.

Without --run (any machine; a CPU is enough): a small portable program with the host inputs of a DiT step (slot
indices, the pool's visibility mask, latents, grid ids, timesteps) and one output of the latents' size, three
ways: in process, the session with its hand-over files written in place (how it writes them), and written
atomically (a temporary file, fsync, rename: how it wrote them before). Each output is checked against eager's.

With --run RUN_DIR --method M (a GPU): the lowered method, with verification's inputs, three ways: in process
(every input a CUDA tensor, every output copied into one), the session with every input uploaded once and every
output left on the GPU (the least a pipe can cost), and the session with only the family's state on the GPU
(zoo.runner's way: other inputs through files, other outputs back to the host). The in-process outputs are
checked against the session's (one runtime, one set of kernels: they must agree exactly).

For the session it also gives the median of each part of a call (``CallTiming``). The in-process session and
torch's AOTI runner cannot share a process (docs/runtime.md), so AOTI is not timed here: gpu_runtime_check.py
--latency times it over the same method.

    python benchmarks/bench_session.py [--runner PATH] [--library PATH] [--calls 200] [--work DIR]
                                       [--run RUN_DIR --method M]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import nn

from zoo.bench.roofline import split_medians
from zoo.contract.artifact import PTE_NAME
from zoo.contract.run_folder import RunFolder
from zoo.contract.tensor_file import write_tensor
from zoo.runtimes import executorch as et_runtime
from zoo.runtimes import inprocess

Call = Callable[[], List[Any]]


@dataclass
class Bench:
    """The modes to time (name -> one call), the sessions behind session modes (for ``CallTiming``), and the
    reference each mode's outputs are checked against (CPU tensors)."""

    modes: Dict[str, Call]
    sessions: Dict[str, et_runtime.RuntimeSession]
    reference: Callable[[], List[torch.Tensor]]
    compare: Callable[[torch.Tensor, torch.Tensor], bool]
    words: str


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


def toy_bench(pte: Path, runner: str, library: str, work: Path, stack: ExitStack) -> Bench:
    """The portable program in process, and through the session with hand-over files in place and atomic."""
    inputs = step_inputs()
    local = stack.enter_context(inprocess.InProcessSession(pte, None, library=library, device="cpu"))
    sessions = {mode: stack.enter_context(et_runtime.RuntimeSession(pte, None, executable=runner, require_cuda=False,
                                                                    work_dir=work / mode.replace(" ", "-")))
                for mode in ("in place", "atomic")}
    original = et_runtime.write_tensor

    def atomic(path, tensor, handover=False):  # whatever the session asks for
        return write_tensor(path, tensor)

    def session_call(mode: str) -> Call:
        def call():
            # The old behaviour, reproduced: every hand-over file written atomically, synced to the disk.
            et_runtime.write_tensor = atomic if mode == "atomic" else original
            try:
                return sessions[mode].call("step", inputs)
            finally:
                et_runtime.write_tensor = original
        return call

    nbytes = sum(t.numel() * t.element_size() for t in inputs)
    return Bench({"in process": lambda: local.call("step", inputs), **{m: session_call(m) for m in sessions}},
                 sessions, lambda: [Step()(*inputs)], lambda got, want: torch.allclose(got, want, rtol=1e-5, atol=1e-5),
                 f"a portable program, 5 host inputs ({nbytes / 1024:.0f} KiB) and 1 output per call")


def run_bench(run: RunFolder, method: str, runner: str, library: str, work: Path, stack: ExitStack) -> Bench:
    """A lowered method on the GPU: in process, and through the session with everything or only state held."""
    from zoo.export.runtime_sequence import method_inputs, state_positions

    _, _, inputs = method_inputs(run, run.load_recipe() if run.recipe_file.exists() else None, method)
    state = state_positions(run, method)
    ptd = run.ptd if run.ptd.is_file() else None
    local = stack.enter_context(inprocess.InProcessSession(run.pte, ptd, library=library, methods=[method],
                                                           device="cuda"))
    on_gpu = [t.cuda() for t in inputs]
    session = stack.enter_context(et_runtime.RuntimeSession(run.pte, ptd, executable=runner, methods=[method],
                                                            work_dir=work / "session"))
    uploaded = [session.upload(f"in{i}", t) for i, t in enumerate(inputs)]
    held = [uploaded[i] if i in state["inputs"] else t for i, t in enumerate(inputs)]
    n_out = len(local.outputs_of(method))
    nbytes = sum(t.numel() * t.element_size() for t in inputs)
    return Bench({"in process": lambda: local.call(method, on_gpu),
                  "session, device": lambda: session.call(method, uploaded, keep={k: f"out{k}" for k in range(n_out)}),
                  "session, state": lambda: session.call(method, held, keep={k: f"st{k}" for k in state["outputs"]})},
                 {"session, device": session, "session, state": session},
                 lambda: [t.cpu() for t in local.call(method, on_gpu)], torch.equal,
                 f"{run.path.name}'s {method} on {torch.cuda.get_device_name()}, {len(inputs)} inputs "
                 f"({nbytes / 2**20:.1f} MiB; state inputs {state['inputs']}, outputs {state['outputs']})")


def time_calls(bench: Bench, calls: int) -> Tuple[Dict[str, List[float]], Dict[str, list]]:
    """Wall ms per call for each mode, calls alternating between them, each mode's outputs checked against the
    reference once; and each session mode's ``CallTiming`` per call."""
    want = bench.reference()
    times: Dict[str, List[float]] = {mode: [] for mode in bench.modes}
    parts: Dict[str, list] = {mode: [] for mode in bench.modes if mode in bench.sessions}
    for n in range(calls + 10):
        for mode, call in bench.modes.items():
            start = time.perf_counter()
            got = call()
            elapsed = (time.perf_counter() - start) * 1e3
            if n == 0:
                got = [g.fetch() if isinstance(g, et_runtime.DeviceValue) else g.cpu() for g in got]
                if len(got) != len(want) or not all(bench.compare(g, w) for g, w in zip(got, want)):
                    raise SystemExit(f"{mode}: the outputs differ from the reference's")
            if n >= 10:  # the first calls warm the page cache, the runtime and the GPU's memory pool
                times[mode].append(elapsed)
                if mode in bench.sessions:
                    parts[mode].append(bench.sessions[mode].last_call)
    return times, parts


def print_table(times: Dict[str, List[float]], parts: Dict[str, list]) -> Dict[str, float]:
    print(f"{'call':<15} {'median ms':>9} {'p10 ms':>7} {'p90 ms':>7}  "
          f"{'write':>6} {'execute':>7} {'rt I/O':>6} {'pipe':>6} {'read':>6}")
    medians = {}
    for mode, values in times.items():
        values.sort()
        medians[mode] = statistics.median(values)
        split = ("  " + " ".join(f"{v:>{w}.3f}" for v, w in zip(split_medians(parts[mode]).values(),
                                                                 (6, 7, 6, 6, 6)))) if mode in parts else ""
        print(f"{mode:<15} {medians[mode]:9.3f} {values[len(values) // 10]:7.3f} "
              f"{values[len(values) * 9 // 10]:7.3f}{split}")
    return medians


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runner", help="a built zoo_runner (default $ZOO_ET_RUNNER)")
    parser.add_argument("--library", help=f"a built {inprocess.LIBRARY_NAME} (default: $ZOO_ET_SESSION, else the "
                                          "one beside the runner)")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--work", help="where the hand-over files go (default: the system's temp folder)")
    parser.add_argument("--run", type=Path, help="a lowered run folder (with --method; needs a GPU)")
    parser.add_argument("--method", help="the run's method to time")
    args = parser.parse_args()
    if (args.run is None) != (args.method is None):
        parser.error("--run and --method go together")
    runner = str(et_runtime.find_runner(args.runner))
    library = str(inprocess.find_library(args.library or (Path(runner).parent / inprocess.LIBRARY_NAME)))
    with tempfile.TemporaryDirectory(dir=args.work) as tmp, ExitStack() as stack:
        if args.run is None:
            bench = toy_bench(build_program(Path(tmp)), runner, library, Path(tmp), stack)
        else:
            bench = run_bench(RunFolder(args.run), args.method, runner, library, Path(tmp), stack)
        times, parts = time_calls(bench, args.calls)
    print(f"{args.calls} calls each: {bench.words}; hand-over files in {args.work or tempfile.gettempdir()}")
    medians = print_table(times, parts)
    first_session = next(m for m in medians if m != "in process")
    print(f"the process boundary costs {medians[first_session] - medians['in process']:.3f} ms per call "
          f"({first_session} / in process: {medians[first_session] / medians['in process']:.2f}x)"
          + (f"; atomic writes {medians['atomic'] - medians['in place']:.3f} ms more" if "atomic" in medians else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
