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

``model.pte`` is the commit point: it is removed first, the ``.ptd`` and ``so/`` files are written next, and the
``.pte`` is moved into place last, so an interrupted run never leaves a ``model.pte`` beside foreign weights.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import operator
import os
import shutil
import stat
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch.export import ExportedProgram

from . import atomic
from .environ import environ_restored
from .errors import LoweringError, NoGpuError

PTE_NAME = "model.pte"
PTD_NAME = "aoti_cuda_blob.ptd"
PTD_TAG = "aoti_cuda_blob"  # the external tag CudaBackend gives its weights; the .ptd is named after it
SO_DIR = "so"
SO_SUFFIX = "_so_blob"  # named data key of a method's .so inside the .pte (executorch 1.2.0)
WEIGHTS_SUFFIX = "_weights_blob"  # named data key of a method's weights inside the .ptd
CUDA_BACKEND_ID = "CudaBackend"
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
        from .report import format_table

        rows = [["method", ".so", "weights", "mutable buffers", "inputs (.so order)", "outputs (.so order)"]]
        for m in self.methods.values():
            rows.append([m.name, _mib(m.so_bytes), _mib(m.weights_bytes),
                         _mib(sum(m.mutable_buffers.values())) if m.mutable_buffers else "-",
                         m.input_order, m.output_order])
        head = (f"model.pte {_mib(self.pte_bytes)}, {PTD_NAME} {_mib(self.ptd_bytes)}, "
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


def ensure_flatc() -> str:
    """Point FLATC_EXECUTABLE at a flatc (writing or reading a .pte needs it) unless it is already set."""
    current = os.environ.get("FLATC_EXECUTABLE")
    if current and Path(current).is_file():
        return current
    candidates = [Path(sys.executable).parent / "flatc"]
    spec = importlib.util.find_spec("executorch")  # a namespace package: no __file__
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidates.append(Path(location) / "data" / "bin" / "flatc")
    on_path = shutil.which("flatc")
    if on_path:
        candidates.append(Path(on_path))
    for path in candidates:
        if path.is_file():
            if not os.access(path, os.X_OK):  # wheels unpacked with --target can lose the run bit
                with contextlib.suppress(OSError):
                    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
            if os.access(path, os.X_OK):
                os.environ["FLATC_EXECUTABLE"] = str(path)
                return str(path)
    raise LoweringError("no flatc executable found: writing and reading .pte files needs it",
                        "install executorch (it ships executorch/data/bin/flatc) or set FLATC_EXECUTABLE")


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


def compile_specs(method: str, triton_kernel_mode: str) -> list:
    from executorch.backends.cuda.cuda_backend import CudaBackend
    from executorch.exir.backend.compile_spec_schema import CompileSpec

    return [CudaBackend.generate_method_name_compile_spec(method),
            CompileSpec("triton_kernel_mode", triton_kernel_mode.encode("utf-8"))]


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


# --- reading artifacts ---------------------------------------------------------------------------------------


@dataclass
class PteMethod:
    name: str
    backend: str
    so_key: Optional[str]


def read_pte(pte_path: Path) -> Tuple[Dict[str, PteMethod], Dict[str, bytes]]:
    """Methods of an ExecuTorch .pte with their delegate backend, and the named data stored inside it."""
    ensure_flatc()
    from executorch.exir._serialize._program import deserialize_pte_binary

    data = Path(pte_path).read_bytes()
    try:
        pte = deserialize_pte_binary(data)
    except Exception as exc:  # the deserializer raises plain exceptions of several kinds on foreign bytes
        raise LoweringError(f"{pte_path} is not a readable ExecuTorch program: {type(exc).__name__}: {exc}",
                            "pass a model.pte written by ExecuTorch 1.2") from exc
    named: Dict[str, bytes] = {}
    if pte.named_data is not None:
        for key, entry in pte.named_data.pte_data.items():
            named[key] = bytes(pte.named_data.buffers[entry.buffer_index])
    methods: Dict[str, PteMethod] = {}
    for plan in pte.program.execution_plan:
        backend = ""
        so_key = None
        for delegate in plan.delegates:
            backend = delegate.id
            specs = {spec.key: bytes(spec.value) for spec in delegate.compile_specs}
            name = specs.get("method_name", plan.name.encode()).decode("utf-8", "replace")
            if name + SO_SUFFIX in named:
                so_key = name + SO_SUFFIX
        methods[plan.name] = PteMethod(plan.name, backend, so_key)
    return methods, named


def read_ptd_index(ptd_path: Path) -> Dict[str, Tuple[int, int]]:
    """Named entries of a .ptd as {key: (file offset, size)}, reading only the header and index."""
    ensure_flatc()
    from executorch.extension.flat_tensor.serialize.serialize import (
        FlatTensorHeader,
        _deserialize_to_flat_tensor,
    )

    with open(ptd_path, "rb") as fh:
        head = fh.read(8 + FlatTensorHeader.EXPECTED_LENGTH)
        header = FlatTensorHeader.from_bytes(head[8:]) if len(head) > 8 else None
        if header is None or not header.is_valid():
            raise LoweringError(f"{ptd_path} is not an ExecuTorch data file (.ptd)",
                                f"pass the {PTD_NAME} written beside the model.pte")
        fh.seek(0)
        flat = _deserialize_to_flat_tensor(fh.read(header.flatbuffer_offset + header.flatbuffer_size))
    return {entry.key: (header.segment_base_offset + flat.segments[entry.segment_index].offset,
                        flat.segments[entry.segment_index].size)
            for entry in flat.named_data}


def _copy_range(src: Path, offset: int, size: int, dest: Path) -> None:
    with atomic.atomic_path(dest) as tmp, open(src, "rb") as fin, open(tmp, "wb") as fout:
        fin.seek(offset)
        left = size
        while left:
            chunk = fin.read(min(left, 64 << 20))
            if not chunk:
                raise LoweringError(f"{src} ends before its entry at {offset}+{size}", "the file is truncated")
            fout.write(chunk)
            left -= len(chunk)


def extract_method_files(pte_path: Path, ptd_path: Optional[Path], so_dir: Path) -> Dict[str, Dict[str, Any]]:
    """Write each CUDA method's .so (from the .pte) and weights blob (from the .ptd) into ``so_dir``."""
    methods, named = read_pte(pte_path)
    index = read_ptd_index(ptd_path) if ptd_path is not None and Path(ptd_path).exists() else {}
    out: Dict[str, Dict[str, Any]] = {}
    for name, method in methods.items():
        if method.so_key is None:
            continue
        so_path = so_dir / f"{name}.so"
        atomic.write_bytes(so_path, named[method.so_key])
        entry: Dict[str, Any] = {"so": so_path, "so_bytes": len(named[method.so_key]), "weights": None,
                                 "weights_bytes": 0}
        key = name + WEIGHTS_SUFFIX
        if key in index:
            offset, size = index[key]
            blob = so_dir / f"{name}.weights.blob"
            _copy_range(Path(ptd_path), offset, size, blob)
            entry.update(weights=blob, weights_bytes=size)
        out[name] = entry
    return out


# --- lowering ----------------------------------------------------------------------------------------------


def lower_to_pte(programs: Dict[str, ExportedProgram], out_dir: Path, recipe, *,
                 run_preflight: bool = True) -> LoweringResult:
    """Lower every method to one ``model.pte`` + ``aoti_cuda_blob.ptd`` in ``out_dir`` (atomically), extract each
    method's .so and weights blob to ``out_dir/so/`` and record its delegate I/O order beside them."""
    gpu = cuda_device_info()
    ensure_flatc()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lowering = recipe.lowering
    start = time.perf_counter()

    preflight_summary = None
    if run_preflight:
        from .preflight import require_kernels

        preflight_summary = require_kernels(programs, runtime=lowering.runtime,
                                            triton_kernel_mode=lowering.triton_kernel_mode).as_dict()

    from executorch.backends.cuda.cuda_partitioner import CudaPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    # Lowering mutates its input (a second lowering of the same program fails): work on copies.
    copies = {name: copy.deepcopy(ep) for name, ep in programs.items()}
    partitioners = {name: [CudaPartitioner(compile_specs(name, lowering.triton_kernel_mode))] for name in copies}
    with inductor_settings(lowering.max_mm_configs) as options:
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
    methods = write_artifacts(executorch_program, out_dir, io)
    pte = out_dir / PTE_NAME
    ptd = out_dir / PTD_NAME
    return LoweringResult(
        out_dir=str(out_dir), pte=PTE_NAME, ptd=PTD_NAME, pte_bytes=pte.stat().st_size,
        ptd_bytes=ptd.stat().st_size if ptd.exists() else 0, seconds=round(time.perf_counter() - start, 3),
        compile_seconds=round(compile_seconds, 3), methods=methods, options=options, gpu=gpu,
        preflight=preflight_summary)


def write_artifacts(executorch_program, out_dir: Path, io: Dict[str, Dict[str, Any]]) -> Dict[str, MethodArtifact]:
    """Write .ptd, so/ files and, last, model.pte. Any failure (or interruption) leaves no model.pte behind."""
    out_dir = Path(out_dir)
    pte = out_dir / PTE_NAME
    pte.unlink(missing_ok=True)  # a model.pte left from an earlier run must not pair with new weights
    staging = Path(tempfile.mkdtemp(prefix=".lowering.tmp-", dir=out_dir))
    try:
        staged_pte = staging / PTE_NAME
        with open(staged_pte, "wb") as fh:
            executorch_program.write_to_file(fh)
            fh.flush()
            os.fsync(fh.fileno())
        executorch_program.write_tensor_data_to_file(str(staging))
        staged_ptd = staging / PTD_NAME
        files = extract_method_files(staged_pte, staged_ptd if staged_ptd.exists() else None, out_dir / SO_DIR)
        methods: Dict[str, MethodArtifact] = {}
        for name, order in io.items():
            if name not in files:
                raise LoweringError(f"method {name!r} has no {name}{SO_SUFFIX} in the written .pte",
                                    "the CUDA backend did not compile this method; see the lowering log")
            entry = files[name]
            io_path = out_dir / SO_DIR / f"{name}.io.json"
            record = {"method": name, **order, "so_bytes": entry["so_bytes"], "weights_bytes": entry["weights_bytes"]}
            atomic.write_json(io_path, record)
            methods[name] = MethodArtifact(
                name=name, so=str(entry["so"].relative_to(out_dir)),
                weights=str(entry["weights"].relative_to(out_dir)) if entry["weights"] else "",
                io=str(io_path.relative_to(out_dir)), so_bytes=entry["so_bytes"],
                weights_bytes=entry["weights_bytes"], input_names=order["input_names"],
                output_names=order["output_names"], input_order=order["input_order"],
                output_order=order["output_order"], mutable_buffers=order.get("mutable_buffers", {}))
        if staged_ptd.exists():
            os.replace(staged_ptd, out_dir / PTD_NAME)
        os.replace(staged_pte, pte)  # the commit point
        return methods
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def load_io_order(run_dir: Path, method: str) -> Dict[str, Any]:
    path = Path(run_dir) / SO_DIR / f"{method}.io.json"
    if not path.exists():
        raise LoweringError(f"{path} is missing: the delegate I/O order of method {method!r} is unknown",
                            "lower the run again (`python -m zoo.lower RUN_DIR`); it writes so/<method>.io.json")
    return json.loads(path.read_text())


def _lowering_error(exc: Exception, lowering) -> LoweringError:
    text = str(exc)
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
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
