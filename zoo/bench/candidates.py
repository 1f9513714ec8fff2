"""The candidates a bench times and how they are timed: the artifact (its .so + weights out of model.pte /
aoti_cuda_blob.ptd), eager and torch.compile of the saved programs, each built, warmed and measured in
isolation on the same pre-drawn input sets; their agreement with eager, the cost of state carried in and out,
and where a candidate's device time goes (top kernels).
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from zoo.contract.artifact import PTD_NAME, PTE_NAME
from zoo.core.errors import ZooError
from zoo.core.numerics import compare
from zoo.contract.io_spec import InputSpec, IoSpec
from zoo.contract.run_folder import RunFolder
from zoo.runtimes.aoti import aoti_runner_factory, run_in_delegate_order, shipped_runners
from zoo.bench.measuring import PeakMemory, measure, timer_for
from zoo.bench.rendering import TARGETS, Targets, judge_method

# Inputs are drawn from these seeds on: never the seeds torch.export traced with or verification uses.
INPUT_SEED = 20_000


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


def bench_candidate(candidate: Candidate, cases: Sequence[Tuple[Dict[str, int], Sequence[Sequence[torch.Tensor]]]],
                    warmup: int, runs: int, device: str, keep_outputs: bool = True,
                    profile: int = 0, timer=None) -> List[Dict[str, Any]]:
    """Build one candidate, then for each size case warm it, reset the peak counter and time it.

    Returns one record per case: stats, peak memory, build and first-call seconds (the first call includes
    torch.compile's compilation), the outputs of the case's first input set (on the CPU, for agreement),
    or ``error`` when building or running failed: a failing candidate does not stop the others.
    """
    if candidate.skipped:
        return [{"skipped": candidate.skipped} for _ in cases]
    dev = torch.device(device)
    timer = timer or timer_for(device)  # tests hand in a clock the candidates advance
    memory = PeakMemory(dev)
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
                        records[-1]["top_kernels"] = top_kernels(run, inputs_list, top=int(profile))
                except Exception as exc:  # e.g. out of memory at one size: record it, try the next size
                    records.append({"error": f"run failed at sizes {sizes}: {error_line(exc)}"})
    finally:
        del run
        candidate.teardown()
        memory.before_build()  # frees cached blocks so the next candidate starts from the same state
    return records


# What a kernel does, read from its name (Inductor's, cuBLAS's, cuDNN's, ExecuTorch's Triton SDPA, torch's own),
# first match wins: the share of a step's device time each kind takes names the lever to work on.
KERNEL_KINDS = (
    ("attention", re.compile(r"sdpa|flash|fmha|attention|_attn", re.I)),
    ("convolution", re.compile(r"conv|cudnn", re.I)),
    ("gemm", re.compile(r"triton_tem_|gemm|nvjet|cutlass|xmma|cublas|splitk|_mm_|matmul", re.I)),
    # Not "copy" alone: Inductor names a fused kernel after every op in it, and "_to_copy" (a cast) or
    # "view_copy" (ExecuTorch's view ops) are no copies. "stack" and "index_copy" are what rewrites a KV pool.
    ("copy", re.compile(r"memcpy|memset|index_copy|index_put|scatter|_cat_|_cat$|stack|fill|clone", re.I)),
)


def kernel_kind(name: str) -> str:
    """``attention``, ``convolution``, ``gemm``, ``copy`` or ``other`` (element-wise and reductions)."""
    return next((kind for kind, pattern in KERNEL_KINDS if pattern.search(name)), "other")


def top_kernels(run: RunFn, inputs_list, calls: int = 3, top: int = 6) -> List[Dict[str, Any]]:
    """Where a candidate's device time goes: its kernels by total device time per call (CUDA profiler), after
    one row per kind of kernel (``kernel_kind``), named ``[kind]``.

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
    def row(name: str, t: float, n: float) -> Dict[str, Any]:
        return {"kernel": name if len(name) <= 90 else name[:87] + "...", "ms_per_call": t / 1e3 / calls,
                "launches_per_call": n / calls, "share": t / total}

    kinds: Dict[str, List[float]] = {}
    for name, t, n in kernels:
        kind = kinds.setdefault(kernel_kind(name), [0.0, 0])
        kind[0] += t
        kind[1] += n
    by_kind = sorted(kinds.items(), key=lambda item: -item[1][0])
    return ([row("(all kernels)", total, sum(n for _, _, n in kernels))]
            + [row(f"[{kind}]", t, n) for kind, (t, n) in by_kind] + [row(*k) for k in kernels[:top]])


def _time_case(run: RunFn, inputs_list, warmup: int, runs: int, timer, memory: PeakMemory, keep_outputs: bool,
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


def input_specs(io_spec: IoSpec, method: str) -> List[InputSpec]:
    entry = io_spec.methods.get(method)
    if entry is None:
        raise ZooError(f"io_spec.json has no method {method!r}", f"methods: {', '.join(io_spec.methods)}")
    return list(entry.inputs)


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


def size_cases(io_spec: IoSpec, requested: Dict[str, List[int]]) -> List[Dict[str, int]]:
    """The export's example sizes, or each requested dynamic size (one dim varied at a time)."""
    base = dict(io_spec.example_sizes)
    dynamic = io_spec.dynamic
    if not requested:
        return [base]
    cases = []
    for dim, values in requested.items():
        if dim not in dynamic:
            raise ZooError(f"--sizes names {dim!r}, which is not a dynamic dim of this run",
                           f"dynamic dims: {', '.join(dynamic) or 'none (the unit has static shapes)'}")
        lo, hi = dynamic[dim].min, dynamic[dim].max
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
                 profile: int = 0, timer=None) -> List[Dict[str, Any]]:
    """Measure every candidate at every size case on the same inputs; one result per case. ``timer``: the
    device's own (``timer_for``) unless one is handed in.

    All input sets are drawn (and placed on the device) before any candidate is built, so every candidate
    sees the same tensors and none pays for them in its memory figure.
    """
    drawn = []
    for sizes in cases:
        count = input_sets or auto_input_sets(set_bytes(specs, sizes), device)
        drawn.append((sizes, draw_inputs(specs, sizes, count, device)))
    per_candidate = {c.name: bench_candidate(c, drawn, warmup, runs, device, profile=profile, timer=timer)
                     for c in candidates}
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
    inputs, not the verification (``zoo.export.verify`` judges the artifact against eager with the recipe's rules).
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


# ------------------------------------------------------------------------------------------------------
# Candidates of a run folder


def run_folder_candidates(run_dir: Path, method: str, device: str, compile_program: str = "exported",
                          compile_dynamic: Optional[bool] = None, with_compile: bool = True) -> List[Candidate]:
    """eager and compile from the saved programs; artifact from the method's extracted .so + weights blob."""
    run = RunFolder(run_dir)
    exported = run.program("exported", method)
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
    candidates.append(artifact_candidate(run.path, method, device))
    if with_compile:
        source = run.program(compile_program, method)
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
    run_dir = Path(run_dir)
    if torch.device(device).type != "cuda":
        return Candidate("artifact", lambda: None, skipped="the artifact runs only on a CUDA device")
    if not RunFolder(run_dir).pte.is_file():
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
                     what=f"{method}'s .so + weights taken out of {PTE_NAME} / {PTD_NAME}, via torch's AOTI "
                          "runner, delegate I/O order")


class ArtifactMethod:
    """One lowered method run exactly as verification runs it: the .so and weights blob of the shipped
    model.pte / aoti_cuda_blob.ptd (``zoo.runtimes.aoti.shipped_runners``: the run's so/ while its stamp says it holds their
    bytes, else taken out of them), inputs handed over in the delegate's order (``zoo.runtimes.aoti.run_in_delegate_order``)."""

    def __init__(self, run_dir: Path, method: str, device: str = "cuda"):
        run = RunFolder(run_dir)
        self.order = run.io_order(method)
        self._open = contextlib.ExitStack()
        runners = self._open.enter_context(shipped_runners(run.pte, run.ptd, [method], aoti_runner_factory, device,
                                                           so_dir=run.so_dir))
        self.runner = runners[method]

    def __call__(self, args: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        return run_in_delegate_order(self.runner, self.order, args)

    def close(self) -> None:
        self.runner = None
        self._open.close()


# ------------------------------------------------------------------------------------------------------
# A failing candidate, in one line


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
