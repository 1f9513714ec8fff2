"""Lowering: each method of the rewritten program through ExecuTorch's CudaPartitioner, each in its own worker
process and side by side, assembled into one ``model.pte`` plus ``aoti_cuda_blob.ptd``; each method's compiled
``.so`` and weights blob taken back out of those bytes.

How a lowering runs (``lower_to_pte``):
- the parent plans one constant table for every method (``zoo.export.lower.constant_plan``): each method's ``.so`` then
  carries the same constants in the same order, so methods without weights of their own get byte-identical
  weight blobs, which the assembled ``.ptd`` stores once;
- each method is lowered by ``lower_one_method`` (or an injected function of the same signature: the CPU
  tests use ExecuTorch's AOTI backend compiling for the CPU), in a worker process of its own
  (``zoo.export.lower.workers``), as many at once as ``lowering.workers`` / ``ZOO_LOWERING_WORKERS`` / the
  machine's cores and memory allow; with one worker the methods are lowered one after another in this
  process (debugging: breakpoints, one traceback);
- ``lower_one_method`` runs ExecuTorch's own ``to_edge_transform_and_lower`` steps with the kernel preflight
  between the edge step and the backend step, on the very edge program the backend gets (no second
  ``to_edge``), and refuses before the compile;
- the single-method programs are merged into one (``zoo.export.lower.assemble``), their files deleted (each holds a
  method's whole weights: ~10 GB at real size), and each method's ``.so`` and weights extracted to ``so/``
  (a weights blob several methods share, once).

What it takes (measured on an H200, see docs and notes):
- Inductor asks the driver for the GPU's properties, so lowering needs a CUDA device (``NoGpuError`` otherwise).
- ``to_edge_transform_and_lower`` changes the programs it is given: programs handed in are copied unless the
  caller hands them over (``consume``); a worker loads its own.
- fp32 attention needs ``triton_kernel_mode=OFF`` (the Triton SDPA of executorch 1.2.0 takes only bf16).
- Compile time is GEMM autotuning: the matmul search is capped (``max_mm_configs``), configs that cannot fit in
  shared memory are pruned, and Inductor's cache lives in a persistent folder reused across methods and runs.
- The compiled ``.so`` takes inputs and returns outputs in its own order (the partition's first-use order), not
  the method's: the order is read from the ``executorch_call_delegate`` node and saved in ``so/<method>.io.json``
  so verification from a saved run needs no re-lowering.

Graph inputs and outputs are left out of memory planning (``executorch_config``): a GPU pointer can then be
bound to any input (``Method::set_input`` memcpy's into a planned input, which for a GPU pointer crashes) and the
CUDA backend's outputs are used where it leaves them, so state one call hands to the next (a KV pool, the VAE
caches) stays on the GPU in zoo_runner. Every method is one delegate call from its inputs to its outputs
(``delegate_io_order`` refuses anything else), so no portable kernel reads or writes that unplanned memory. What
the written ``.pte`` ended up with, and the runtime release it needs, go to ``runtime.json``
(``zoo.contract.releases.RuntimeRequirement``).

Reading an artifact back (``read_pte``, ``extract_method_files``) is ``zoo.contract.artifact``'s; the compile specs and
the runtimes' allow-lists are ``zoo.contract.releases``'s.

``model.pte`` is the commit point: it is removed first, the ``.ptd`` and ``so/`` I/O orders are written next, and
the ``.pte`` is moved into place last (``zoo.export.lower.assemble``), so an interrupted run never leaves a ``model.pte``
beside foreign weights; ``so/`` is extracted after it, and readers reuse it only while its stamp matches
(``artifact.reusable_method_files``).
"""

from __future__ import annotations

import contextlib
import copy
import operator
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch.export import ExportedProgram

from zoo.contract.artifact import (
    PTD_NAME,
    PTE_NAME,
    SO_SUFFIX,
    WEIGHTS_SUFFIX,
    ensure_flatc,
    extract_method_files,
    io_memory_planning,
    weights_file_name,
)
from zoo.export.lower.assemble import assemble_program
from zoo.export.lower.constant_plan import (ConstantPlan, inductor_follows_plan, plan_constants, plan_values, read_constants,
                            sharing_groups)
from zoo.core.environ import environ_restored
from zoo.core.errors import LoweringError, NoGpuError, ZooError, first_line
from zoo.export.lower.workers import LoweredMethod, MethodJob, MethodPart, choose_workers, lower_in_process, lower_in_workers
from zoo.export.lower.preflight import PreflightResult, require_kernels
from zoo.core.progress import Progress
from zoo.core.progress import say as default_say
from zoo.core.report import format_table
from zoo.contract.run_folder import RunFolder, read_program
from zoo.contract.releases import RuntimeRequirement, compile_specs, lowering_requirement
from zoo.export.lower.target import NATIVE, check_lowered, local_device, plan_target, target_compile

