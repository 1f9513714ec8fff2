"""Verification of the shipped artifact: each method's ``.so`` + weights blob, taken out of the written
``model.pte`` / ``aoti_cuda_blob.ptd``, run on the GPU against the exported program run eagerly.

For every seed and every size combination (the recipe's ``verify.sizes`` plus each dynamic dim's bounds),
fresh inputs are drawn from ``io_spec.json``. The reference is ``exported.<method>.pt2`` as exported (complex
values and all: complex128 eager is the reference for float64 pairs), run eagerly on the same device. The
``.so`` gets its inputs in the delegate's order and its outputs are put back in the method's order
(``so/<method>.io.json``). Stateful methods keep their runner and their eager module across calls, called in
the same order. Per output: max |diff|, relative L2, cosine, judged by the recipe's tolerances:
  - float32 / float64 outputs: relative L2 <= ``verify.tolerance.float32`` / ``float64``;
  - integer and bool outputs: exact;
  - bf16 units: judged against ``reference_fp32.<method>.pt2``: the artifact may be no further from it than
    ``bf16_factor`` times eager bf16's own distance (never held to less than the float32 tolerance), with
    cosine >= ``bf16_min_cosine``.
A shape, dtype or output-count mismatch, or a non-finite value where the reference is finite, fails by itself.
Where an ExecuTorch build with the CUDA backend is importable, the ``.pte`` runs through it too.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import math
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch.utils import _pytree as pytree

from . import numerics
from .aoti_runner import AotiRunner
from .artifact import extract_method_files
from .errors import NoGpuError, VerificationFailed, ZooError, first_line
from .policies.base import InputSpec
from .progress import steps
from .report import format_table
from .run_folder import IO_SPEC_JSON, RunFolder, read_program

LOW_PRECISION = (torch.bfloat16, torch.float16)

# (method, .so path, weights blob path or None, device) -> an object whose run(inputs) returns outputs,
# both in the .so's own order.
RunnerFactory = Callable[[str, Path, Optional[Path], str], Any]


def aoti_runner_factory(method: str, so: Path, weights: Optional[Path], device: str):
    return AotiRunner(so, weights, device)


@dataclass
class Row:
    """One output of one call of one method, compared with its reference."""

    runtime: str  # "aoti" (torch's runner over the .so) or "executorch"
    method: str
    seed: int
    sizes: Dict[str, int]
    output: str
    shape: List[int]
    dtype: str
    max_abs: float
    rel_l2: float
    cosine: float
    tolerance: float
    ok: bool
    why: str = ""
    reference: str = "eager"  # what it was compared with
    eager_rel_l2: Optional[float] = None  # bf16: eager bf16's own distance from the float32 reference
    vs_eager: Optional[float] = None  # bf16: relative L2 of the artifact against eager bf16


@dataclass
class VerificationResult:
    rows: List[Row]
    device: str
    gpu: Dict[str, Any]
    executorch_runtime: str
    rotary_pairs: str
    unit_dtype: str
    seconds: float = 0.0
    notes: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.rows) and all(r.ok for r in self.rows)

    def failures(self) -> List[Row]:
        return [r for r in self.rows if not r.ok]

    def as_dict(self) -> Dict[str, Any]:
        return {"passed": self.ok, "device": self.device, "gpu": self.gpu, "executorch_runtime": self.executorch_runtime,
                "rotary_pairs": self.rotary_pairs, "unit_dtype": self.unit_dtype, "seconds": round(self.seconds, 3),
                "rows": [asdict(r) for r in self.rows], "notes": list(self.notes)}

    def summary(self) -> Dict[str, Any]:
        return {**self.as_dict(), "table": self.table()}

    def table(self) -> str:
        rows = [["runtime", "method", "seed", "sizes", "output", "max|diff|", "rel L2", "cosine", "tol", "result"]]
        for r in self.rows:
            extra = f" (eager {r.eager_rel_l2:.2e})" if r.eager_rel_l2 is not None else ""
            rows.append([r.runtime, r.method, r.seed, _sizes_text(r.sizes), r.output, f"{r.max_abs:.3e}",
                         f"{r.rel_l2:.3e}{extra}", f"{r.cosine:.6f}", f"{r.tolerance:.1e}",
                         "ok" if r.ok else "FAIL: " + r.why])
        head = (f"verification on {self.gpu.get('name', self.device)}: unit {self.unit_dtype}, rotary pairs "
                f"{self.rotary_pairs}; {self.executorch_runtime}")
        return head + "\n" + format_table(rows)

    def failure_message(self) -> str:
        lines = [f"  - {r.runtime} {r.method} seed={r.seed} sizes={_sizes_text(r.sizes)} output {r.output}: {r.why}"
                 for r in self.failures()]
        if not self.rows:
            lines = ["  - nothing was compared"]
        return "the artifact does not compute what eager PyTorch computes:\n" + "\n".join(lines)


def _sizes_text(sizes: Dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in sizes.items()) or "-"


# --- inputs and sizes --------------------------------------------------------------------------------------------


def size_cases(io_spec: Dict[str, Any], recipe) -> List[Dict[str, int]]:
    """Every combination of the sizes to verify at: ``verify.sizes`` plus each dynamic dim's min and max."""
    dynamic = io_spec.get("dynamic") or {d: {"min": r.min, "max": r.max} for d, r in recipe.dynamic.items()}
    per_dim = {dim: sorted(set(list(recipe.verify.sizes.get(dim, [])) + [int(rng["min"]), int(rng["max"])]))
               for dim, rng in dynamic.items()}
    names = list(per_dim)
    return [dict(zip(names, combo)) for combo in itertools.product(*(per_dim[n] for n in names))]


