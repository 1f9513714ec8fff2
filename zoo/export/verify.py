"""Verification of the shipped artifact: each method run as written in ``model.pte`` / ``aoti_cuda_blob.ptd`` on each
chosen runtime, on the GPU, against the exported program run eagerly, at every seed and size, under the recipe's
tolerances. The rules (float32/float64, integers, bf16 against a float32 copy) are in docs/ARCHITECTURE.md, "Audit
and verification".
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch.utils import _pytree as pytree

from zoo.export import audit
from zoo.core import numerics
from zoo.runtimes.aoti import RunnerFactory, run_in_delegate_order, sharing_runner_factory, shipped_runners
from zoo.runner.state import SharedBuffers
from zoo.contract.artifact import io_memory_planning
from zoo.core.errors import NoGpuError, RuntimeCallFailed, VerificationFailed, first_line
from zoo.contract.io_spec import InputSpec, IoSpec
from zoo.core.progress import say, steps
from zoo.core.report import format_table
from zoo.contract.run_folder import IO_SPEC_JSON, RunFolder, read_program
from zoo.contract.releases import requirement_for
from zoo.runtimes.executorch import describe
from zoo.export.verify_runtimes import LABELS, RuntimeChoice, choose_runtimes, executorch_caller

LOW_PRECISION = (torch.bfloat16, torch.float16)

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


# What happened to a runtime as a whole (``VerificationResult.runtimes[name]["status"]``).
RAN, FAILED, EXPECTED, NOT_RUN = "ran", "FAILED", "expected", "not run"


@dataclass
class VerificationResult:
    rows: List[Row]
    device: str
    gpu: Dict[str, Any]
    rotary_pairs: str
    unit_dtype: str
    seconds: float = 0.0
    notes: List[str] = field(default_factory=list)
    # runtime -> {"status": RAN|FAILED|EXPECTED|NOT_RUN, "describe": which build ran it, "why": a failure's first
    # line, and for the ExecuTorch runtime "load_ms", "gpu_loaded_mib", "release" and "audit" (the audit's
    # prediction for that release next to what happened: zoo.export.audit.audit_agreement)}
    runtimes: Dict[str, Dict[str, Any]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return (bool(self.rows) and all(r.ok for r in self.rows)
                and not any(o.get("status") == FAILED for o in self.runtimes.values()))

    def failures(self) -> List[Row]:
        return [r for r in self.rows if not r.ok]

    def failed_runtimes(self) -> Dict[str, Dict[str, Any]]:
        return {name: o for name, o in self.runtimes.items() if o.get("status") == FAILED}

    def as_dict(self) -> Dict[str, Any]:
        return {"passed": self.ok, "device": self.device, "gpu": self.gpu, "runtimes": self.runtimes,
                "summary": self.worst_text(), "rotary_pairs": self.rotary_pairs, "unit_dtype": self.unit_dtype,
                "seconds": round(self.seconds, 3), "rows": [asdict(r) for r in self.rows], "notes": list(self.notes)}

    def summary(self) -> Dict[str, Any]:
        return {**self.as_dict(), "table": self.table()}

    def worst(self) -> Dict[str, Dict[str, float]]:
        """Per runtime that produced rows: the worst relative L2 and cosine over every floating output."""
        out: Dict[str, Dict[str, float]] = {}
        for r in self.rows:
            if r.tolerance == 0.0 and r.ok:  # integer and bool outputs, matched exactly: no error to report
                continue
            w = out.setdefault(r.runtime, {"rel_l2": 0.0, "cosine": 1.0})
            w["rel_l2"] = r.rel_l2 if math.isnan(r.rel_l2) else max(w["rel_l2"], r.rel_l2)
            w["cosine"] = min(w["cosine"], r.cosine)
        return out

    def worst_text(self) -> str:
        """One line: per runtime, the worst relative L2 and cosine, or what happened to a runtime without rows."""
        worst = self.worst()
        parts = []
        for name in dict.fromkeys([r.runtime for r in self.rows] + list(self.runtimes)):
            outcome = self.runtimes.get(name, {})
            if name in worst and outcome.get("status", RAN) == RAN:
                parts.append(f"{name}: worst rel L2 {worst[name]['rel_l2']:.2e}, cosine {worst[name]['cosine']:.6f}")
            else:
                parts.append(f"{name}: {_status_text(outcome)}")
        return "; ".join(parts)

    def table(self) -> str:
        """The comparisons, both runtimes next to each other per method, seed, size and output."""
        rows = [["runtime", "method", "seed", "sizes", "output", "max|diff|", "rel L2", "cosine", "tol", "result"]]
        for r in _side_by_side(self.rows):
            extra = f" (eager {r.eager_rel_l2:.2e})" if r.eager_rel_l2 is not None else ""
            rows.append([r.runtime, r.method, r.seed, _sizes_text(r.sizes), r.output, f"{r.max_abs:.3e}",
                         f"{r.rel_l2:.3e}{extra}", f"{r.cosine:.6f}", f"{r.tolerance:.1e}",
                         "ok" if r.ok else "FAIL: " + r.why])
        head = [f"verification on {self.gpu.get('name', self.device)}: unit {self.unit_dtype}, rotary pairs "
                f"{self.rotary_pairs}"]
        for name, outcome in self.runtimes.items():
            head.append(f"  {name}: {outcome.get('describe', '')}" + _loaded_text(outcome)
                        + ("" if outcome.get("status", RAN) == RAN else f"; {_status_text(outcome)}"))
            if outcome.get("status", RAN) != RAN and outcome.get("why"):
                head.append(f"    {outcome['why']}")
        tail = [self.worst_text()] if self.rows else []
        return "\n".join(head + [format_table(rows)] + tail)

    def failure_message(self) -> str:
        lines = [f"  - {r.runtime} {r.method} seed={r.seed} sizes={_sizes_text(r.sizes)} output {r.output}: {r.why}"
                 for r in self.failures()]
        lines += [f"  - {name}: {outcome.get('why', '')}" for name, outcome in self.failed_runtimes().items()]
        if not self.rows:
            lines.append("  - nothing was compared")
        return "the artifact does not compute what eager PyTorch computes:\n" + "\n".join(lines)


def _status_text(outcome: Dict[str, Any]) -> str:
    """A runtime's status in a few words (the failure itself is in ``why``)."""
    status = outcome.get("status", RAN)
    if status == EXPECTED:
        return f"expected (audit: {outcome.get('audit', {}).get('reason', '?')})"
    if status == FAILED:
        return f"FAILED: {first_line(outcome.get('why', ''), limit=120)}"
    if status == NOT_RUN:
        return f"not run ({first_line(outcome.get('why', ''), limit=90).split(';')[0]})"
    return "ran"