DEFAULT_INDUCTOR_CACHE = Path.home() / ".cache" / "zoo" / "inductor"
LOWER_ONE_METHOD = "zoo.export.lower.lowering:lower_one_method"
# A worker holds its program, then Inductor's host copies of the weights blob and ExecuTorch's bytes of it:
# about three times the weights at its peak (read in codecache.py and aoti_backend.py, not measured), plus
# Inductor and Python themselves. Used only to bound the default number of workers by the available memory.
WORKER_MEMORY_FACTOR = 3
WORKER_MEMORY_BASE = 2 << 30
# The shared constant plan makes every method's blob hold every shared constant: on a runtime where each method
# loads its own blob (ExecuTorch 1.2) that costs the other methods' own weights. It is used when that costs at
# most this much more GPU memory than the methods' own tables (LingBot-VA: +1.4%); methods with mostly
# separate weights are lowered with their own tables.
PLAN_MAX_GPU_GROWTH = 0.05


@dataclass(frozen=True)
class MethodLowering:
    """How one method is lowered: the function each worker calls (``"package.module:function"``, see
    ``zoo.export.lower.workers``), whether it needs this machine's GPU, and where else a worker imports it from."""

    function: str = LOWER_ONE_METHOD
    needs_gpu: bool = True
    pythonpath: Tuple[str, ...] = ()


CUDA_LOWERING = MethodLowering()


@dataclass
class MethodArtifact:
    """One lowered method: where its .so and weights went, and how its delegate orders inputs and outputs.

    ``input_order[k]`` is the method input (signature position) the .so takes as its k-th input;
    ``output_order[j]`` is the .so output that is the method's j-th output.
    """

    name: str
    so: str  # relative to the output folder
    weights: str
    io: str
    so_bytes: int
    weights_bytes: int
    input_names: List[str]
    output_names: List[str]
    input_order: List[int]
    output_order: List[int]
    # Buffers the method mutates; they live inside its .so and are stored in the .ptd once per method.
    mutable_buffers: Dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0  # its worker's wall time (loading the program, lowering, writing its part)
    stage_seconds: Dict[str, float] = field(default_factory=dict)  # edge, preflight, backend, to_executorch
    constants: Dict[str, Any] = field(default_factory=dict)  # its .so's constant table against the shared plan
    shares_weights_with: Optional[str] = None  # the method whose weights segment (and so/ file) this one names

    def files(self, folder: Path) -> Tuple[Path, Optional[Path]]:
        """Its extracted .so and weights under the lowering's output ``folder`` (None: a method without weights)."""
        return folder / self.so, (folder / self.weights if self.weights else None)

    @property
    def delegate_order(self) -> Dict[str, List[int]]:
        """Its two orders as ``so/<method>.io.json`` holds them, for ``verify.run_in_delegate_order``."""
        return {"input_order": self.input_order, "output_order": self.output_order}


@dataclass
class LoweringResult:
    out_dir: str
    pte: str
    ptd: str
    pte_bytes: int
    ptd_bytes: int
    seconds: float  # wall time of the whole lowering
    compile_seconds: float  # wall time of the methods' lowering (the workers, side by side)
    methods: Dict[str, MethodArtifact]
    options: Dict[str, Any]
    gpu: Dict[str, Any]
    preflight: Optional[Dict[str, Any]] = None
    workers: Dict[str, Any] = field(default_factory=dict)  # how many lowered at once, why, in this process or not
    weights: Dict[str, Any] = field(default_factory=dict)  # the .ptd: which keys share a segment, against the plan
    stage_seconds: Dict[str, float] = field(default_factory=dict)  # plan, save programs, workers, assemble, ...
    runtime: Dict[str, Any] = field(default_factory=dict)  # runtime.json: the release it needs, its I/O planning

    def as_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["methods"] = {k: asdict(v) for k, v in self.methods.items()}
        return d

    def summary(self) -> Dict[str, Any]:
        """The run report's ``lowering`` section: sizes, times, GPU, per-method I/O order, and the table."""
        record = {**self.as_dict(), "table": self.table()}
        record.pop("out_dir")  # a staging folder's path would mislead once the run is moved into place
        return record

    def table(self) -> str:
        rows = [["method", "worker", ".so", "weights", "mutable buffers", "inputs (.so order)", "outputs (.so order)"]]
        for m in self.methods.values():
            rows.append([m.name, f"{m.seconds:.1f} s", _mib(m.so_bytes),
                         _mib(m.weights_bytes) + (f" (= {m.shares_weights_with})" if m.shares_weights_with else ""),
                         _mib(sum(m.mutable_buffers.values())) if m.mutable_buffers else "-",
                         m.input_order, m.output_order])
        workers = self.workers
        head = (f"{PTE_NAME} {_mib(self.pte_bytes)}, {PTD_NAME} {_mib(self.ptd_bytes)}, "
                f"lowering {self.seconds:.1f} s wall on {self.gpu.get('name')} (sm_{self.gpu.get('capability')}"
                + (f"; {self.gpu['target']['words']}" if self.gpu.get("target") else "") + "), "
                f"{workers.get('count', 1)} at once ({workers.get('why', '')}"
                f"{', in this process' if workers.get('in_process') else ''})")
        if self.weights.get("segments") is not None:
            head += "\n" + weights_line(self.weights)
        if self.runtime:
            head += "\nneeds " + RuntimeRequirement.from_dict(self.runtime).describe()
        return head + "\n" + format_table(rows)