def draw_inputs(specs: Sequence[InputSpec], sizes: Dict[str, int], seed: int, method: str) -> List[torch.Tensor]:
    """Fresh inputs: the generator is seeded from (seed, method, sizes), never the export's example seed alone."""
    key = f"{seed}/{method}/{sorted(sizes.items())}".encode()
    generator = torch.Generator().manual_seed(int(hashlib.sha1(key).hexdigest()[:12], 16))
    return [spec.sample(generator, sizes) for spec in specs]


# --- judging -------------------------------------------------------------------------------------------------------


def _tolerance(dtype: torch.dtype, tolerance) -> Optional[float]:
    if dtype == torch.float64:
        return tolerance.float64
    if dtype.is_floating_point or dtype.is_complex:
        return tolerance.float32
    return 0.0  # integers and bools must match exactly


def compare_outputs(names: Sequence[str], got: Sequence[torch.Tensor], ref: Sequence[torch.Tensor], tolerance, *,
                    ref_fp32: Optional[Sequence[torch.Tensor]] = None) -> List[Tuple[numerics.Comparison, float, Dict]]:
    """Judge each output; returns (comparison, tolerance applied, extra facts) per output.

    With ``ref_fp32`` (bf16 units), floating outputs are judged against it, relative to ``ref``'s (eager low
    precision's) own distance from it."""
    results: List[Tuple[numerics.Comparison, float, Dict]] = []
    if len(got) != len(ref):
        c = numerics.Comparison("(outputs)", (len(got),), "-", math.inf, math.inf, -1.0, False,
                                f"the artifact returned {len(got)} outputs, eager returned {len(ref)}")
        return [(c, 0.0, {})]
    for i, (g, r) in enumerate(zip(got, ref)):
        name = names[i] if i < len(names) else f"output{i}"
        if g.dtype != r.dtype:
            c = numerics.compare(name, g.to(r.dtype) if g.shape == r.shape else g, r)
            c.ok, c.why = False, f"dtype {str(g.dtype).replace('torch.', '')} != reference " \
                                 f"{str(r.dtype).replace('torch.', '')}"
            results.append((c, 0.0, {}))
            continue
        # A bf16 unit's outputs are low-precision results whatever dtype they are returned in (a Llama unit
        # returns float32 logits computed in bf16): all of them are judged against the float32 reference.
        if ref_fp32 is not None and r.is_floating_point():
            results.append(_judge_low_precision(name, g, r, ref_fp32[i], tolerance))
            continue
        bound = _tolerance(r.dtype, tolerance)
        results.append((numerics.judge(numerics.compare(name, g, r), bound), bound, {}))
    return results


def _judge_low_precision(name: str, got: torch.Tensor, eager: torch.Tensor, ref32: torch.Tensor,
                         tolerance) -> Tuple[numerics.Comparison, float, Dict]:
    c, bound, eager_c = numerics.judge_low_precision(name, got, eager, ref32, tolerance)
    facts = {"reference": "eager float32", "eager_rel_l2": eager_c.rel_l2,
             "vs_eager": numerics.compare(name, got, eager).rel_l2}
    return c, bound, facts


# --- running --------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def full_fp32_precision() -> Iterator[None]:
    """Eager references in full float32: cuDNN convolutions default to TF32 on Ampere and newer, which puts
    the reference, not the artifact, about 1e-4 away from float32 math (seen on an H200 with Fast-WAM's patch
    embedding)."""
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved[0], saved[1]
        torch.set_float32_matmul_precision(saved[2])


