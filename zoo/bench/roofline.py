"""The hardware floor of a method call and of a chunk: the bytes a call must move over the GPU's measured copy
bandwidth, its FLOPs over the measured bf16 GEMM rate, whichever is larger.

What a call must move: every weight the method reads, once; every input (the state it is handed included);
every output that is not state handed back. A state output that replaces its input (LingBot-VA's KV pool,
``k_pool_next`` for ``k_pool``) is left out: a step that writes only its new slots in place writes next to
nothing, so rewriting the whole pool is time above the floor, which the ratio shows. The FLOPs are counted by
torch's ``FlopCounterMode`` over the rewritten program on fake tensors of the call's shapes (no kernel runs):
matrix products and attention, as the program computes them (attention over the whole masked pool where the
program attends over it). Both rates are measured on the device in the same run (docs/benchmarks.md, "The
roofline"), so the floor is what this GPU can do, not a data sheet.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Dict, List, Mapping, Sequence, Tuple

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import flop_counter

from zoo.bench.measuring import Stats, copy_bandwidth, measure, timer_for
from zoo.core.numerics import held_bytes
from zoo.runner.graphs import shape_key

aten = torch.ops.aten


def _sdpa_for_cpu(query, key, value, *args, out_shape=None, **kwargs) -> int:
    # The CPU's fused kernel, which FlopCounterMode has no formula for; the same count as the CUDA kernels'.
    return flop_counter.sdpa_flop_count(query, key, value)


# Ops the flop counter sees on a CPU that it has no formula for (on CUDA, flash/efficient/cuDNN are counted).
# FlopCounterMode hands a custom formula shapes, not tensors, as it does its own.
EXTRA_FORMULAS = {aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_for_cpu}


def nbytes(value: Any) -> int:
    """Bytes of a tensor, or of anything with ``shape`` and ``dtype`` (a runtime's handle of a GPU value)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or dtype is None:
        return 0
    count = 1
    for d in shape:
        count *= int(d)
    return count * torch.empty((), dtype=_dtype(dtype)).element_size()


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer a program module holds (each storage once)."""
    return held_bytes([module])


def program_flops(module: torch.nn.Module, inputs: Sequence[Any]) -> int:
    """FLOPs of one call of ``module`` on inputs of these shapes, counted on fake tensors (nothing is computed).

    ``inputs`` are tensors or anything with ``shape`` and ``dtype`` (wherever they live: the fakes are made on
    the device of the module's weights, which the fake mode takes as they are, ``allow_non_fake_inputs``)."""
    device = next((t.device for t in module.parameters()), torch.device("cpu"))
    with FakeTensorMode(allow_non_fake_inputs=True):
        fakes = [torch.empty(tuple(int(d) for d in v.shape), dtype=_dtype(v.dtype), device=device) for v in inputs]
        with flop_counter.FlopCounterMode(display=False, custom_mapping=EXTRA_FORMULAS) as counter:
            with torch.no_grad():
                module(*fakes)
    return int(counter.get_total_flops())


def _dtype(dtype: Any) -> torch.dtype:
    return getattr(torch, dtype.replace("torch.", "")) if isinstance(dtype, str) else dtype


@dataclass(frozen=True)
class Rates:
    """What the device was measured to do: copy bandwidth (bytes read + written per second) and dense bf16 GEMM
    FLOPs per second."""
    copy_gbps: float
    gemm_tflops: float

    def floor_ms(self, bytes_moved: int, flops: int) -> float:
        return max(bytes_moved / (self.copy_gbps * 1e9), flops / (self.gemm_tflops * 1e12)) * 1e3

    def bound(self, bytes_moved: int, flops: int) -> str:
        """Which of the two decides the floor."""
        return "memory" if bytes_moved / (self.copy_gbps * 1e9) >= flops / (self.gemm_tflops * 1e12) else "compute"


def gemm_rate(device: str, size: int = 8192, dtype: torch.dtype = torch.bfloat16, runs: int = 10,
              warmup: int = 3) -> Dict[str, Any]:
    """Median dense GEMM throughput of one ``size`` cube in ``dtype`` (cuBLAS on a GPU): 2 n^3 / time."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    stats = measure(lambda _: torch.mm(a, b, out=out), [None], warmup, runs, timer_for(device, idle_start=False))
    flops = 2 * size ** 3
    return {"size": size, "dtype": str(dtype).replace("torch.", ""), "stats": stats.as_dict(),
            "tflops": flops / (stats.median * 1e-3) / 1e12}


def measure_rates(device: str, copy_bytes: int = 1 << 30, gemm_size: int = 8192) -> Tuple[Rates, Dict[str, Any]]:
    """Both rates on ``device``, and what was measured (sizes, medians) for the results file."""
    copy = copy_bandwidth(device, copy_bytes, runs=10, warmup=3)
    gemm = gemm_rate(device, gemm_size)
    return Rates(copy_gbps=copy["gbps"], gemm_tflops=gemm["tflops"]), {"copy": copy, "gemm": gemm}


# ------------------------------------------------------------------------------------------------------
# A host loop's calls, recorded


@dataclass
class CallCost:
    """One method at one set of input shapes: what each call must move, computes, and took."""
    method: str
    bytes_moved: int
    flops: int
    calls: int = 0
    ms: List[float] = field(default_factory=list)
    # Per call, where a backend that can say put its time (the executorch backend's CallTiming).
    splits: List[Any] = field(default_factory=list)

    def as_dict(self, rates: Rates) -> Dict[str, Any]:
        stats = Stats.from_samples(self.ms) if self.ms else None
        floor = rates.floor_ms(self.bytes_moved, self.flops)
        out = {k: v for k, v in asdict(self).items() if k not in ("ms", "splits")}
        out.update(floor_ms=floor, bound=rates.bound(self.bytes_moved, self.flops),
                   median_ms=stats.median if stats else None,
                   ratio=(stats.median / floor) if stats and floor else None)
        if self.splits:
            out["split_ms"] = split_medians(self.splits)
        return out


def split_medians(splits: Sequence[Any]) -> Dict[str, float]:
    """Each part's median (ms) over calls timed part by part (dataclasses of one kind: ``CallTiming``)."""
    return {f.name: Stats.from_samples([getattr(s, f.name) for s in splits]).median for f in fields(splits[0])}


class CallRecorder:
    """Wraps a runner backend's ``call``: each call synchronised and timed, its bytes and FLOPs worked out once
    per method and input shapes. ``flops_of(method, inputs)`` and ``weights_of(method)`` come from the rewritten
    programs; ``state`` is the backend's kept state ({method: {output: input it is fed back as}})."""

    def __init__(self, backend: Any, flops_of: Callable[[str, Sequence[Any]], int],
                 weights_of: Callable[[str], int], state: Mapping[str, Mapping[str, str]], sync: Callable[[], None]):
        self.backend, self.flops_of, self.weights_of, self.sync = backend, flops_of, weights_of, sync
        self.state = {m: dict(outs) for m, outs in state.items()}
        self.costs: Dict[Tuple[str, Tuple], CallCost] = {}
        self._call = backend.call
        self.recording = False

    def __enter__(self) -> "CallRecorder":
        self.backend.call = self.call
        return self

    def __exit__(self, *exc) -> None:
        self.backend.call = self._call

    def call(self, method: str, **inputs: Any) -> Dict[str, Any]:
        if not self.recording:
            return self._call(method, **inputs)
        ordered = self.backend._ordered(method, inputs)
        self.sync()
        start = time.perf_counter()
        outs = self._call(method, **inputs)
        self.sync()
        ms = (time.perf_counter() - start) * 1e3
        key = (method, shape_key(ordered))
        cost = self.costs.get(key)
        if cost is None:
            fed_back = {out for out, name in self.state.get(method, {}).items() if name in inputs}
            moved = (self.weights_of(method) + sum(nbytes(v) for v in ordered)
                     + sum(nbytes(v) for name, v in outs.items() if name not in fed_back))
            cost = self.costs[key] = CallCost(method, moved, self.flops_of(method, ordered))
        cost.calls += 1
        cost.ms.append(ms)
        split = getattr(self.backend, "last_call", None)
        if split is not None:
            cost.splits.append(split)
        return outs


def chunk_floor(costs: Sequence[CallCost], rates: Rates, chunks: int) -> Dict[str, Any]:
    """The floor of one chunk: every recorded call's floor, summed, over the chunks recorded."""
    floor = sum(c.calls * rates.floor_ms(c.bytes_moved, c.flops) for c in costs) / chunks
    moved = sum(c.calls * c.bytes_moved for c in costs) / chunks
    flops = sum(c.calls * c.flops for c in costs) / chunks
    calls = {}
    for c in costs:
        calls[c.method] = calls.get(c.method, 0) + c.calls / chunks
    return {"floor_ms": floor, "bytes_moved": moved, "flops": flops, "calls_per_chunk": calls}


class ProgramCosts:
    """The weights and FLOPs of a run's methods, from its rewritten programs: loaded on the CPU once each (the
    FLOPs are counted on fake tensors, so no GPU memory and no kernel is needed), whatever backend is timed."""

    def __init__(self, run: Any):
        self.run = run
        self._modules: Dict[str, torch.nn.Module] = {}
        self._weights: Dict[str, int] = {}
        self._flops: Dict[Tuple[str, Tuple], int] = {}

    def _module(self, method: str) -> torch.nn.Module:
        if method not in self._modules:
            self._modules[method] = self.run.load_program("rewritten", method).module()
        return self._modules[method]

    def weights_of(self, method: str) -> int:
        if method not in self._weights:
            self._weights[method] = weight_bytes(self._module(method))
        return self._weights[method]

    def flops_of(self, method: str, inputs: Sequence[Any]) -> int:
        key = (method, shape_key(inputs))
        if key not in self._flops:
            self._flops[key] = program_flops(self._module(method), inputs)
        return self._flops[key]

    def close(self) -> None:
        self._modules.clear()