def weights_line(weights: Mapping[str, Any]) -> str:
    """One line on what the .ptd holds: which methods' weights share a segment, its size against the plan."""
    shared = [keys for keys in weights["segments"] if len(keys) > 1]
    text = (f"{PTD_NAME}: " + ("; ".join(" = ".join(k[: -len(WEIGHTS_SUFFIX)] if k.endswith(WEIGHTS_SUFFIX) else k
                                                  for k in keys) + " (one segment)" for keys in shared)
                               if shared else "no entries share a segment"))
    if weights.get("plan_bytes"):
        text += (f"; {_mib(weights['file_bytes'])} for {_mib(weights['plan_bytes'])} of planned constants "
                 f"({weights['file_bytes'] / weights['plan_bytes']:.3f}x)")
    return text


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


# --- environment -------------------------------------------------------------------------------------------


def cuda_device_info() -> Dict[str, Any]:
    """Name and compute capability of the GPU lowering runs on; ``NoGpuError`` without one."""
    if not torch.cuda.is_available():
        raise NoGpuError(
            "lowering to an ExecuTorch CUDA .pte needs a CUDA device: Inductor compiles and autotunes its kernels "
            "on the GPU, and none is visible here",
            "run `python -m zoo lower RUN_DIR` on a machine with an NVIDIA GPU (the run folder holds everything it "
            "needs); export, rewrites and the CPU check already ran here",
        )
    major, minor = torch.cuda.get_device_capability()
    return {"name": torch.cuda.get_device_name(), "capability": f"{major}{minor}",
            "torch": torch.__version__, "cuda": torch.version.cuda}


def inductor_cache_dir() -> Path:
    return Path(os.environ.get("ZOO_INDUCTOR_CACHE") or DEFAULT_INDUCTOR_CACHE)


def lowering_ptxas() -> Optional[str]:
    """The ptxas the lowering gives Triton: the operator's ``TRITON_PTXAS_PATH``, else torch's own ``bin/ptxas``,
    the one Inductor's compile workers use (``inductor_settings`` says why); None where torch ships none."""
    if os.environ.get("TRITON_PTXAS_PATH"):
        return os.environ["TRITON_PTXAS_PATH"]
    path = Path(torch.__file__).resolve().parent / "bin" / "ptxas"
    return str(path) if path.is_file() and os.access(path, os.X_OK) else None


@contextlib.contextmanager
def inductor_settings(max_mm_configs: Optional[int]) -> Iterator[Dict[str, Any]]:
    """Inductor settings for the compile: persistent cache, shared-memory pruning, capped GEMM search, and the
    ptxas of Inductor's compile workers for this process too.

    Why the ptxas: Inductor's compile workers point ``TRITON_PTXAS_PATH`` at torch's ``bin/ptxas``
    (torch/_inductor/runtime/compile_tasks.py ``_set_triton_ptxas_path``); the lowering process, whose compiles
    go to that pool, never does, so it runs Triton's own ptxas. Triton's cache key holds the ptxas version, so
    when the GEMM autotuning benchmarks a choice the pool has compiled, this process misses the cache and
    compiles it again, in its own thread, one choice after another: 85 s of LingBot-VA's 567 s ``video_step``
    lowering on the H200. Measured on a small two-GEMM graph on the H200: template autotuning 47.0 s -> 1.1 s,
    41 of 43 compiles found in the cache. Set before the process's first Triton compile (Triton caches the
    version); an operator's own ``TRITON_PTXAS_PATH`` is kept.

    Environment variables are restored afterwards; the shared-memory option is read into Inductor's config at
    import, so it is patched there too.
    """
    import torch._inductor.config as inductor_config

    env = {
        "TORCHINDUCTOR_MAX_AUTOTUNE_PRUNE_CHOICES_BASED_ON_SHARED_MEM": "1",
        "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(inductor_cache_dir()),
    }
    ptxas = lowering_ptxas()
    if ptxas:
        env["TRITON_PTXAS_PATH"] = ptxas
    Path(env["TORCHINDUCTOR_CACHE_DIR"]).mkdir(parents=True, exist_ok=True)
    patch = {"max_autotune_prune_choices_based_on_shared_mem": True,
             "test_configs.max_mm_configs": max_mm_configs}
    with environ_restored(env), inductor_config.patch(patch):
        os.environ.update(env)
        yield {"inductor_cache_dir": env["TORCHINDUCTOR_CACHE_DIR"], "max_mm_configs": max_mm_configs,
               "prune_choices_based_on_shared_mem": True, "triton_ptxas": ptxas}


