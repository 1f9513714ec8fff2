"""``python -m zoo bench RUN_DIR``: how fast the artifact runs, against eager PyTorch and torch.compile.

For each method of a run folder (and each size of its dynamic dims asked for), three candidates run on the
same pre-drawn inputs in the unit's dtype:

  artifact  the method's .so + weights taken out of the shipped model.pte / aoti_cuda_blob.ptd, through torch's
            AOTI runner, fed in the delegate's own input order (exactly as verification runs them)
  eager     the original exported program (``exported.<method>.pt2``, complex rotary math and all), op by op
  compile   ``torch.compile`` (default mode) of that same module

Each candidate is measured in isolation: built, warmed up, its peak memory counter reset, then timed over
``runs`` calls that rotate through several distinct input sets (together larger than the GPU's L2 cache, so
no call finds its inputs already cached). On a GPU every call starts from an idle device and is timed with
CUDA events: the number is a call's latency as a caller sees it, launch overhead included. The ratios
artifact/eager and artifact/compile come from medians of the same invocation, and are judged against the
project's targets; a missed target says by how much.

The statistics (``Stats``, ``measure``), the timers and the table/JSON rendering are plain Python and are
tested on the CPU; only the candidates need a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import atomic
from .errors import NoGpuError, ZooError
from .numerics import compare
from .policies.base import InputSpec
from .bench_timing import CudaEventTimer, PerfCounterTimer, Stats, measure, percentile, timer_for  # noqa: F401
from .report import format_table, markdown_table

FORMAT = "zoo-bench/1"
BENCH_JSON = "bench.json"
BENCH_MD = "bench.md"
# Inputs are drawn from these seeds on: never the seeds torch.export traced with or verification uses.
INPUT_SEED = 20_000
MIB = float(2**20)


# ------------------------------------------------------------------------------------------------------
# Targets


@dataclass(frozen=True)
class Targets:
    artifact_vs_eager: float = 0.7  # artifact latency at most this fraction of eager's
    artifact_vs_compile: float = 1.05  # ... and at most this multiple of torch.compile's
    memory_vs_eager: float = 1.0  # artifact peak GPU memory at most eager's
    rotary_copy_fraction: float = 0.70  # rotary bandwidth at least this fraction of device copy bandwidth


TARGETS = Targets()


def judge_at_most(value: Optional[float], limit: float) -> Dict[str, Any]:
    """A ratio that should be <= ``limit``; when it is not, by how much (percent of the limit) it misses."""
    if value is None or not math.isfinite(value):
        return {"value": value, "limit": limit, "ok": None, "text": "not measured"}
    if value <= limit:
        return {"value": value, "limit": limit, "ok": True, "text": f"met ({value:.2f} <= {limit:.2f})"}
    return {"value": value, "limit": limit, "ok": False,
            "text": f"missed by {_percent((value / limit - 1.0) * 100)} ({value:.2f} > {limit:.2f})"}


def judge_at_least(value: Optional[float], limit: float) -> Dict[str, Any]:
    """A fraction that should be >= ``limit``; when it is not, by how much (percent of the limit) it misses."""
    if value is None or not math.isfinite(value):
        return {"value": value, "limit": limit, "ok": None, "text": "not measured"}
    if value >= limit:
        return {"value": value, "limit": limit, "ok": True, "text": f"met ({value:.2f} >= {limit:.2f})"}
    return {"value": value, "limit": limit, "ok": False,
            "text": f"missed by {_percent((1.0 - value / limit) * 100)} ({value:.2f} < {limit:.2f})"}


def _percent(p: float) -> str:
    return f"{p:.1f}%" if p < 10 else f"{p:.0f}%"


# ------------------------------------------------------------------------------------------------------
# Candidates and their measurement


RunFn = Callable[[Sequence[torch.Tensor]], List[torch.Tensor]]


@dataclass
class Candidate:
    """One way of running a method. ``build`` returns ``run(args) -> outputs``: args in the method's
    signature order, outputs in its output order. ``teardown`` frees what ``build`` made (device memory)."""

    name: str
    build: Callable[[], RunFn]
    teardown: Callable[[], None] = lambda: None
    what: str = ""  # one line saying what exactly runs
    skipped: str = ""  # set instead of building: why this candidate is not measured


class _Memory:
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


def bench_candidate(candidate: Candidate, cases: Sequence[Tuple[Dict[str, int], Sequence[Sequence[torch.Tensor]]]],
                    warmup: int, runs: int, device: str, keep_outputs: bool = True,
                    profile: bool = False) -> List[Dict[str, Any]]:
    """Build one candidate, then for each size case warm it, reset the peak counter and time it.

    Returns one record per case: stats, peak memory, build and first-call seconds (the first call includes
    torch.compile's compilation), the outputs of the case's first input set (on the CPU, for agreement),
    or ``error`` when building or running failed: a failing candidate does not stop the others.
    """
    if candidate.skipped:
        return [{"skipped": candidate.skipped} for _ in cases]
    dev = torch.device(device)
    timer = timer_for(device)
    memory = _Memory(dev)
    memory.before_build()
    records: List[Dict[str, Any]] = []
    start = time.perf_counter()
    try:
        run = candidate.build()
    except Exception as exc:  # a candidate that cannot be built is reported, the bench goes on
        candidate.teardown()
        return [{"error": f"build failed: {error_line(exc)}"} for _ in cases]
    build_s = time.perf_counter() - start
    try:
        with torch.no_grad():
            for sizes, inputs_list in cases:
                try:
                    records.append(_time_case(run, inputs_list, warmup, runs, timer, memory, keep_outputs,
                                              build_s))
                    if profile and dev.type == "cuda":
                        records[-1]["top_kernels"] = top_kernels(run, inputs_list)
                except Exception as exc:  # e.g. out of memory at one size: record it, try the next size
                    records.append({"error": f"run failed at sizes {sizes}: {error_line(exc)}"})
    finally:
        del run
        candidate.teardown()
        memory.before_build()  # frees cached blocks so the next candidate starts from the same state
    return records


def top_kernels(run: RunFn, inputs_list, calls: int = 3, top: int = 6) -> List[Dict[str, Any]]:
    """Where a candidate's device time goes: its kernels by total device time per call (CUDA profiler).

    CUPTI sees every kernel the process launches, an AOTI ``.so``'s too, so the artifact and torch.compile
    can be compared kernel by kernel when one is slower.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for k in range(calls):
            run(inputs_list[k % len(inputs_list)])
        torch.cuda.synchronize()
    kernels = [(e.key, e.self_device_time_total, e.count) for e in prof.key_averages()
               if e.self_device_time_total > 0]
    total = sum(t for _, t, _ in kernels) or 1.0
    kernels.sort(key=lambda k: -k[1])
    rows = [{"kernel": name if len(name) <= 90 else name[:87] + "...", "ms_per_call": t / 1e3 / calls,
             "launches_per_call": n / calls, "share": t / total} for name, t, n in kernels[:top]]
    return [{"kernel": "(all kernels)", "ms_per_call": total / 1e3 / calls,
             "launches_per_call": sum(n for _, _, n in kernels) / calls, "share": 1.0}] + rows


def _time_case(run: RunFn, inputs_list, warmup: int, runs: int, timer, memory: _Memory, keep_outputs: bool,
               build_s: float) -> Dict[str, Any]:
    t0 = time.perf_counter()
    first = run(inputs_list[0])
    timer.sync()
    first_call_s = time.perf_counter() - t0
    outputs = [t.detach().to("cpu") for t in first] if keep_outputs else None
    del first
    stats = measure(run, inputs_list, max(0, warmup - 1), runs, timer, on_warm=memory.reset_peak)
    return {"stats": stats.as_dict(), **memory.peak(), "build_s": round(build_s, 3),
            "first_call_s": round(first_call_s, 3), "_outputs": outputs}


# ------------------------------------------------------------------------------------------------------
# Inputs


def input_specs(io_spec: Dict[str, Any], method: str) -> List[InputSpec]:
    entry = io_spec["methods"].get(method)
    if entry is None:
        raise ZooError(f"io_spec.json has no method {method!r}", f"methods: {', '.join(io_spec['methods'])}")
    return [InputSpec(**spec) for spec in entry["inputs"]]


def set_bytes(specs: Sequence[InputSpec], sizes: Dict[str, int]) -> int:
    total = 0
    for spec in specs:
        numel = math.prod(spec.concrete_shape(sizes))
        total += numel * torch.empty((), dtype=spec.torch_dtype()).element_size()
    return total


def auto_input_sets(bytes_per_set: int, device: str, cap: int = 16, memory_cap: int = 8 << 30) -> int:
    """Enough distinct input sets that together they are twice the GPU's L2 cache (at least 2, at most
    ``cap``, and within ``memory_cap`` bytes unless two sets already exceed it). 4 on the CPU."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return 4
    l2 = int(getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) or (50 << 20))
    want = math.ceil(2 * l2 / max(1, bytes_per_set))
    fit = max(2, memory_cap // max(1, bytes_per_set))
    return int(max(2, min(cap, want, fit)))


def draw_inputs(specs: Sequence[InputSpec], sizes: Dict[str, int], count: int, device: str,
                seed: int = INPUT_SEED) -> List[Tuple[torch.Tensor, ...]]:
    """``count`` distinct input sets, each from its own seeded generator, placed on ``device``."""
    sets = []
    for k in range(count):
        g = torch.Generator().manual_seed(seed + k)
        sets.append(tuple(spec.sample(g, sizes).to(device) for spec in specs))
    return sets


def size_cases(io_spec: Dict[str, Any], requested: Dict[str, List[int]]) -> List[Dict[str, int]]:
    """The export's example sizes, or each requested dynamic size (one dim varied at a time)."""
    base = {k: int(v) for k, v in (io_spec.get("example_sizes") or {}).items()}
    dynamic = io_spec.get("dynamic") or {}
    if not requested:
        return [base]
    cases = []
    for dim, values in requested.items():
        if dim not in dynamic:
            raise ZooError(f"--sizes names {dim!r}, which is not a dynamic dim of this run",
                           f"dynamic dims: {', '.join(dynamic) or 'none (the unit has static shapes)'}")
        lo, hi = int(dynamic[dim]["min"]), int(dynamic[dim]["max"])
        for value in values:
            if not lo <= value <= hi:
                raise ZooError(f"--sizes {dim}={value} is outside the range the artifact accepts [{lo}, {hi}]",
                               "bench only at sizes the artifact was exported for")
            case = {**base, dim: int(value)}
            if case not in cases:
                cases.append(case)
    return cases


def parse_sizes(items: Sequence[str]) -> Dict[str, List[int]]:
    """``["seq=128,512"]`` -> ``{"seq": [128, 512]}``."""
    out: Dict[str, List[int]] = {}
    for item in items:
        dim, eq, values = item.partition("=")
        try:
            if not eq or not dim.strip():
                raise ValueError
            out.setdefault(dim.strip(), []).extend(int(v) for v in values.split(",") if v.strip())
        except ValueError:
            raise ZooError(f"bad --sizes {item!r}", "write DIM=SIZE[,SIZE...], e.g. --sizes seq=128,512,2048") from None
    return out


# ------------------------------------------------------------------------------------------------------
# One method at several sizes


def bench_method(method: str, specs: Sequence[InputSpec], cases: Sequence[Dict[str, int]],
                 candidates: Sequence[Candidate], warmup: int, runs: int, device: str,
                 input_sets: Optional[int] = None, targets: Targets = TARGETS,
                 profile: bool = False) -> List[Dict[str, Any]]:
    """Measure every candidate at every size case on the same inputs; one result per case.

    All input sets are drawn (and placed on the device) before any candidate is built, so every candidate
    sees the same tensors and none pays for them in its memory figure.
    """
    drawn = []
    for sizes in cases:
        count = input_sets or auto_input_sets(set_bytes(specs, sizes), device)
        drawn.append((sizes, draw_inputs(specs, sizes, count, device)))
    per_candidate = {c.name: bench_candidate(c, drawn, warmup, runs, device, profile=profile) for c in candidates}
    results = []
    for i, (sizes, inputs) in enumerate(drawn):
        records = {name: recs[i] for name, recs in per_candidate.items()}
        result = {"method": method, "sizes": sizes, "input_sets": len(inputs),
                  "candidates": {name: {k: v for k, v in rec.items() if k != "_outputs"}
                                 for name, rec in records.items()},
                  "what": {c.name: c.what for c in candidates}}
        result["agreement"] = agreement(records)
        result.update(judge_method(result["candidates"], targets))
        results.append(result)
    return results


def carried_inputs(specs: Sequence[InputSpec], output_names: Sequence[str]) -> List[int]:
    """Inputs a method hands back as ``<name>_next`` (LingBot-VA's KV pool in the ``io`` layout)."""
    returned = set(output_names)
    return [i for i, spec in enumerate(specs) if f"{spec.name}_next" in returned]


def carried_state_cost(method: str, specs: Sequence[InputSpec], output_names: Sequence[str],
                       timed: Sequence[Dict[str, Any]], warmup: int, runs: int, device: str,
                       input_sets: Optional[int] = None) -> List[Dict[str, Any]]:
    """What passing state in and out costs per call, against an in-place buffer: one copy of each carried input.

    A method that returns an updated pool as a new tensor (``index_copy``, not ``index_copy_``) must write the
    whole pool, not just the new slots: an AOTI ``.so`` may not overwrite its inputs. That copy is timed here
    alone, on the same rotated input sets and timer as the candidates, and reported as a fraction of the
    artifact's median latency at the same sizes (``timed``: ``bench_method``'s results). Empty when the
    method carries nothing.
    """
    carried = carried_inputs(specs, output_names)
    names = [specs[i].name for i in carried]
    rows = []
    for result in timed if carried else ():
        sizes = result["sizes"]
        art = ((result["candidates"].get("artifact") or {}).get("stats") or {}).get("median")
        per_set = [specs[i] for i in carried]
        count = input_sets or auto_input_sets(set_bytes(per_set, sizes), device)
        drawn = [(sizes, draw_inputs(per_set, sizes, count, device))]
        copy = Candidate("state copy", lambda: (lambda args: [t.clone() for t in args]),
                         what="clone() of each carried input")
        (rec,) = bench_candidate(copy, drawn, warmup, runs, device, keep_outputs=False)
        median = (rec.get("stats") or {}).get("median")
        rows.append({"method": method, "sizes": sizes, "inputs": names, "bytes": set_bytes(per_set, sizes),
                     "copy": rec.get("stats"), "error": rec.get("error"),
                     "fraction_of_artifact": median / art if median is not None and art else None})
    return rows


def agreement(records: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """Each candidate's outputs on the first input set against eager's: worst relative L2, lowest cosine.

    Timing an artifact that computes something else would mean nothing; this is a cross-check on the timed
    inputs, not the verification (``zoo.verify`` judges the artifact against eager with the recipe's rules).
    """
    ref = (records.get("eager") or {}).get("_outputs")
    out: Dict[str, Any] = {}
    if ref is None:
        return out
    for name, rec in records.items():
        got = rec.get("_outputs")
        if name == "eager" or got is None:
            continue
        if len(got) != len(ref):
            out[name] = {"error": f"{len(got)} outputs, eager gives {len(ref)}"}
            continue
        comps = [compare(f"out{i}", g, r) for i, (g, r) in enumerate(zip(got, ref))]
        out[name] = {"worst_rel_l2": max(c.rel_l2 for c in comps), "min_cosine": min(c.cosine for c in comps),
                     "outputs": len(comps)}
    return out


def ratios(candidates: Dict[str, Dict[str, Any]]) -> Dict[str, Optional[float]]:
    def median(name: str) -> Optional[float]:
        stats = (candidates.get(name) or {}).get("stats")
        return stats["median"] if stats else None

    art, eager, comp = median("artifact"), median("eager"), median("compile")
    return {"artifact/eager": art / eager if art is not None and eager else None,
            "artifact/compile": art / comp if art is not None and comp else None}


def judge_method(candidates: Dict[str, Dict[str, Any]], targets: Targets = TARGETS) -> Dict[str, Any]:
    r = ratios(candidates)
    art_peak = (candidates.get("artifact") or {}).get("peak_bytes")
    eager_peak = (candidates.get("eager") or {}).get("peak_bytes")
    memory = art_peak / eager_peak if art_peak is not None and eager_peak else None
    return {"ratios": {**r, "memory artifact/eager": memory},
            "targets": {"artifact/eager": judge_at_most(r["artifact/eager"], targets.artifact_vs_eager),
                        "artifact/compile": judge_at_most(r["artifact/compile"], targets.artifact_vs_compile),
                        "memory artifact/eager": judge_at_most(memory, targets.memory_vs_eager)}}


# ------------------------------------------------------------------------------------------------------
# Candidates of a run folder


def run_folder_candidates(run_dir: Path, method: str, device: str, compile_program: str = "exported",
                          compile_dynamic: Optional[bool] = None, with_compile: bool = True) -> List[Candidate]:
    """eager and compile from the saved programs; artifact from the method's extracted .so + weights blob."""
    run_dir = Path(run_dir)
    exported = run_dir / f"exported.{method}.pt2"
    holder: Dict[str, Any] = {}

    def program_module(path: Path) -> Callable[[], RunFn]:
        def build() -> RunFn:
            if not path.is_file():
                raise ZooError(f"{path} is missing", "bench a complete run folder (python -m zoo export RECIPE)")
            holder["module"] = load_program_module(path, device)
            return module_runner(holder["module"])
        return build

    def compiled(path: Path) -> Callable[[], RunFn]:
        def build() -> RunFn:
            holder["module"] = load_program_module(path, device)
            torch._dynamo.reset()  # a fresh compile per method: no graphs or recompile limits carried over
            return module_runner(torch.compile(holder["module"], dynamic=compile_dynamic))
        return build

    def free() -> None:
        holder.clear()

    candidates = [Candidate("eager", program_module(exported), free,
                            what=f"{exported.name} (original program, complex math) run op by op")]
    candidates.append(artifact_candidate(run_dir, method, device))
    if with_compile:
        source = run_dir / f"{compile_program}.{method}.pt2"
        dyn = {None: "dynamic=None", True: "dynamic=True", False: "dynamic=False"}[compile_dynamic]
        candidates.append(Candidate("compile", compiled(source), free,
                                    what=f"torch.compile({source.name}, mode=default, {dyn})"))
    else:
        candidates.append(Candidate("compile", lambda: None, skipped="--no-compile"))
    return candidates


def load_program_module(path: Path, device: str) -> torch.nn.Module:
    """A saved ExportedProgram as a module on ``device`` (constants and device arguments moved with it)."""
    from torch.export.passes import move_to_device_pass

    ep = torch.export.load(str(path))
    if torch.device(device).type != "cpu":
        ep = move_to_device_pass(ep, indexed_device(device))
    return ep.module()


def indexed_device(device: str) -> str:
    """``cuda`` -> ``cuda:N`` (the current device). A program moved to plain "cuda" asserts its tensors' device
    exactly, and under torch.compile "cuda" != "cuda:0" fails (seen on an H200)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(dev)


def module_runner(module: Callable[..., Any]) -> RunFn:
    from torch.utils import _pytree as pytree

    def run(args: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        return [t for t in pytree.tree_leaves(module(*args)) if isinstance(t, torch.Tensor)]

    return run


def artifact_candidate(run_dir: Path, method: str, device: str) -> Candidate:
    from .lowering import PTE_NAME

    run_dir = Path(run_dir)
    if torch.device(device).type != "cuda":
        return Candidate("artifact", lambda: None, skipped="the artifact runs only on a CUDA device")
    if not (run_dir / PTE_NAME).is_file():
        return Candidate("artifact", lambda: None,
                         skipped=f"not lowered ({PTE_NAME} missing): python -m zoo lower {run_dir}")
    holder: Dict[str, Any] = {}

    def build() -> RunFn:
        holder["method"] = ArtifactMethod(run_dir, method, device)
        return holder["method"]

    def teardown() -> None:
        if "method" in holder:
            holder.pop("method").close()

    return Candidate("artifact", build, teardown,
                     what=f"{method}'s .so + weights taken out of model.pte / aoti_cuda_blob.ptd, via torch's AOTI "
                          "runner, delegate I/O order")


class ArtifactMethod:
    """One lowered method run exactly as verification runs it: the .so and weights blob taken out of the
    shipped model.pte / aoti_cuda_blob.ptd (``verify.shipped_runners``), inputs handed over in the delegate's
    order (``verify.run_in_delegate_order``)."""

    def __init__(self, run_dir: Path, method: str, device: str = "cuda"):
        from .lowering import PTD_NAME, PTE_NAME, load_io_order
        from .verify import aoti_runner_factory, shipped_runners

        run_dir = Path(run_dir)
        self.order = load_io_order(run_dir, method)
        self._open = contextlib.ExitStack()
        runners = self._open.enter_context(
            shipped_runners(run_dir / PTE_NAME, run_dir / PTD_NAME, [method], aoti_runner_factory, device))
        self.runner = runners[method]

    def __call__(self, args: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        from .verify import run_in_delegate_order

        return run_in_delegate_order(self.runner, self.order, args)

    def close(self) -> None:
        self.runner = None
        self._open.close()


# ------------------------------------------------------------------------------------------------------
# What the run folder already knows: stage times, artifact sizes


COST_STAGES = ("export", "rewrite", "cpu_check", "lower", "audit", "verify")


def export_cost(run_dir: Path) -> Dict[str, Optional[float]]:
    """Seconds per pipeline stage, from report.json (None for a stage that did not run)."""
    path = Path(run_dir) / "report.json"
    if not path.is_file():
        return {}
    try:
        stages = json.loads(path.read_text()).get("stages") or []
    except ValueError:
        return {}
    found = {s.get("stage"): s.get("seconds") for s in stages if s.get("status") == "done"}
    return {stage: found.get(stage) for stage in COST_STAGES}


def artifact_sizes(run_dir: Path) -> Dict[str, int]:
    run_dir = Path(run_dir)
    files = [run_dir / "model.pte", run_dir / "aoti_cuda_blob.ptd"] + sorted((run_dir / "so").glob("*.so")) \
        + sorted((run_dir / "so").glob("*.weights.blob"))
    return {str(p.relative_to(run_dir)): p.stat().st_size for p in files if p.is_file()}


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


# ------------------------------------------------------------------------------------------------------
# Rendering


def _ms(stats: Optional[Dict[str, float]]) -> str:
    if not stats:
        return ""
    return f"{stats['median']:.3f} [{stats['p10']:.3f}-{stats['p90']:.3f}]"


def _cell(rec: Dict[str, Any]) -> str:
    if "skipped" in rec:
        return f"skipped: {rec['skipped']}"
    if "error" in rec:
        return f"FAILED: {rec['error']}"
    return _ms(rec.get("stats"))


def _mib(n: Optional[int]) -> str:
    return "" if n is None else f"{n / MIB:.1f}"


def _sizes(sizes: Dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sizes.items()) or "-"


def _ratio_cell(judgement: Dict[str, Any]) -> str:
    value = judgement.get("value")
    if judgement.get("ok") is None:
        return "-"
    head = f"{value:.2f}"
    return f"{head} ok" if judgement["ok"] else f"{head} {judgement['text'].split(' (')[0]}"


def latency_rows(results: Sequence[Dict[str, Any]]) -> List[List[str]]:
    t = TARGETS
    rows = [["method", "sizes", "artifact ms", "eager ms", "compile ms",
             f"artifact/eager (<= {t.artifact_vs_eager:g})", f"artifact/compile (<= {t.artifact_vs_compile:g})",
             "peak MiB artifact", "peak MiB eager", f"memory (<= {t.memory_vs_eager:g}x eager)",
             "artifact vs eager"]]
    for r in results:
        c = r["candidates"]
        name = f"{r['unit']}: {r['method']}" if r.get("unit") else r["method"]
        agree = (r.get("agreement") or {}).get("artifact") or {}
        agree_text = ("" if not agree else agree.get("error") or
                      f"rel L2 {agree['worst_rel_l2']:.1e}, cos {agree['min_cosine']:.5f}")
        rows.append([name, _sizes(r["sizes"]), _cell(c.get("artifact", {})), _cell(c.get("eager", {})),
                     _cell(c.get("compile", {})), _ratio_cell(r["targets"]["artifact/eager"]),
                     _ratio_cell(r["targets"]["artifact/compile"]), _mib(c.get("artifact", {}).get("peak_bytes")),
                     _mib(c.get("eager", {}).get("peak_bytes")), _ratio_cell(r["targets"]["memory artifact/eager"]),
                     agree_text])
    return rows


def kernel_rows(results: Sequence[Dict[str, Any]]) -> List[List[str]]:
    rows = [["method", "sizes", "candidate", "kernel", "ms per call", "launches per call", "share"]]
    for r in results:
        name = f"{r['unit']}: {r['method']}" if r.get("unit") else r["method"]
        for cand, rec in r["candidates"].items():
            for k in rec.get("top_kernels") or []:
                rows.append([name, _sizes(r["sizes"]), cand, k["kernel"], f"{k['ms_per_call']:.3f}",
                             f"{k['launches_per_call']:g}", f"{100 * k['share']:.0f}%"])
    return rows


def carried_rows(carried: Sequence[Dict[str, Any]]) -> List[List[str]]:
    rows = [["method", "sizes", "carried inputs", "MiB", "copy ms", "share of artifact latency"]]
    for r in carried:
        name = f"{r['unit']}: {r['method']}" if r.get("unit") else r["method"]
        share = r.get("fraction_of_artifact")
        rows.append([name, _sizes(r["sizes"]), ", ".join(r["inputs"]), _mib(r["bytes"]),
                     f"FAILED: {r['error']}" if r.get("error") else _ms(r.get("copy")),
                     "" if share is None else f"{100 * share:.1f}%"])
    return rows


def rotary_rows(rotary: Sequence[Dict[str, Any]]) -> List[List[str]]:
    rows = [["case", "shape", "dtype", "eager complex ms", "real pairs ms", "speedup", "GB/s",
             f"of copy BW (>= {TARGETS.rotary_copy_fraction:.0%})"]]
    for r in rotary:
        j = r["target"]
        frac = "-" if j.get("ok") is None else (f"{j['value']:.1%} ok" if j["ok"] else
                                                f"{j['value']:.1%} {j['text'].split(' (')[0]}")
        rows.append([r["case"], "x".join(str(s) for s in r["shape"]), r["dtype"], _ms(r["eager"]["stats"]),
                     _ms(r["pairs"]["stats"]), f"{r['speedup']:.2f}x", f"{r['pairs_gbps']:.1f}", frac])
    return rows


def cost_rows(cost: Dict[str, Optional[float]], sizes: Dict[str, int]) -> List[List[str]]:
    rows = [["stage", "seconds"]] + [[k, "-" if v is None else f"{v:.1f}"] for k, v in cost.items()]
    rows += [[f"size of {name}", f"{n / MIB:.1f} MiB"] for name, n in sizes.items()]
    return rows


UNIT_STAGES = ("build", "export", "rewrite", "lower", "verify", "bench")


def units_rows(units: Sequence[Dict[str, Any]]) -> List[List[str]]:
    """Per unit: seconds per stage (or why it did not run) and the artifact files' sizes."""
    rows = [["unit", "status"] + [f"{s} s" for s in UNIT_STAGES] + ["model.pte MiB", ".ptd MiB", ".so MiB"]]
    for u in units:
        cells = []
        for s in UNIT_STAGES:
            st = (u.get("stages") or {}).get(s) or {}
            cells.append(f"{st['seconds']:.1f}" if st.get("seconds") is not None and st.get("status") == "done"
                         else st.get("status", "-"))
        sizes = u.get("artifact_sizes") or {}
        so = sum(n for k, n in sizes.items() if k.endswith(".so"))
        rows.append([u["unit"], u.get("status", "?")] + cells +
                    [_mib(sizes.get("model.pte")), _mib(sizes.get("aoti_cuda_blob.ptd")), _mib(so or None)])
    return rows


def render(result: Dict[str, Any], markdown: bool = True) -> str:
    """The bench result as Markdown (``markdown=True``) or as fixed-width text for the terminal."""
    table = markdown_table if markdown else format_table

    def heading(title: str) -> List[str]:
        return [f"## {title}", ""] if markdown else [title]

    env = result.get("environment") or {}
    s = result.get("settings") or {}
    where = env.get("gpu") or env.get("cpu") or env.get("device")
    out = [f"# zoo bench: {result.get('name', '?')}", ""] if markdown else []
    out += [f"{where}; torch {env.get('torch')}, CUDA {env.get('cuda')}, executorch {env.get('executorch')}; "
            f"{s.get('runs')} timed calls after {s.get('warmup')} warm-up, timer {s.get('timer')}; "
            "times are median [p10-p90] ms per call", ""]
    if result.get("command"):
        out += [f"command: `{result['command']}`" if markdown else f"command: {result['command']}", ""]
    if result.get("methods"):
        out += heading("Latency") + [table(latency_rows(result["methods"])), ""]
        seen: List[str] = []
        for r in result["methods"]:
            for name, what in (r.get("what") or {}).items():
                line = f"{name}: {what}"
                if what and line not in seen:
                    seen.append(line)
        out += [("- " if markdown else "") + line for line in seen] + [""]
    kernels = kernel_rows(result.get("methods") or [])
    if len(kernels) > 1:
        out += heading("Where the device time goes (top kernels per call, CUDA profiler)") + [table(kernels), ""]
    if result.get("carried_state"):
        out += heading("State passed in and out (per call, against an in-place buffer)") + [
            table(carried_rows(result["carried_state"])), "",
            "The method returns each carried input updated as a new tensor, so every call writes it whole; the "
            "copy column times exactly that write (clone() of the inputs) alone.", ""]
    if result.get("rotary"):
        copy = result.get("copy_bandwidth") or {}
        out += heading("Rotary embedding alone") + [table(rotary_rows(result["rotary"])), ""]
        launched = [[r["case"], k["kernel"], f"{k['launches_per_call']:g}", f"{1e3 * k['ms_per_call']:.1f}"]
                    for r in result["rotary"] for k in (r.get("pairs_kernels") or [])[1:]]
        if launched:
            out += [table([["case", "real-pair kernel", "launches per call", "us per call"]] + launched), ""]
        timings = sorted({r["timing"] for r in result["rotary"] if r.get("timing")})
        if timings:
            out += [f"rotary times are device times per call: {'; '.join(timings)}", ""]
        if copy:
            out += [f"device copy bandwidth {copy['gbps']:.1f} GB/s (copy_ of {copy['bytes'] / 2**30:.2f} GiB, "
                    "bytes read + written per copy over its median time)", ""]
    if result.get("units"):
        out += heading("Export cost per stage and artifact sizes") + [table(units_rows(result["units"])), ""]
        out += [f"- {u['unit']} failed: {u['error']}" for u in result["units"] if u.get("error")]
        out += [""] if any(u.get("error") for u in result["units"]) else []
    if result.get("export_cost") or result.get("artifact_sizes"):
        out += heading("Export cost and artifact sizes") + [
            table(cost_rows(result.get("export_cost") or {}, result.get("artifact_sizes") or {})), ""]
    missed = missed_targets(result)
    if missed:
        out += heading("Targets missed") + [f"- {m}" for m in missed] + [""]
    return "\n".join(out)


def missed_targets(result: Dict[str, Any]) -> List[str]:
    missed = []
    for r in result.get("methods") or []:
        for key, j in r["targets"].items():
            if j.get("ok") is False:
                who = f"{r['unit']}: {r['method']}" if r.get("unit") else r["method"]
                missed.append(f"{who} ({_sizes(r['sizes'])}) {key}: {j['text']}")
    for r in result.get("rotary") or []:
        if r["target"].get("ok") is False:
            missed.append(f"rotary {r['case']}: fraction of copy bandwidth {r['target']['text']}")
    return missed


def write_results(result: Dict[str, Any], json_path: Path, md_path: Optional[Path]) -> None:
    atomic.write_json(json_path, _finite(result))
    if md_path is not None:
        atomic.write_text(md_path, render(result, markdown=True) + "\n")


def _finite(value: Any) -> Any:
    """JSON has no inf/nan: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def error_line(exc: BaseException) -> str:
    """The error's first line, and its root cause's: dynamo wraps the real error ("RuntimeError when making
    fake tensor call") and the wrapper alone does not say what failed."""
    line = _first_line(exc)
    root = exc
    while (root.__cause__ or root.__context__) is not None and root is not (root.__cause__ or root.__context__):
        root = root.__cause__ or root.__context__
    if root is not exc:
        line = f"{line} (cause: {_first_line(root)})"
    return line if len(line) <= 400 else line[:397] + "..."


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return f"{type(exc).__name__}: {text.splitlines()[0]}"


# ------------------------------------------------------------------------------------------------------
# Command line


def build_parser(prog: str = "python -m zoo bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="a run folder written by `python -m zoo export` (lowered on a GPU)")
    p.add_argument("--methods", default=None, help="comma-separated methods (default: all in io_spec.json)")
    p.add_argument("--sizes", action="append", default=[], metavar="DIM=N[,N...]",
                   help="dynamic sizes to bench at, e.g. seq=128,512,2048 (default: the export's example sizes)")
    p.add_argument("--runs", type=int, default=50, help="timed calls per candidate and size (default 50)")
    p.add_argument("--warmup", type=int, default=10, help="untimed calls first (default 10)")
    p.add_argument("--input-sets", type=int, default=None,
                   help="distinct input sets to rotate through (default: enough to exceed twice the L2 cache)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile candidate")
    p.add_argument("--compile-program", choices=("exported", "rewritten"), default="exported",
                   help="which saved program torch.compile gets (default: exported, what a user would compile)")
    p.add_argument("--compile-dynamic", choices=("auto", "true", "false"), default="auto",
                   help="torch.compile's dynamic= (auto: true when the unit has dynamic dims, as the artifact "
                        "is compiled once for the whole range; otherwise torch's default)")
    p.add_argument("--rotary", action="store_true", help="also run the rotary-only microbenchmark")
    p.add_argument("--profile", action="store_true",
                   help="also list each candidate's top kernels by device time (CUDA profiler, after timing)")
    p.add_argument("--rotary-shape", action="append", default=[], metavar="B,L,H,D",
                   help="rotary case shape (repeatable; default: SmolLM2 at seq 2048 and a 16k-token 24x128 case)")
    p.add_argument("--device", default=None,
                   help="cuda (default) or cpu; cpu checks the harness only: the artifact needs CUDA")
    p.add_argument("--json", type=Path, default=None, help=f"where to write JSON (default RUN_DIR/{BENCH_JSON})")
    p.add_argument("--markdown", type=Path, default=None, help=f"where to write Markdown (default RUN_DIR/{BENCH_MD})")
    return p


def resolve_device(requested: Optional[str]) -> str:
    if requested in (None, "cuda") or (requested or "").startswith("cuda"):
        if not torch.cuda.is_available():
            raise NoGpuError("`python -m zoo bench` times the artifact on a CUDA GPU, and none is visible here",
                             "run it on the GPU machine the run was lowered on; --device cpu only checks the "
                             "harness (eager and torch.compile, no artifact)")
        return requested or "cuda"
    if requested != "cpu":
        raise ZooError(f"--device {requested!r} is not a device zoo benches on", "use cuda or cpu")
    return "cpu"


def load_io_spec(run_dir: Path) -> Dict[str, Any]:
    path = Path(run_dir) / "io_spec.json"
    if not Path(run_dir).is_dir():
        raise ZooError(f"run folder {run_dir} does not exist", "pass the folder `python -m zoo export` wrote")
    if not path.is_file():
        raise ZooError(f"{run_dir} has no io_spec.json, so it is not a zoo run folder (or its export failed)",
                       "pass the folder `python -m zoo export RECIPE` wrote; report.md there says what failed")
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise ZooError(f"{path} is not valid JSON ({exc})", "export the run again") from None


def run_name(run_dir: Path) -> str:
    path = Path(run_dir) / "recipe.yaml"
    if path.is_file():
        from omegaconf import OmegaConf

        with contextlib.suppress(Exception):  # the name is a label only; the folder name stands in
            return str(OmegaConf.load(path).get("name") or Path(run_dir).name)
    return Path(run_dir).resolve().name


def check_counts(runs: int, warmup: int, input_sets: Optional[int]) -> None:
    if runs < 1:
        raise ZooError(f"--runs {runs}: at least one timed run is needed", "use e.g. --runs 50")
    if warmup < 0:
        raise ZooError(f"--warmup {warmup} is negative", "use 0 or more warm-up calls (default 10)")
    if input_sets is not None and input_sets < 1:
        raise ZooError(f"--input-sets {input_sets}: at least one input set is needed",
                       "leave it out to use enough sets to exceed the L2 cache")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    check_counts(args.runs, args.warmup, args.input_sets)
    run_dir = Path(args.run_dir).expanduser()
    io_spec = load_io_spec(run_dir)
    device = resolve_device(args.device)
    methods = args.methods.split(",") if args.methods else list(io_spec["methods"])
    for m in methods:
        input_specs(io_spec, m)  # unknown names fail before anything is timed
    cases = size_cases(io_spec, parse_sizes(args.sizes))
    dynamic = {"auto": True if io_spec.get("dynamic") else None, "true": True, "false": False}[args.compile_dynamic]

    result: Dict[str, Any] = {
        "format": FORMAT, "name": run_name(run_dir), "run_dir": str(run_dir), "environment": environment(device),
        "settings": {"runs": args.runs, "warmup": args.warmup, "input_sets": args.input_sets or "auto",
                     "timer": timer_for(device).name, "compile_program": args.compile_program,
                     "compile_dynamic": dynamic},
        "targets": asdict(TARGETS), "methods": [],
        "export_cost": export_cost(run_dir), "artifact_sizes": artifact_sizes(run_dir),
    }
    for m in methods:
        print(f"[zoo] bench {m} at {len(cases)} size(s) ...", file=sys.stderr, flush=True)
        candidates = run_folder_candidates(run_dir, m, device, args.compile_program, dynamic, not args.no_compile)
        specs = input_specs(io_spec, m)
        timed = bench_method(m, specs, cases, candidates, args.warmup, args.runs, device, args.input_sets,
                             profile=args.profile)
        result["methods"] += timed
        carried = carried_state_cost(m, specs, io_spec["methods"][m].get("outputs") or [], timed, args.warmup,
                                     args.runs, device, args.input_sets)
        if carried:
            result.setdefault("carried_state", []).extend(carried)
    if args.rotary or args.rotary_shape:
        from .bench_rotary import DEFAULT_CASES, parse_case, run_rotary

        cases_r = [parse_case(text) for text in args.rotary_shape] or list(DEFAULT_CASES)
        # The method timings above stand on their own: a rotary failure is recorded, not allowed to lose them.
        write_results(result, args.json or run_dir / BENCH_JSON, args.markdown or run_dir / BENCH_MD)
        try:
            result.update(run_rotary(device, runs=args.runs, warmup=args.warmup, cases=cases_r,
                                     compile=not args.no_compile))
        except Exception as exc:  # noqa: BLE001 - reported in the results and on stderr
            result["rotary_error"] = error_line(exc)
            print(f"[zoo] rotary benchmark failed: {result['rotary_error']}", file=sys.stderr)
    write_results(result, args.json or run_dir / BENCH_JSON, args.markdown or run_dir / BENCH_MD)
    print(render(result, markdown=False))
    return 0
