"""Lowering: each method of the rewritten program through ExecuTorch's CudaPartitioner to one ``model.pte``
plus ``aoti_cuda_blob.ptd``, and each method's compiled ``.so`` and weights blob taken back out of those bytes.

What it takes (measured on an H200, see docs and notes):
- Inductor asks the driver for the GPU's properties, so lowering needs a CUDA device (``NoGpuError`` otherwise).
- ``to_edge_transform_and_lower`` changes the programs it is given: it lowers deep copies.
- fp32 attention needs ``triton_kernel_mode=OFF`` (the Triton SDPA of executorch 1.2.0 takes only bf16).
- Compile time is GEMM autotuning: the matmul search is capped (``max_mm_configs``), configs that cannot fit in
  shared memory are pruned, and Inductor's cache lives in a persistent folder reused across methods and runs.
- The compiled ``.so`` takes inputs and returns outputs in its own order (the partition's first-use order), not
  the method's: the order is read from the ``executorch_call_delegate`` node and saved in ``so/<method>.io.json``
  so verification from a saved run needs no re-lowering.

Reading an artifact back (``read_pte``, ``extract_method_files``) is ``zoo.artifact``'s; the compile specs and
the runtimes' allow-lists are ``zoo.runtimes``'s.

``model.pte`` is the commit point: it is removed first, the ``.ptd`` and ``so/`` files are written next, and the
``.pte`` is moved into place last, so an interrupted run never leaves a ``model.pte`` beside foreign weights.
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
from typing import Any, Dict, Iterator, List, Optional, Union

import torch
from torch.export import ExportedProgram

from .artifact import PTD_NAME, PTE_NAME, SO_SUFFIX, ensure_flatc, extract_method_files
from .environ import environ_restored
from .errors import LoweringError, NoGpuError, first_line
from .preflight import require_kernels
from .progress import Progress
from .report import format_table
from .run_folder import RunFolder
from .runtimes import compile_specs

DEFAULT_INDUCTOR_CACHE = Path.home() / ".cache" / "zoo" / "inductor"


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


@dataclass
class LoweringResult:
    out_dir: str
    pte: str
    ptd: str
    pte_bytes: int
    ptd_bytes: int
    seconds: float
    compile_seconds: float
    methods: Dict[str, MethodArtifact]
    options: Dict[str, Any]
    gpu: Dict[str, Any]
    preflight: Optional[Dict[str, Any]] = None

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
        rows = [["method", ".so", "weights", "mutable buffers", "inputs (.so order)", "outputs (.so order)"]]
        for m in self.methods.values():
            rows.append([m.name, _mib(m.so_bytes), _mib(m.weights_bytes),
                         _mib(sum(m.mutable_buffers.values())) if m.mutable_buffers else "-",
                         m.input_order, m.output_order])
        head = (f"{PTE_NAME} {_mib(self.pte_bytes)}, {PTD_NAME} {_mib(self.ptd_bytes)}, "
                f"lowering {self.seconds:.1f} s on {self.gpu.get('name')} (sm_{self.gpu.get('capability')})")
        return head + "\n" + format_table(rows)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


# --- environment -------------------------------------------------------------------------------------------


def cuda_device_info() -> Dict[str, Any]:
    """Name and compute capability of the GPU lowering runs on; ``NoGpuError`` without one."""
    if not torch.cuda.is_available():
        raise NoGpuError(
            "lowering to an ExecuTorch CUDA .pte needs a CUDA device: Inductor compiles and autotunes its kernels "
            "on the GPU, and none is visible here",
            "run `python -m zoo.lower RUN_DIR` on a machine with an NVIDIA GPU (the run folder holds everything it "
            "needs); export, rewrites and the CPU check already ran here",
        )
    major, minor = torch.cuda.get_device_capability()
    return {"name": torch.cuda.get_device_name(), "capability": f"{major}{minor}",
            "torch": torch.__version__, "cuda": torch.version.cuda}


def inductor_cache_dir() -> Path:
    return Path(os.environ.get("ZOO_INDUCTOR_CACHE") or DEFAULT_INDUCTOR_CACHE)


@contextlib.contextmanager
def inductor_settings(max_mm_configs: Optional[int]) -> Iterator[Dict[str, Any]]:
    """Inductor settings for the compile: persistent cache, shared-memory pruning, capped GEMM search.

    Environment variables are restored afterwards; the shared-memory option is read into Inductor's config at
    import, so it is patched there too.
    """
    import torch._inductor.config as inductor_config

    env = {
        "TORCHINDUCTOR_MAX_AUTOTUNE_PRUNE_CHOICES_BASED_ON_SHARED_MEM": "1",
        "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(inductor_cache_dir()),
    }
    Path(env["TORCHINDUCTOR_CACHE_DIR"]).mkdir(parents=True, exist_ok=True)
    patch = {"max_autotune_prune_choices_based_on_shared_mem": True,
             "test_configs.max_mm_configs": max_mm_configs}
    with environ_restored(env), inductor_config.patch(patch):
        os.environ.update(env)
        yield {"inductor_cache_dir": env["TORCHINDUCTOR_CACHE_DIR"], "max_mm_configs": max_mm_configs,
               "prune_choices_based_on_shared_mem": True}


@contextlib.contextmanager
def progress_per_method(total: int) -> Iterator[None]:
    """A progress bar over the methods being compiled (shown past zoo.progress.BAR_DELAY, on a terminal).

    ExecuTorch compiles every method inside one ``to_edge_transform_and_lower`` call, one
    ``CudaBackend.preprocess`` per method: that classmethod is wrapped for the call (and put back after) to say
    which method is compiling.
    """
    from executorch.backends.cuda.cuda_backend import CudaBackend

    own = CudaBackend.__dict__.get("preprocess")  # None: inherited (AotiBackend's)
    compile_method = CudaBackend.preprocess
    bar = Progress("lower", total, unit="method")

    def preprocess(cls, edge_program, compile_specs):
        bar.begin(cls.method_name_from_compile_specs(compile_specs))
        try:
            return compile_method(edge_program, compile_specs)
        finally:
            bar.advance()

    CudaBackend.preprocess = classmethod(preprocess)
    try:
        yield
    finally:
        if own is None:
            del CudaBackend.preprocess
        else:
            CudaBackend.preprocess = own
        bar.close()


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


# --- lowering ----------------------------------------------------------------------------------------------


def lower_to_pte(programs: Dict[str, ExportedProgram], run: Union[RunFolder, Path], recipe, *,
                 run_preflight: bool = True) -> LoweringResult:
    """Lower every method to one ``model.pte`` + ``aoti_cuda_blob.ptd`` in the run folder ``run`` (atomically),
    extract each method's .so and weights blob to its ``so/`` and record its delegate I/O order beside them."""
    gpu = cuda_device_info()
    ensure_flatc()
    run = RunFolder(run)
    run.path.mkdir(parents=True, exist_ok=True)
    lowering = recipe.lowering
    start = time.perf_counter()

    preflight_summary = None
    if run_preflight:
        preflight_summary = require_kernels(programs, runtime=lowering.runtime,
                                            triton_kernel_mode=lowering.triton_kernel_mode).as_dict()

    from executorch.backends.cuda.cuda_partitioner import CudaPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    # Lowering mutates its input (a second lowering of the same program fails): work on copies.
    copies = {name: copy.deepcopy(ep) for name, ep in programs.items()}
    partitioners = {name: [CudaPartitioner(compile_specs(name, lowering.triton_kernel_mode))] for name in copies}
    with inductor_settings(lowering.max_mm_configs) as options, progress_per_method(len(copies)):
        compile_start = time.perf_counter()
        try:
            edge = to_edge_transform_and_lower(copies, partitioner=partitioners,
                                               compile_config=EdgeCompileConfig(_check_ir_validity=False))
        except Exception as exc:  # ExecuTorch, export and Inductor raise many kinds; all mean "did not lower"
            raise _lowering_error(exc, lowering) from exc
        compile_seconds = time.perf_counter() - compile_start
    options.update(triton_kernel_mode=lowering.triton_kernel_mode, runtime=lowering.runtime)

    io: Dict[str, Dict[str, Any]] = {}
    for name in copies:
        program = edge.exported_program(name)
        io[name] = delegate_io_order(program, name)
        # The lowered program renames its outputs after the delegate's getitems; keep the method's own names.
        io[name]["output_names"] = list(programs[name].graph_signature.user_outputs)
        io[name]["mutable_buffers"] = _delegate_mutable_buffers(program)
    executorch_program = edge.to_executorch()
    methods = write_artifacts(executorch_program, run, io)
    return LoweringResult(
        out_dir=str(run.path), pte=PTE_NAME, ptd=PTD_NAME, pte_bytes=run.pte.stat().st_size,
        ptd_bytes=run.ptd.stat().st_size if run.ptd.exists() else 0, seconds=round(time.perf_counter() - start, 3),
        compile_seconds=round(compile_seconds, 3), methods=methods, options=options, gpu=gpu,
        preflight=preflight_summary)