# --- delegate I/O order ------------------------------------------------------------------------------------


def delegate_io_order(program: ExportedProgram, method: str = "forward") -> Dict[str, Any]:
    """How the method's single CUDA delegate orders its inputs and outputs, read from the lowered program.

    The delegate node's arguments are placeholders of the method; their positions among the user inputs give
    ``input_order``. The method's outputs are ``getitem(delegate, i)`` nodes; their indices give ``output_order``.
    """
    graph = program.graph
    delegates = [n for n in graph.nodes
                 if n.op == "call_function" and n.target is torch.ops.higher_order.executorch_call_delegate]
    if len(delegates) != 1:
        raise LoweringError(f"method {method!r}: expected one CUDA delegate call, found {len(delegates)}",
                            "the AOTI partitioner puts every op into one partition; a program it splits cannot "
                            "be verified through one .so")
    call = delegates[0]
    user_inputs = list(program.graph_signature.user_inputs)
    input_order: List[int] = []
    for arg in call.args[1:]:
        if not (hasattr(arg, "op") and arg.op == "placeholder" and arg.name in user_inputs):
            raise LoweringError(f"method {method!r}: delegate input {arg} is not a method input",
                                "a value computed or stored outside the delegate cannot be fed to the .so; "
                                "report the op that stayed outside the partition")
        input_order.append(user_inputs.index(arg.name))
    output_node = next(n for n in graph.nodes if n.op == "output")
    output_order: List[int] = []
    for out in output_node.args[0]:
        if not (hasattr(out, "op") and out.op == "call_function" and out.target is operator.getitem
                and out.args[0] is call):
            raise LoweringError(f"method {method!r}: output {out} does not come from the delegate",
                                "an output that is an input or a constant passed through is not produced by the "
                                ".so; return a computed tensor instead")
        output_order.append(int(out.args[1]))
    return {"input_names": user_inputs, "output_names": list(program.graph_signature.user_outputs),
            "input_order": input_order, "output_order": output_order}


def _delegate_mutable_buffers(program: ExportedProgram) -> Dict[str, int]:
    """Buffers the delegate mutates (e.g. a KV pool) and their bytes: each method stores its own copy."""
    sizes: Dict[str, int] = {}
    for module in program.graph_module.children():
        original = getattr(module, "original_module", None)
        if original is None:
            continue
        state = dict(original.state_dict)
        state.update(getattr(original, "constants", {}) or {})
        for name in original.graph_signature.buffers_to_mutate.values():
            tensor = state.get(name)
            sizes[name] = int(tensor.numel() * tensor.element_size()) if tensor is not None else 0
    return sizes


# --- one method -------------------------------------------------------------------------------------------


def executorch_config() -> Any:
    """How a lowered method is serialised: its graph inputs and outputs get no planned memory (see the module
    docstring); everything else is ExecuTorch's default."""
    from executorch.exir import ExecutorchBackendConfig
    from executorch.exir.passes import MemoryPlanningPass

    return ExecutorchBackendConfig(
        memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False, alloc_graph_output=False))


def lower_one_method(method: str, program: ExportedProgram, options: Dict[str, Any]) -> LoweredMethod:
    """One method through ExecuTorch's CudaPartitioner: the CUDA lowering ``lower_to_pte`` runs in each worker
    (``lower_with_partitioner``)."""
    from executorch.backends.cuda.cuda_partitioner import CudaPartitioner

    partitioner = CudaPartitioner(compile_specs(method, options.get("triton_kernel_mode", "ON")))
    return lower_with_partitioner(method, program, options, partitioner)


