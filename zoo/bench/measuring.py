"""Measuring for zoo's benchmarks: order statistics, a CPU and a CUDA-event timer, ``measure``, device time
by CUDA graph replay, a candidate's peak device memory, and the environment a measurement was taken in.

``measure`` excludes warm-up calls and rotates through a list of distinct inputs, so a call never finds its
inputs already in a cache. Plain Python and torch: tested on the CPU with known sleeps and known work.
"""

from __future__ import annotations

import gc
import math
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

MIB = float(2**20)

# ------------------------------------------------------------------------------------------------------
# Statistics


@dataclass
class Stats:
    """Summary of per-call times in milliseconds. p10/p90 interpolate linearly between order statistics."""

    median: float
    p10: float
    p90: float
    mean: float
    stdev: float  # sample standard deviation; 0 for a single sample
    n: int

    @classmethod
    def from_samples(cls, samples_ms: Sequence[float]) -> "Stats":
        values = sorted(float(v) for v in samples_ms)
        if not values:
            raise ValueError("no samples to summarise")
        return cls(median=percentile(values, 0.5), p10=percentile(values, 0.1), p90=percentile(values, 0.9),
                   mean=statistics.fmean(values), stdev=statistics.stdev(values) if len(values) > 1 else 0.0,
                   n=len(values))

    def as_dict(self) -> Dict[str, float]:
        return asdict(self)

    def spread(self) -> float:
        """(p90 - p10) / median: how noisy the measurement was."""
        return (self.p90 - self.p10) / self.median if self.median > 0 else math.inf


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-quantile of sorted values, interpolating linearly (numpy's default method)."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    pos = (len(sorted_values) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


# ------------------------------------------------------------------------------------------------------
# Timers


class PerfCounterTimer:
    """Wall-clock time of each call on the host (CPU work, or anything that returns when it is done).
    ``clock`` (seconds) is ``time.perf_counter``; tests hand in a clock they advance themselves."""

    name = "perf_counter"

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock

    def start(self) -> Any:
        return self.clock()

    def stop(self, token: Any) -> Any:
        return (token, self.clock())

    def sync(self) -> None:
        pass

    def elapsed_ms(self, marks: Sequence[Any]) -> List[float]:
        return [(end - begin) * 1e3 for begin, end in marks]


class CudaEventTimer:
    """Device time of each call between two CUDA events, read once after the last call.

    ``idle_start=True`` (latency): each call starts on an idle device, so the time includes launching the
    work, as a caller waiting for one result sees it, instead of hiding it behind a queue of earlier calls.
    ``idle_start=False`` (throughput): calls are queued back to back and the events bracket the device work
    alone; a bandwidth measurement of a short kernel wants this.
    """

    name = "cuda_events"

    def __init__(self, device: Optional[torch.device] = None, idle_start: bool = True):
        self.device = device
        self.idle_start = idle_start
        if not idle_start:
            self.name = "cuda_events_back_to_back"

    def start(self) -> Any:
        if self.idle_start:
            torch.cuda.synchronize(self.device)
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, token: Any) -> Any:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        return (token, end)

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def elapsed_ms(self, marks: Sequence[Any]) -> List[float]:
        self.sync()
        return [begin.elapsed_time(end) for begin, end in marks]


def timer_for(device: str, idle_start: bool = True):
    """CUDA events on a GPU (see ``CudaEventTimer`` for ``idle_start``), the host clock on the CPU."""
    if torch.device(device).type == "cuda":
        return CudaEventTimer(torch.device(device), idle_start)
    return PerfCounterTimer()


def measure(fn: Callable[[Any], Any], inputs_list: Sequence[Any], warmup: int, runs: int, timer,
            on_warm: Optional[Callable[[], None]] = None) -> Stats:
    """Time ``runs`` calls of ``fn`` after ``warmup`` untimed ones; call k gets ``inputs_list[k % len]``.

    Warm-up and timed calls each walk the input list from its start, so with ``runs`` a multiple of its
    length every input set is timed equally often. ``on_warm`` runs between the two phases (e.g. to reset
    the peak-memory counter so it covers only timed calls).
    """
    if runs < 1 or warmup < 0:
        raise ValueError(f"runs must be >= 1 and warmup >= 0 (got runs={runs}, warmup={warmup})")
    if not inputs_list:
        raise ValueError("measure needs at least one input set")
    count = len(inputs_list)
    for k in range(warmup):
        fn(inputs_list[k % count])
    timer.sync()
    if on_warm is not None:
        on_warm()
    marks = []
    for k in range(runs):
        item = inputs_list[k % count]
        token = timer.start()
        fn(item)
        marks.append(timer.stop(token))
    return Stats.from_samples(timer.elapsed_ms(marks))