def write_artifacts(executorch_program, run: Union[RunFolder, Path],
                    io: Dict[str, Dict[str, Any]]) -> Dict[str, MethodArtifact]:
    """Write .ptd, so/ files and, last, model.pte. Any failure (or interruption) leaves no model.pte behind."""
    run = RunFolder(run)
    run.pte.unlink(missing_ok=True)  # a model.pte left from an earlier run must not pair with new weights
    staging = Path(tempfile.mkdtemp(prefix=".lowering.tmp-", dir=run.path))
    try:
        staged_pte = staging / PTE_NAME
        with open(staged_pte, "wb") as fh:
            executorch_program.write_to_file(fh)
            fh.flush()
            os.fsync(fh.fileno())
        executorch_program.write_tensor_data_to_file(str(staging))
        staged_ptd = staging / PTD_NAME
        files = extract_method_files(staged_pte, staged_ptd if staged_ptd.exists() else None, run.so_dir)
        methods: Dict[str, MethodArtifact] = {}
        for name, order in io.items():
            if name not in files:
                raise LoweringError(f"method {name!r} has no {name}{SO_SUFFIX} in the written .pte",
                                    "the CUDA backend did not compile this method; see the lowering log")
            entry = files[name]
            record = {"method": name, **order, "so_bytes": entry["so_bytes"], "weights_bytes": entry["weights_bytes"]}
            io_path = run.write_io_order(name, record)
            methods[name] = MethodArtifact(
                name=name, so=str(entry["so"].relative_to(run.path)),
                weights=str(entry["weights"].relative_to(run.path)) if entry["weights"] else "",
                io=str(io_path.relative_to(run.path)), so_bytes=entry["so_bytes"],
                weights_bytes=entry["weights_bytes"], input_names=order["input_names"],
                output_names=order["output_names"], input_order=order["input_order"],
                output_order=order["output_order"], mutable_buffers=order.get("mutable_buffers", {}))
        if staged_ptd.exists():
            os.replace(staged_ptd, run.ptd)
        os.replace(staged_pte, run.pte)  # the commit point
        return methods
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _lowering_error(exc: Exception, lowering) -> LoweringError:
    text = str(exc)
    first = first_line(exc)
    if "missing fallback kernels" in text:
        return LoweringError(f"ExecuTorch refused the compiled program: {text.strip()}",
                             "rewrite the named ops into ones Inductor compiles to Triton (see the kernel "
                             "preflight), or target a runtime whose allow-list has them")
    if "Expected bfloat16 inputs" in text:
        return LoweringError(f"the Triton SDPA kernel takes only bf16 inputs: {first}",
                             "set lowering.triton_kernel_mode=OFF for float32 attention (the recipe has "
                             f"triton_kernel_mode={lowering.triton_kernel_mode})")
    return LoweringError(f"ExecuTorch CUDA lowering failed: {type(exc).__name__}: {first}",
                         "the full error is chained below this message in the log (run with -v)")