def lower_with_partitioner(method: str, program: ExportedProgram, options: Dict[str, Any],
                           partitioner: Any) -> LoweredMethod:
    """One method through ``partitioner``'s backend (``program`` is consumed: ExecuTorch's lowering changes it).

    ``options`` (JSON): ``triton_kernel_mode``, ``max_mm_configs``, ``runtime`` (the preflight's target),
    ``target`` (``lowering_target.TargetPlan.record()``: the compile settings for another GPU, or None),
    ``preflight`` (run the kernel preflight on the edge program, before compiling), ``constant_plan``
    (``ConstantPlan.as_dict()``: this method's ``.so`` carries exactly the plan's constants, in its order).
    The record: ``io`` (delegate I/O order, output names, mutable buffers), ``preflight``, ``seconds`` per
    step, ``constants`` (the ``.so``'s table against the plan, in numbers) and ``constant_tables`` (the tables)."""
    mode = options.get("triton_kernel_mode", "ON")
    output_names = list(program.graph_signature.user_outputs)  # the lowered program renames them
    plan = ConstantPlan.from_dict(options["constant_plan"]) if options.get("constant_plan") else None
    seconds: Dict[str, float] = {}

    def preflight(edge_program: ExportedProgram) -> Optional[PreflightResult]:
        if not options.get("preflight"):
            return None
        return require_kernels({method: edge_program}, options.get("runtime", "1.2"), triton_kernel_mode=mode)

    with inductor_settings(options.get("max_mm_configs")), target_compile(options.get("target")):
        follow = inductor_follows_plan(plan, plan_values(program, plan)) if plan else contextlib.nullcontext([])
        with follow as tables:
            try:
                edge, checked = edge_and_lower(method, program, partitioner, seconds, preflight=preflight)
                lowered = edge.exported_program(method)
                io = delegate_io_order(lowered, method)
                io["output_names"] = output_names
                io["mutable_buffers"] = _delegate_mutable_buffers(lowered)
                start = time.perf_counter()
                executorch_program = edge.to_executorch(executorch_config())
                seconds["to_executorch"] = round(time.perf_counter() - start, 3)
            except ZooError:
                raise
            except Exception as exc:  # ExecuTorch, export and Inductor raise many kinds; all mean "did not lower"
                raise _lowering_error(exc, mode) from exc
    record = {"io": io, "preflight": checked.as_dict() if checked is not None else None, "seconds": seconds,
              "constants": constants_summary(tables, plan), "constant_tables": tables}
    return LoweredMethod(program=executorch_program, record=record)


def edge_and_lower(method: str, program: ExportedProgram, partitioner: Any, seconds: Dict[str, float], *,
                   preflight: Callable[[ExportedProgram], Any] = lambda edge_program: None) -> Tuple[Any, Any]:
    """ExecuTorch 1.2's ``to_edge_transform_and_lower`` for one method and one partitioner, its steps run here
    (``exir/program/_program.py``, 1384-1435) so that ``preflight`` sees the very edge program the backend
    then gets: the edge step is made once per lowering. Returns the lowered EdgeProgramManager and what
    ``preflight`` returned."""
    from executorch.exir import EdgeCompileConfig
    from executorch.exir.program._program import (
        _can_skip_using_EDGE_DO_NOT_DECOMP,
        _gen_edge_manager_for_partitioners,
        _remove_invalid_ops_for_not_decompose,
        _sanity_check_graph_for_non_decomp_ops,
    )

    start = time.perf_counter()
    edge = _gen_edge_manager_for_partitioners({method: [partitioner]}, {method: program},
                                              EdgeCompileConfig(_check_ir_validity=False), None)
    seconds["edge"] = round(time.perf_counter() - start, 3)
    start = time.perf_counter()
    checked = preflight(edge.exported_program(method))
    seconds["preflight"] = round(time.perf_counter() - start, 3)
    start = time.perf_counter()
    edge = edge.to_backend({method: partitioner})
    # The closing check of to_edge_transform_and_lower: ops the partitioner kept from decomposition must have
    # been taken by it.
    lowered = edge.exported_program(method)
    ops, check_op_support = partitioner.ops_to_not_decompose(lowered)
    if not _can_skip_using_EDGE_DO_NOT_DECOMP(partitioner, lowered):
        ops = _remove_invalid_ops_for_not_decompose(ops)
    _sanity_check_graph_for_non_decomp_ops(method, lowered, set(ops), check_op_support,
                                           partitioner_name=type(partitioner).__name__, generate_error=True)
    seconds["backend"] = round(time.perf_counter() - start, 3)
    return edge, checked


def constants_summary(tables: Sequence[Sequence[Mapping[str, Any]]], plan: Optional[ConstantPlan]) -> Dict[str, Any]:
    """A method's compiled constant table(s) in numbers: how many, how many bytes, how many the plan added (the
    graph does not read them) or adopted (a lifted constant under a positional name), and whether the table
    is the plan in plan order."""
    rows = [row for table in tables for row in table]
    summary: Dict[str, Any] = {"compiles": len(tables), "constants": len(rows),
                               "bytes": sum(int(r["nbytes"]) for r in rows),
                               "added": sum(1 for r in rows if r.get("added")),
                               "adopted": sum(1 for r in rows if r.get("adopted"))}
    if plan is not None:
        summary["plan_order"] = all([r["fqn"] for r in table if r.get("planned")] == plan.fqns() for table in tables)
    return summary


# --- every method -----------------------------------------------------------------------------------------