def _loaded_text(outcome: Dict[str, Any]) -> str:
    facts = []
    if outcome.get("load_ms") is not None:
        facts.append(f"loaded in {outcome['load_ms']:.0f} ms")
    if outcome.get("gpu_loaded_mib") is not None:
        facts.append(f"{outcome['gpu_loaded_mib']:.0f} MiB of GPU memory after loading")
    return f" ({', '.join(facts)})" if facts else ""


def _side_by_side(rows: Sequence[Row]) -> List[Row]:
    """Rows ordered by (method, seed, sizes, output) as first seen, each runtime's row under the other's."""
    first: Dict[Tuple, int] = {}
    for r in rows:
        first.setdefault((r.method, r.seed, _sizes_text(r.sizes), r.output), len(first))
    return sorted(rows, key=lambda r: first[(r.method, r.seed, _sizes_text(r.sizes), r.output)])


def _sizes_text(sizes: Dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in sizes.items()) or "-"


# --- inputs and sizes --------------------------------------------------------------------------------------------


def size_cases(io_spec: IoSpec, recipe) -> List[Dict[str, int]]:
    """Every combination of the sizes to verify at: ``verify.sizes`` plus each dynamic dim's min and max (the
    ranges the artifact was lowered with, from io_spec.json)."""
    dynamic = io_spec.dynamic
    per_dim = {dim: sorted(set(list(recipe.verify.sizes.get(dim, [])) + [rng.min, rng.max]))
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
                         "run `python -m zoo lower RUN_DIR` on the machine with the GPU")
    return "cuda"