def _default_device() -> str:
    if not torch.cuda.is_available():
        raise NoGpuError("verifying the artifact needs a CUDA device and none is visible",
                         "run `python -m zoo.lower RUN_DIR` on the machine with the GPU")
    return "cuda"


def _gpu_info(device: str) -> Dict[str, Any]:
    if device.startswith("cuda") and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        return {"name": torch.cuda.get_device_name(device), "capability": f"{major}{minor}"}
    return {"name": device}


def _eager_module(path: Path, device: str):
    if not path.exists():
        raise VerificationFailed(f"{path} is missing: nothing to verify the artifact against",
                                 "the run folder must hold the programs the export step saved; export again")
    program = read_program(path)
    if device != "cpu":
        from torch.export.passes import move_to_device_pass

        program = move_to_device_pass(program, device)
    return program.module()


def _flat_tensors(value: Any) -> List[torch.Tensor]:
    return [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]


def _to_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in LOW_PRECISION else t


def verify_artifact(run_dir: Union[RunFolder, Path], recipe, *, device: Optional[str] = None,
                    runner_factory: Optional[RunnerFactory] = None, raise_on_failure: bool = True,
                    try_executorch: bool = True) -> VerificationResult:
    """Run each method's shipped .so against eager at every seed and size; ``VerificationFailed`` (carrying the
    result as ``.result``) when any output is out of tolerance."""
    start = time.perf_counter()
    run = RunFolder(run_dir)
    device = device or _default_device()
    factory = runner_factory or aoti_runner_factory
    if not run.io_spec_file.exists():
        raise VerificationFailed(f"{run.io_spec_file} is missing: zoo cannot draw inputs for the methods",
                                 "the export step writes it; export the recipe again")
    io_spec = run.read_io_spec()
    per_method = io_spec.get("methods", io_spec)  # {"methods": {...}, "dynamic": ...} or methods at the top
    methods = list(recipe.unit.methods)
    missing = [m for m in methods if m not in per_method]
    if missing:
        raise VerificationFailed(f"{IO_SPEC_JSON} has no entry for method(s) {', '.join(missing)}",
                                 "the run folder does not belong to this recipe; export again")
    specs = {m: [InputSpec(**d) for d in per_method[m]["inputs"]] for m in methods}
    output_names = {m: list(per_method[m].get("outputs", [])) for m in methods}
    low_precision = recipe.unit.dtype == "bfloat16"
    cases = size_cases(io_spec, recipe)

    def run_all(runtime: str, call: Callable[[str, List[torch.Tensor]], List[torch.Tensor]]) -> List[Row]:
        eager = {m: _eager_module(run.program("exported", m), device) for m in methods}
        ref32 = ({m: _eager_module(run.program("reference_fp32", m), device) for m in methods}
                 if low_precision else {})
        rows: List[Row] = []
        seen = set()
        calls = [(seed, sizes) for seed in recipe.verify.seeds for sizes in cases]
        for seed, sizes in steps(calls, f"verify ({runtime})", label=lambda c: f"seed {c[0]} {_sizes_text(c[1])}",
                                 unit="case"):
            for m in methods:
                used = {d: sizes[d] for spec in specs[m] for d in spec.shape if isinstance(d, str)}
                if (seed, m, tuple(sorted(used.items()))) in seen:
                    continue
                seen.add((seed, m, tuple(sorted(used.items()))))
                inputs = [t.to(device) for t in draw_inputs(specs[m], used, seed, m)]
                with torch.no_grad(), full_fp32_precision():
                    want = _flat_tensors(eager[m](*inputs))
                    want32 = _flat_tensors(ref32[m](*[_to_fp32(t) for t in inputs])) if low_precision else None
                    got = call(m, inputs)
                for c, bound, facts in compare_outputs(output_names[m], got, want, recipe.verify.tolerance,
                                                       ref_fp32=want32):
                    rows.append(Row(runtime=runtime, method=m, seed=seed, sizes=used, output=c.name,
                                    shape=list(c.shape), dtype=c.dtype, max_abs=c.max_abs, rel_l2=c.rel_l2,
                                    cosine=c.cosine, tolerance=bound, ok=c.ok, why=c.why,
                                    reference=facts.get("reference", "eager"),
                                    eager_rel_l2=facts.get("eager_rel_l2"), vs_eager=facts.get("vs_eager")))
        return rows

    orders = {m: run.io_order(m) for m in methods}
    if not run.pte.exists():
        raise VerificationFailed(f"{run.pte} is missing", "lower the run first (`python -m zoo.lower RUN_DIR`)")
    with shipped_runners(run.pte, run.ptd, methods, factory, device) as runners:

        def call_so(m: str, inputs: List[torch.Tensor]) -> List[torch.Tensor]:
            return run_in_delegate_order(runners[m], orders[m], inputs)

        rows = run_all("aoti", call_so)
    status, et_call = executorch_runtime(run, device) if try_executorch else ("ExecuTorch runtime: not tried", None)
    if et_call is not None:
        rows += run_all("executorch", et_call)
    result = VerificationResult(rows=rows, device=device, gpu=_gpu_info(device), executorch_runtime=status,
                                rotary_pairs=recipe.rotary_pairs, unit_dtype=recipe.unit.dtype,
                                seconds=time.perf_counter() - start)
    if recipe.rotary_pairs == "float32":
        result.notes.append("rotary pairs are float32: the relative L2 above is the float32 pairs' error against "
                            "the source's own (complex128 where it uses it) eager rotary math")
    if raise_on_failure and not result.ok:
        exc = VerificationFailed(result.failure_message(),
                                 "the rows marked FAIL in the verification table show where; a wrong input order "
                                 "or a kernel the compile got wrong are the usual causes")
        exc.result = result  # type: ignore[attr-defined]
        raise exc
    return result