def lower_to_pte(programs: Mapping[str, Union[ExportedProgram, Path]], run: Union[RunFolder, Path], recipe, *,
                 run_preflight: bool = True, workers: Optional[int] = None,
                 method_lowering: MethodLowering = CUDA_LOWERING, consume: bool = False,
                 say: Callable[[str], None] = default_say) -> LoweringResult:
    """Lower every method to one ``model.pte`` + ``aoti_cuda_blob.ptd`` in the run folder ``run`` (atomically),
    extract each method's .so and weights blob to its ``so/`` and record its delegate I/O order beside them.

    ``programs``: per method, the program or the ``.pt2`` file holding it (what workers load; a program given
    in memory is saved for them into the lowering's scratch folder and deleted after). ``workers``: how many
    methods lower at once (default: ``choose_workers``); 1 lowers them one after another in this process,
    where programs given in memory are copied first unless ``consume``. ``run_preflight``: the kernel preflight
    on each method's edge program, refusing before its compile (``KernelPreflightRefused``).
    ``method_lowering``: the function each method is lowered by (the CPU tests inject ExecuTorch's AOTI
    backend compiling for the CPU)."""
    gpu = cuda_device_info() if method_lowering.needs_gpu else {
        "name": f"no GPU ({method_lowering.function})", "capability": None}
    # A target GPU other than this one: refused here when this machine cannot lower for it (zoo.export.lower.target).
    target = recipe.lowering.target if method_lowering.needs_gpu else None
    plan = plan_target(target, local_device()) if target else None
    if plan is not None:
        gpu["target"] = {**plan.record(), "words": plan.words()}
    ensure_flatc()
    run = RunFolder(run)
    run.path.mkdir(parents=True, exist_ok=True)
    if not programs:
        raise LoweringError("no methods to lower", "the unit names its methods in unit.methods")
    lowering = recipe.lowering
    methods = list(programs)
    start = time.perf_counter()
    stage_seconds: Dict[str, float] = {}
    run.pte.unlink(missing_ok=True)  # a model.pte left from an earlier run must not pair with new weights
    run.runtime_file.unlink(missing_ok=True)  # nor its runtime requirement
    work = Path(tempfile.mkdtemp(prefix=".lowering.tmp-", dir=run.path))
    failed = True
    try:
        mark = time.perf_counter()
        in_memory = {m: p if isinstance(p, ExportedProgram) else read_program(Path(p))
                     for m, p in programs.items()}
        reads = {m: read_constants(p) for m, p in in_memory.items()}
        plans = [(group, plan_constants({m: in_memory[m] for m in group})) for group in sharing_groups(reads)]
        plan_record = plans_decision(plans)
        method_plan = {m: plan for (group, plan), record in zip(plans, plan_record["groups"]) if record["applied"]
                       for m in group}
        stage_seconds["plan"] = round(time.perf_counter() - mark, 3)
        # What each method's .so carries (its group's table, or its own reads), largest first: the workers start
        # in this order, so the longest lowerings never wait behind small ones, and the memory bound counts them.
        carried = {m: max(sum(reads[m].values()), method_plan[m].nbytes if m in method_plan else 0) for m in methods}
        start_order = sorted(methods, key=lambda m: -carried[m])
        count, why = choose_workers(len(methods), requested=workers, configured=lowering.workers,
                                    per_worker_bytes=[WORKER_MEMORY_FACTOR * carried[m] + WORKER_MEMORY_BASE
                                                      for m in start_order])
        options = {"triton_kernel_mode": lowering.triton_kernel_mode, "max_mm_configs": lowering.max_mm_configs,
                   "runtime": lowering.runtime, "preflight": run_preflight,
                   "target": plan.record() if plan is not None else None}
        method_options = {m: {**options, "constant_plan": method_plan[m].as_dict() if m in method_plan else None}
                          for m in methods}
        say(f"lowering {', '.join(methods)}: {count} at once ({why}); constant plan: {plan_record['why']}")
        mark = time.perf_counter()
        # Another GPU's compile settings go to worker processes only: a fresh process has no cache of this GPU's
        # properties that Inductor or Triton filled before (zoo.export.lower.target).
        in_process = count == 1 and (plan is None or plan.mode == NATIVE)
        if in_process:
            # In this process: programs read from files are ours to consume; the caller's are copied unless
            # handed over (to_edge_transform_and_lower changes the program it lowers).
            jobs = [MethodJob(m, in_memory[m] if consume or not isinstance(programs[m], ExportedProgram)
                              else copy.deepcopy(in_memory[m]), method_options[m]) for m in methods]
            del in_memory
            with Progress("lower", len(methods), unit="method") as bar:
                parts = lower_in_process(jobs, method_lowering.function, work / "methods",
                                         pythonpath=method_lowering.pythonpath, say=say, bar=bar)
            del jobs
        else:
            del in_memory  # the parent's copies go before the workers load theirs
            files, saved = _program_files(programs, work / "programs", stage_seconds)
            mark = time.perf_counter()  # "methods" is the workers' time alone: the save has its own stage
            jobs = [MethodJob(m, files[m], method_options[m]) for m in start_order]
            env = {"PYTHONPATH": os.pathsep.join(method_lowering.pythonpath)} if method_lowering.pythonpath else None
            with Progress("lower", len(methods), unit="method") as bar:
                started = lower_in_workers(jobs, method_lowering.function, work / "methods", max_workers=count,
                                           env=env, say=say, bar=bar)
            parts = {m: started[m] for m in methods}  # the .pte lists the methods in the unit's order
            for path in saved:  # disk: at real size each is ~10 GB, and the workers are done with them
                path.unlink()
        stage_seconds["methods"] = compile_seconds = round(time.perf_counter() - mark, 3)
        methods_record, ptd_summary = _assemble(parts, run, stage_seconds)
        # What was asked, read back from the binary: every kernel carries SASS for the target.
        check_lowered(plan, {m: run.path / a.so for m, a in methods_record.items()})
        preflights = [PreflightResult.from_dict(p.record["preflight"]) for p in parts.values()
                      if p.record.get("preflight")]
        failed = False
    finally:
        _clean_work_folder(work, keep_logs=failed)
    # Read back from the bytes written: what a runtime will find, whichever lowering function made them.
    requirement = lowering_requirement(_executorch_version(), io_memory_planning(run.pte))
    run.write_runtime_requirement(requirement.as_dict())
    options.update(inductor_cache_dir=os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(inductor_cache_dir()),
                   prune_choices_based_on_shared_mem=True, executorch=_executorch_version(),
                   triton_ptxas=lowering_ptxas(),
                   method_lowering=method_lowering.function)
    weights = {"plan": plan_record, "plan_bytes": plan_record["bytes"] if plan_record["applied"] else None,
               **(ptd_summary or {"segments": None})}
    if ptd_summary:
        # Each group that got a shared table holds its weights once: its methods' blobs name one segment.
        shared = [[m + WEIGHTS_SUFFIX for m in record["methods"]] for record in plan_record["groups"]
                  if record["applied"]]
        weights["stored_once"] = bool(shared) and all(
            any(set(keys) <= set(segment) for segment in ptd_summary["segments"]) for keys in shared)
    return LoweringResult(
        out_dir=str(run.path), pte=PTE_NAME, ptd=PTD_NAME, pte_bytes=run.pte.stat().st_size,
        ptd_bytes=run.ptd.stat().st_size if run.ptd.exists() else 0, seconds=round(time.perf_counter() - start, 3),
        compile_seconds=compile_seconds, methods=methods_record, options=options, gpu=gpu,
        preflight=PreflightResult.merged(preflights).as_dict() if preflights else None,
        workers={"count": count, "why": why, "in_process": in_process}, weights=weights,
        stage_seconds=stage_seconds, runtime=requirement.as_dict())