def _gpu_info(device: str) -> Dict[str, Any]:
    if device.startswith("cuda") and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        return {"name": torch.cuda.get_device_name(device), "capability": f"{major}{minor}"}
    return {"name": device}


def _eager_module(path: Path, device: str, shared: Optional[SharedBuffers] = None):
    """The saved program at ``path`` as a module on ``device``; with ``shared``, the buffers it writes are one
    tensor with those of the same name in the modules ``shared`` adopted before (as every runtime shares them)."""
    if not path.exists():
        raise VerificationFailed(f"{path} is missing: nothing to verify the artifact against",
                                 "the run folder must hold the programs the export step saved; export again")
    program = read_program(path)
    if device != "cpu":
        from torch.export.passes import move_to_device_pass

        program = move_to_device_pass(program, device)
    return shared.module_of(program) if shared is not None else program.module()


def eager_modules(run: RunFolder, kind: str, methods: Sequence[str], device: str) -> Dict[str, Any]:
    """The run's ``kind`` programs of ``methods`` as modules, the buffers they write shared by name across them:
    a stateful run's reference (LingBot-VA's KV pool in the "buffer" layout is one pool for both DiT methods)."""
    shared = SharedBuffers()
    return {m: _eager_module(run.program(kind, m), device, shared) for m in methods}


def _flat_tensors(value: Any) -> List[torch.Tensor]:
    return [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]


def _to_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in LOW_PRECISION else t


def verify_artifact(run_dir: Union[RunFolder, Path], recipe, *, device: Optional[str] = None,
                    runner_factory: Optional[RunnerFactory] = None, raise_on_failure: bool = True,
                    runtimes: Union[RuntimeChoice, Sequence[str], None] = None,
                    audited: Optional[audit.AuditResult] = None,
                    references: Optional[Mapping[str, Mapping[str, Callable[..., Any]]]] = None
                    ) -> VerificationResult:
    """Run the shipped artifact against eager at every seed and size on each chosen runtime; ``VerificationFailed``
    (carrying the result as ``.result``) when any output is out of tolerance or a runtime failed unexpectedly.

    ``runtimes``: a ``RuntimeChoice``, a ``verify.runtimes`` setting, or None for the recipe's own. ``audited``:
    the run's audit, which says whether a failure of the ExecuTorch runtime was predicted (audited here if None
    and needed).

    ``references``: the eager references already in memory on ``device``, ``{"exported": {method: callable},
    "reference_fp32": {method: callable}}`` (the unit's own modules and their float32 copy), instead of the
    programs saved in the run folder: at real size those are ~10 GB (bf16) and ~20 GB (float32) per method,
    more disk and load time than the run is worth. The same judgement applies either way."""
    start = time.perf_counter()
    choice = runtimes if isinstance(runtimes, RuntimeChoice) else choose_runtimes(
        recipe.verify.runtimes if runtimes is None else runtimes)
    plan = _plan(RunFolder(run_dir), recipe, device or _default_device(), references)
    rows: List[Row] = []
    outcomes: Dict[str, Dict[str, Any]] = {}
    counts = (f"{len(plan.methods)} method(s), {len(recipe.verify.seeds)} seed(s) x {len(plan.cases)} size(s)")
    if "aoti" in choice.runtimes:
        say(f"verify on {LABELS['aoti']}: {counts}")
        outcomes["aoti"] = _run_aoti(plan, runner_factory or aoti_runners(plan.state()), rows)
    if "executorch" in choice.runtimes:
        say(f"verify on {describe_runner(choice)}: {counts}")
        outcomes["executorch"] = _run_executorch(plan.run, plan.methods, plan.device, choice,
                                                 functools.partial(_compare_all, plan), rows, audited)
    for name, why in choice.left_out.items():  # a runtime the default choice left out
        outcomes[name] = {"status": NOT_RUN, "describe": LABELS[name], "why": why}
    result = VerificationResult(rows=rows, device=plan.device, gpu=_gpu_info(plan.device),
                                rotary_pairs=recipe.rotary_pairs, unit_dtype=recipe.unit.dtype,
                                seconds=time.perf_counter() - start, runtimes=outcomes, notes=choice.notes())
    if recipe.rotary_pairs == "float32":
        result.notes.append("rotary pairs are float32: the relative L2 above is the float32 pairs' error against "
                            "the source's own (complex128 where it uses it) eager rotary math")
    agreement = outcomes.get("executorch", {}).get("audit")
    if agreement and agreement.get("agrees") is False:
        result.notes.append("FINDING: " + agreement["verdict"])
    if raise_on_failure and not result.ok:
        raise VerificationFailed(result.failure_message(),
                                 "the rows marked FAIL in the verification table show where; a wrong input order "
                                 "or a kernel the compile got wrong are the usual causes; a runtime that failed "
                                 "to load or run names the reason (ExecuTorch's own log) above", result=result)
    return result