def measure_device_time(fn: Callable[[Any], Any], inputs_list: Sequence[Any], warmup: int, runs: int,
                        device: str) -> Tuple[Stats, str]:
    """Per-call device time of ``fn`` with no host overhead in it; returns (stats, how it was timed).

    On a GPU, one call per input set is captured into a CUDA graph (after ``warmup`` eager passes, so
    compilation and autotuning happen before), and each timed replay is divided by the number of calls it
    holds. A short kernel behind a Python wrapper (an exported program's input checks, dynamo's guards) is
    then timed as the device runs it, where queuing calls back to back would time the host instead. On the
    CPU there is no such split: calls are timed back to back with the host clock.
    """
    if torch.device(device).type != "cuda":
        return measure(fn, inputs_list, warmup, runs, timer_for(device, idle_start=False)), "host clock"
    dev = torch.device(device)
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # warm on a side stream, as CUDA graph capture expects
        for k in range(max(1, warmup)):
            fn(inputs_list[k % len(inputs_list)])
    torch.cuda.current_stream(dev).wait_stream(side)
    torch.cuda.synchronize(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for item in inputs_list:
            fn(item)
    replays = measure(lambda _: graph.replay(), [None], 2, runs, CudaEventTimer(dev, idle_start=False))
    per_call = 1.0 / len(inputs_list)
    stats = Stats(median=replays.median * per_call, p10=replays.p10 * per_call, p90=replays.p90 * per_call,
                  mean=replays.mean * per_call, stdev=replays.stdev * per_call, n=replays.n)
    return stats, f"cuda_graph_replay ({len(inputs_list)} calls per replay)"


def copy_bandwidth(device: str, nbytes: int = 1 << 30, runs: int = 20, warmup: int = 3) -> Dict[str, Any]:
    """Median device-to-device ``copy_`` bandwidth for a buffer of ``nbytes``: (read + written) / time."""
    n = max(1, nbytes // 4)
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    stats = measure(lambda _: dst.copy_(src), [None], warmup, runs, timer_for(device, idle_start=False))
    moved = 2 * n * 4
    return {"bytes": moved, "stats": stats.as_dict(), "gbps": moved / (stats.median * 1e-3) / 1e9}


# ------------------------------------------------------------------------------------------------------
# Peak device memory


class PeakMemory:
    """Peak device memory of one candidate: the caching allocator's peak above what existed before the
    candidate was built, plus device memory it holds outside the allocator (an AOTI .so allocates its
    weights with cudaMalloc; loaded kernel images also count). All None on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.base_alloc = self.base_reserved = self.base_free = 0

    def before_build(self) -> None:
        if not self.cuda:
            return
        gc.collect()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        self.base_alloc = torch.cuda.memory_allocated(self.device)
        self.base_reserved = torch.cuda.memory_reserved(self.device)
        self.base_free = torch.cuda.mem_get_info(self.device)[0]

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> Dict[str, Optional[int]]:
        if not self.cuda:
            return {"peak_bytes": None, "allocator_peak_bytes": None, "outside_allocator_bytes": None}
        torch.cuda.synchronize(self.device)
        allocator = torch.cuda.max_memory_allocated(self.device) - self.base_alloc
        used = self.base_free - torch.cuda.mem_get_info(self.device)[0]
        grown = torch.cuda.memory_reserved(self.device) - self.base_reserved
        outside = max(0, used - grown)
        return {"peak_bytes": int(allocator + outside), "allocator_peak_bytes": int(allocator),
                "outside_allocator_bytes": int(outside)}


# ------------------------------------------------------------------------------------------------------
# Where it was measured


def environment(device: str) -> Dict[str, Any]:
    from importlib import metadata

    def version(dist: str) -> Optional[str]:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    env: Dict[str, Any] = {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda,
                           "executorch": version("executorch"), "lerobot": version("lerobot"),
                           "transformers": version("transformers"), "python": platform.python_version(),
                           "host": platform.node(), "cpu": platform.processor() or platform.machine()}
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(torch.device(device))
        env.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                   gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   l2_cache_mib=round(getattr(props, "L2_cache_size", 0) / MIB, 1))
    return env