def plans_decision(plans: Sequence[Tuple[List[str], ConstantPlan]]) -> Dict[str, Any]:
    """``plan_decision`` for each group of methods (``constant_plan.sharing_groups``), and the whole: applied
    when some group's table is; ``bytes`` counts the constants the methods read, once per group."""
    groups = [{"methods": list(group), **plan_decision(plan, len(group))} for group, plan in plans]
    applied = [g for g in groups if g["applied"]]
    private: Dict[str, str] = {}
    for g in groups:  # once, for the whole
        private.update(g.pop("private"))
    if len(groups) == 1:
        why = groups[0]["why"]
    else:
        why = "; ".join(f"{' + '.join(g['methods'])}: {g['why']}" for g in groups)
    return {"applied": bool(applied), "groups": groups, "constants": sum(g["constants"] for g in applied),
            "bytes": sum(g["bytes"] for g in groups), "read_bytes": sum(g["read_bytes"] for g in groups),
            "private": private, "why": why}


def plan_decision(plan: ConstantPlan, methods: int) -> Dict[str, Any]:
    """Whether the methods get the shared constant table, and why (``PLAN_MAX_GPU_GROWTH``)."""
    growth = plan.gpu_growth(methods)
    record = {"applied": False, "constants": len(plan.constants), "bytes": plan.nbytes,
              "read_bytes": plan.read_nbytes, "gpu_growth": round(growth, 4), "private": dict(plan.private)}
    if methods < 2 or not plan.constants:
        record["why"] = "one method: nothing to share" if methods < 2 else "no constant is shared"
    elif growth > PLAN_MAX_GPU_GROWTH:
        record["why"] = (f"not applied: the methods read mostly different weights; one table for all would take "
                         f"{growth:.0%} more GPU memory on runtimes that load each method's blob (limit "
                         f"{PLAN_MAX_GPU_GROWTH:.0%})")
    else:
        record["applied"] = True
        record["why"] = (f"{len(plan.constants)} constants, {plan.nbytes / 2**20:.1f} MiB in every method's .so "
                         f"({growth:+.1%} GPU memory on runtimes that load each method's blob)")
    return record