@dataclass
class _Plan:
    """What verification compares: the methods, their inputs and outputs, the size cases, and the references."""

    run: RunFolder
    recipe: Any
    device: str
    methods: List[str]
    specs: Dict[str, List[Any]]  # per method, its InputSpecs
    output_names: Dict[str, List[str]]
    cases: List[Dict[str, int]]
    references: Mapping[str, Mapping[str, Callable[..., Any]]]

    @property
    def low_precision(self) -> bool:
        return self.recipe.unit.dtype == "bfloat16"

    def state(self) -> Dict[str, List[str]]:
        """Per method, the buffers its compiled code writes in place, which the methods share by name."""
        return {m: self.run.mutable_buffers(m) for m in self.methods}

    def references_of(self, kind: str) -> Dict[str, Callable[..., Any]]:
        """Each method's eager reference: the unit's own module when given (the unit's modules share their
        buffers already), else the saved program, the buffers the programs write shared by name."""
        given = self.references.get(kind) or {}
        missing = [m for m in self.methods if m not in given]
        loaded = eager_modules(self.run, kind, missing, self.device) if missing else {}
        return {m: given[m] if m in given else loaded[m] for m in self.methods}


def _plan(run: RunFolder, recipe, device: str,
          references: Optional[Mapping[str, Mapping[str, Callable[..., Any]]]]) -> _Plan:
    """The run's io spec read against the recipe's methods; refused when the folder cannot be verified."""
    if not run.io_spec_file.exists():
        raise VerificationFailed(f"{run.io_spec_file} is missing: zoo cannot draw inputs for the methods",
                                 "the export step writes it; export the recipe again")
    io_spec = run.read_io_spec()
    methods = list(recipe.unit.methods)
    missing = [m for m in methods if m not in io_spec.methods]
    if missing:
        raise VerificationFailed(f"{IO_SPEC_JSON} has no entry for method(s) {', '.join(missing)}",
                                 "the run folder does not belong to this recipe; export again")
    if not run.pte.exists():
        raise VerificationFailed(f"{run.pte} is missing", "lower the run first (`python -m zoo lower RUN_DIR`)")
    return _Plan(run=run, recipe=recipe, device=device, methods=methods,
                 specs={m: list(io_spec.methods[m].inputs) for m in methods},
                 output_names={m: list(io_spec.methods[m].outputs) for m in methods},
                 cases=size_cases(io_spec, recipe), references=references or {})


def _compare_all(plan: _Plan, runtime: str, call: Callable[[str, List[torch.Tensor]], List[torch.Tensor]],
                 rows: List[Row]) -> None:
    """Every seed, size and method through ``call``, compared with eager; rows are appended as they come, so a
    runtime that fails half way keeps what it compared."""
    recipe, methods = plan.recipe, plan.methods
    eager = plan.references_of("exported")
    ref32 = plan.references_of("reference_fp32") if plan.low_precision else {}
    seen = set()
    calls = [(seed, sizes) for seed in recipe.verify.seeds for sizes in plan.cases]
    for seed, sizes in steps(calls, f"verify ({runtime})", label=lambda c: f"seed {c[0]} {_sizes_text(c[1])}",
                             unit="case"):
        for m in methods:
            used = {d: sizes[d] for spec in plan.specs[m] for d in spec.shape if isinstance(d, str)}
            if (seed, m, tuple(sorted(used.items()))) in seen:
                continue
            seen.add((seed, m, tuple(sorted(used.items()))))
            inputs = [t.to(plan.device) for t in draw_inputs(plan.specs[m], used, seed, m)]
            with torch.no_grad(), full_fp32_precision():
                want = _flat_tensors(eager[m](*inputs))
                want32 = _flat_tensors(ref32[m](*[_to_fp32(t) for t in inputs])) if plan.low_precision else None
                got = call(m, inputs)
            for c, bound, facts in compare_outputs(plan.output_names[m], got, want, recipe.verify.tolerance,
                                                   ref_fp32=want32):
                rows.append(Row(runtime=runtime, method=m, seed=seed, sizes=used, output=c.name,
                                shape=list(c.shape), dtype=c.dtype, max_abs=c.max_abs, rel_l2=c.rel_l2,
                                cosine=c.cosine, tolerance=bound, ok=c.ok, why=c.why,
                                reference=facts.get("reference", "eager"),
                                eager_rel_l2=facts.get("eager_rel_l2"), vs_eager=facts.get("vs_eager")))