def run_in_delegate_order(runner: Any, order: Dict[str, Any], inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Run a method's .so: ``inputs`` in the method's signature order are handed over in the delegate's order
    (``so/<method>.io.json``), and its outputs come back in the method's order."""
    outs = runner.run([inputs[i] for i in order["input_order"]])
    return [outs[j] for j in order["output_order"]]


@contextlib.contextmanager
def shipped_runners(pte: Path, ptd: Path, methods: Sequence[str], factory: RunnerFactory,
                    device: str) -> Iterator[Dict[str, Any]]:
    """A runner per method over the bytes that ship: each method's .so and weights taken out of model.pte /
    aoti_cuda_blob.ptd as they are on disk now (not the copies lowering left in so/), so a swapped or edited
    file is what gets run. The extracted files live only while the runners are in use."""
    shipped_dir = Path(tempfile.mkdtemp(prefix=".verify.tmp-", dir=pte.parent))
    try:
        shipped = extract_method_files(pte, ptd if ptd.exists() else None, shipped_dir)
        runners = {}
        for m in methods:
            if m not in shipped:
                raise VerificationFailed(f"{pte} holds no compiled .so for method {m!r}",
                                         "lower the run again (`python -m zoo.lower RUN_DIR`)")
            try:
                runners[m] = factory(m, shipped[m]["so"], shipped[m]["weights"], device)
            except ZooError:
                raise
            except Exception as exc:  # a loader's own error: the .so is damaged or built for another machine
                raise VerificationFailed(f"the .so of method {m!r} in {pte} cannot be loaded: "
                                         f"{type(exc).__name__}: {first_line(exc)}",
                                         "the artifact is damaged, or was built for another GPU or torch: "
                                         "lower the run again (`python -m zoo.lower RUN_DIR`)") from exc
        yield runners
    finally:
        shutil.rmtree(shipped_dir, ignore_errors=True)


def executorch_runtime(run_dir: Union[RunFolder, Path], device: str) -> Tuple[str, Optional[Callable]]:
    """A caller running methods through ExecuTorch's own runtime, where a build with CudaBackend is importable."""
    try:
        from executorch.extension.pybindings import portable_lib
    except Exception as exc:  # the pybindings raise ImportError or OSError depending on the missing library
        return f"ExecuTorch runtime: not importable here ({type(exc).__name__}: {exc})", None
    backends = list(getattr(portable_lib, "_get_registered_backend_names", lambda: [])())
    if "CudaBackend" not in backends:
        return ("ExecuTorch runtime: not importable here (the installed executorch has no CudaBackend, only "
                f"{', '.join(backends) or 'no backends'}; CUDA builds are published from 1.5.0)"), None
    run = RunFolder(run_dir)
    module = portable_lib._load_for_executorch(str(run.pte), data_path=str(run.ptd) if run.ptd.exists() else None)

    def call(method: str, inputs: List[torch.Tensor]) -> List[torch.Tensor]:
        outs = module.run_method(method, [t.cpu() for t in inputs])
        return [o.to(device) for o in outs]

    return "ExecuTorch runtime: CudaBackend", call