def _program_files(programs: Mapping[str, Union[ExportedProgram, Path]], folder: Path,
                   stage_seconds: Dict[str, float]) -> Tuple[Dict[str, Path], List[Path]]:
    """Where each worker loads its program from: the file given, or the program saved into ``folder``."""
    files: Dict[str, Path] = {}
    saved: List[Path] = []
    mark = time.perf_counter()
    for method, program in programs.items():
        if isinstance(program, ExportedProgram):
            folder.mkdir(parents=True, exist_ok=True)
            files[method] = RunFolder(folder).program("rewritten", method)  # a scratch folder, run-folder names
            torch.export.save(program, str(files[method]))
            saved.append(files[method])
        else:
            files[method] = Path(program)
    if saved:
        stage_seconds["save_programs"] = round(time.perf_counter() - mark, 3)
    return files, saved


def _assemble(parts: Mapping[str, MethodPart], run: RunFolder, stage_seconds: Dict[str, float]
              ) -> Tuple[Dict[str, MethodArtifact], Optional[Dict[str, Any]]]:
    """The I/O orders into ``so/``, the parts merged into model.pte + .ptd (the .pte last), the parts' files
    deleted, each method's .so and weights extracted; returns the MethodArtifacts and what the .ptd holds."""
    for method, part in parts.items():
        if not part.record.get("io"):
            raise LoweringError(f"the lowering of method {method!r} recorded no delegate I/O order",
                                "a method lowering function records it as record['io'] (zoo.export.lower.lowering.delegate_io_order)")
        run.write_io_order(method, {"method": method, **part.record["io"]})
    mark = time.perf_counter()
    assembled = assemble_program([part.as_program_part() for part in parts.values()], run.path, pte_name=PTE_NAME)
    stage_seconds["assemble"] = round(time.perf_counter() - mark, 3)
    for part in parts.values():  # disk: each part's .ptd holds its method's whole weights
        for path in [part.pte, *part.data_files.values()]:
            path.unlink(missing_ok=True)
    mark = time.perf_counter()
    files = extract_method_files(run.pte, run.ptd if run.ptd.exists() else None, run.so_dir)
    stage_seconds["extract"] = round(time.perf_counter() - mark, 3)
    methods: Dict[str, MethodArtifact] = {}
    for name, part in parts.items():
        if name not in files:
            raise LoweringError(f"method {name!r} has no {name}{SO_SUFFIX} in the written .pte",
                                "the CUDA backend did not compile this method; see the lowering log")
        entry, order = files[name], part.record["io"]
        record = {"method": name, **order, "so_bytes": entry["so_bytes"], "weights_bytes": entry["weights_bytes"]}
        io_path = run.write_io_order(name, record)
        methods[name] = MethodArtifact(
            name=name, so=str(entry["so"].relative_to(run.path)),
            weights=str(entry["weights"].relative_to(run.path)) if entry["weights"] else "",
            io=str(io_path.relative_to(run.path)), so_bytes=entry["so_bytes"],
            weights_bytes=entry["weights_bytes"], input_names=order["input_names"],
            output_names=order["output_names"], input_order=order["input_order"],
            output_order=order["output_order"], mutable_buffers=order.get("mutable_buffers", {}),
            seconds=round(part.seconds, 3), stage_seconds=dict(part.record.get("seconds", {})),
            constants=dict(part.record.get("constants", {})),
            shares_weights_with=(entry["shares_weights_with"] or "").removesuffix(weights_file_name("")) or None)
    summary = assembled.data_files.get(PTD_NAME)
    return methods, summary.as_dict() if summary is not None else None


def _clean_work_folder(work: Path, keep_logs: bool) -> None:
    """Remove the lowering's scratch folder; after a failure keep the workers' logs and errors (the error
    names them), never the program and part files (GBs each at real size)."""
    if keep_logs and any(work.glob("methods/*/worker.log")):
        for path in sorted(work.rglob("*"), reverse=True):
            if path.is_file() and path.name not in ("worker.log", "error.json"):
                path.unlink()
        return
    shutil.rmtree(work, ignore_errors=True)


def _executorch_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("executorch")
    except PackageNotFoundError:
        return "unknown"


def _lowering_error(exc: Exception, triton_kernel_mode: str) -> LoweringError:
    text = str(exc)
    first = first_line(exc)
    if "missing fallback kernels" in text:
        return LoweringError(f"ExecuTorch refused the compiled program: {text.strip()}",
                             "rewrite the named ops into ones Inductor compiles to Triton (see the kernel "
                             "preflight), or target a runtime whose allow-list has them")
    if "Expected bfloat16 inputs" in text:
        return LoweringError(f"the Triton SDPA kernel takes only bf16 inputs: {first}",
                             "set lowering.triton_kernel_mode=OFF for float32 attention (the recipe has "
                             f"triton_kernel_mode={triton_kernel_mode})")
    return LoweringError(f"ExecuTorch CUDA lowering failed: {type(exc).__name__}: {first}",
                         "the full error is chained below this message in the log (run with -v)")