def aoti_runners(state: Mapping[str, Sequence[str]]) -> RunnerFactory:
    """torch's AOTI runner over each method's shipped .so, the methods' constants shared by name as zoo.runner's
    artifact backend shares them (``state``: per method, the buffers it writes in place)."""
    return sharing_runner_factory(state)


def _run_aoti(plan: _Plan, factory: RunnerFactory, rows: List[Row]) -> Dict[str, Any]:
    """The artifact's .so files through torch's AOTI runner, each fed in its delegate's own input order."""
    run = plan.run
    orders = {m: run.io_order(m) for m in plan.methods}
    with shipped_runners(run.pte, run.ptd, plan.methods, factory, plan.device, so_dir=run.so_dir) as runners:

        def call_so(m: str, inputs: List[torch.Tensor]) -> List[torch.Tensor]:
            return run_in_delegate_order(runners[m], orders[m], inputs)

        _compare_all(plan, "aoti", call_so, rows)
    return {"status": RAN, "describe": f"torch's AOTI runner over each method's .so (libtorch's shims), "
                                       f"torch {torch.__version__}"}


def _run_executorch(run: RunFolder, methods: Sequence[str], device: str, choice: RuntimeChoice, run_all,
                    rows: List[Row], audited: Optional[audit.AuditResult]) -> Dict[str, Any]:
    """The artifact through ExecuTorch's C++ runtime, one zoo_runner process for every call; what happened, next
    to what the runtime audit predicted for the runner's release. A failure to load or run is FAILED, unless the
    audit said that release cannot load the artifact: then it is EXPECTED, with the audit's reason."""
    outcome: Dict[str, Any] = {"describe": describe_runner(choice),
                               "release": audit.release_of(str(choice.runner_info.get("executorch_version", "")))}
    requirement = requirement_for(run, io_memory_planning)
    try:
        with executorch_caller(run.pte, run.ptd, methods, device, executable=choice.runner,
                               requirement=requirement) as (loaded, call):
            outcome.update({k: loaded.get(k) for k in ("describe", "load_ms", "gpu_loaded_mib")})
            run_all("executorch", call, rows)
        ran, why = True, ""
    except RuntimeCallFailed as exc:
        # The run folder's place on this machine means nothing in a published report: paths are made relative.
        local = str(run.path.resolve()) + "/"
        ran, why = False, first_line(exc, limit=300).replace(local, "")
        outcome["log"] = exc.message.replace(local, "")  # ExecuTorch's own log lines, for report.json
    audited = audited if audited is not None else audit.audit_artifact(run.path)
    has = [f for f in requirement.features if f in (choice.runner_info.get("features") or [])]
    agreement = audit.audit_agreement(audited, str(choice.runner_info.get("executorch_version", "")), ran=ran,
                                      why=why, gpu=_gpu_info(device).get("name", device), features=has)
    outcome["audit"] = agreement
    if ran:
        outcome["status"] = RAN
    else:
        outcome["status"] = EXPECTED if agreement.get("predicted_loadable") is False else FAILED
        outcome["why"] = why
    return outcome


def describe_runner(choice: RuntimeChoice) -> str:
    return describe(choice.runner_info) if choice.runner_info else "ExecuTorch runtime"
