"""Kernel preflight: the ATen fallback kernels a program will need once compiled for the ExecuTorch CUDA
runtime, checked against that runtime before the slow compile.

ExecuTorch's own check runs only after AOTInductor has compiled and autotuned the whole method (a missing
``split_copy`` was reported after 6 minutes), and it does not see the fallbacks AOTInductor writes directly
(scatter, index_put): an int64 ``scatter_add_`` becomes ``aoti_torch_cuda_scatter_reduce_two_out``, which no
ExecuTorch CUDA runtime has, and the artifact dies on the robot with an undefined symbol.

The preflight replays on the CPU what happens to each node on its way to a kernel:
  1. ExecuTorch's own to_edge step (run for real, on copies) turns view ops into ``*_copy`` variants,
     decomposes composite ops and makes in-place ops functional;
  2. the AOTI backend turns some copies back into views (``ReplaceViewCopyWithViewPass``, read from the
     installed executorch), and with ``triton_kernel_mode=ON`` swaps SDPA for its bf16-only Triton kernel;
  3. Inductor decomposes the op with its own table (traced here with ``make_fx`` on meta tensors);
  4. each resulting op is either lowered to Triton, lowered with a dtype-dependent direct fallback (scatter,
     index_put: mirrored from torch 2.11's ``use_scatter_fallback`` / ``index_put_impl_``), compiled as a GEMM
     template (which exists only for fp16/bf16/fp32: anything else has no choice under ExecuTorch's
     Triton-only GEMM setting), or becomes a fallback kernel: a C shim ``aoti_torch_cuda_<op>`` or, without
     one, the proxy executor, which ExecuTorch does not have.
A kernel is refused when ExecuTorch's compile-time allow-list (the installed ``CudaBackend``) rejects it or
the target runtime release (``zoo/data/runtimes.json``) does not export its symbol. The symbol audit of the
compiled ``.so`` (zoo.export.audit) remains the final word; this check only has to be right about what it names.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch.export import ExportedProgram
from torch.utils import _pytree as pytree

from zoo.core.errors import KernelPreflightRefused, LoweringError, first_line
from zoo.core.report import format_table
from zoo.rewrites.graph import schema_get
from zoo.rewrites.result import source_line
from zoo.rewrites.triton_unsafe_sdpa import NAME as TRITON_SDPA_REWRITE, triton_sdpa_faults
from zoo.contract.releases import compile_specs, load_runtimes, supported_fallback_kernels

log = logging.getLogger("zoo.export.lower.preflight")

aten = torch.ops.aten

GEMM_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
            aten.convolution.default}
GEMM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # torch._inductor.utils.use_triton_template
SCATTER_OPS = {aten.scatter.src, aten.scatter.value, aten.scatter.reduce, aten.scatter.value_reduce,
               aten.scatter_.src, aten.scatter_.value, aten.scatter_.reduce, aten.scatter_.value_reduce,
               aten.scatter_add.default, aten.scatter_add_.default,
               aten.scatter_reduce.two, aten.scatter_reduce_.two}
INDEX_PUT_OPS = {aten.index_put.default, aten.index_put_.default, aten._unsafe_index_put.default}
SDPA = aten.scaled_dot_product_attention.default


@dataclass
class KernelNeed:
    """One kernel the compiled method would need outside Inductor's generated Triton code."""

    method: str
    node: str
    source_op: str  # the op in the program as given
    op: str  # the op that reaches Inductor after ExecuTorch's mapping and Inductor's decomposition
    path: str  # "c_shim" | "proxy_executor" | "direct" | "no_gemm_template" | "triton_sdpa" | "complex"
    kernel: str  # the name ExecuTorch's compile-time check would report (or the direct call's symbol)
    symbol: Optional[str]  # the aoti_torch_* function the .so would import, when there is one
    refused: bool
    why: str
    where: str = ""


@dataclass
class PreflightResult:
    runtime: str
    needs: List[KernelNeed]
    nodes: int
    seconds: float
    notes: List[str] = field(default_factory=list)

    @property
    def refused(self) -> List[KernelNeed]:
        return [n for n in self.needs if n.refused]

    @property
    def ok(self) -> bool:
        return not self.refused

    def as_dict(self) -> Dict[str, Any]:
        return {"runtime": self.runtime, "ok": self.ok, "nodes": self.nodes, "seconds": round(self.seconds, 3),
                "needs": [asdict(n) for n in self.needs], "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "PreflightResult":
        return cls(runtime=data["runtime"], needs=[KernelNeed(**n) for n in data["needs"]], nodes=data["nodes"],
                   seconds=data["seconds"], notes=list(data.get("notes", [])))

    @classmethod
    def merged(cls, results: Sequence["PreflightResult"]) -> "PreflightResult":
        """One result from the per-method results of one runtime (methods preflighted apart, e.g. each in its
        own lowering worker)."""
        runtimes = {r.runtime for r in results}
        if len(runtimes) != 1:
            raise ValueError(f"preflight results of different runtimes {sorted(runtimes)} cannot be merged")
        return cls(runtime=runtimes.pop(), needs=[n for r in results for n in r.needs],
                   nodes=sum(r.nodes for r in results), seconds=sum(r.seconds for r in results),
                   notes=[n for r in results for n in r.notes])

    def table(self) -> str:
        if not self.needs:
            return f"kernel preflight ({self.runtime}): {self.nodes} nodes, no fallback kernel needed"
        rows = [["method", "node", "op", "kernel", "status"]]
        for n in self.needs:
            rows.append([n.method, n.node, n.op, n.kernel, ("REFUSED: " + n.why) if n.refused else "ok: " + n.why])
        return f"kernel preflight (runtime {self.runtime}): {self.nodes} nodes\n" + format_table(rows)


# --- what ExecuTorch does to a node before Inductor sees it -----------------------------------------------------


def _aten_op(target: Any) -> Optional[torch._ops.OpOverload]:
    """The ATen/custom OpOverload behind a node target (edge-dialect ops wrap one), or None for non-ops."""
    if isinstance(target, torch._ops.OpOverload):
        return target
    inner = getattr(target, "_op", None)  # executorch EdgeOpOverload
    return inner if isinstance(inner, torch._ops.OpOverload) else None


def edge_programs(programs: Dict[str, ExportedProgram], triton_kernel_mode: str = "ON") -> Dict[str, ExportedProgram]:
    """The edge-dialect programs ``to_edge_transform_and_lower`` hands its partitioners, made the same way
    (ExecuTorch's own step, on copies): view ops become ``*_copy`` ops, composite ops are decomposed, in-place
    ops made functional, and the ops the AOTI partitioner asks to keep are kept. CPU only."""
    from executorch.backends.cuda.cuda_partitioner import CudaPartitioner
    from executorch.exir import EdgeCompileConfig

    todo = {name: copy.deepcopy(ep) for name, ep in programs.items() if getattr(ep, "dialect", "ATEN") != "EDGE"}
    done = {name: ep for name, ep in programs.items() if name not in todo}
    if todo:
        config = EdgeCompileConfig(_check_ir_validity=False)
        partitioners = {name: [CudaPartitioner(compile_specs(name, triton_kernel_mode))] for name in todo}
        try:
            try:  # what to_edge_transform_and_lower does in executorch 1.2.0
                from executorch.exir.program._program import _gen_edge_manager_for_partitioners

                manager = _gen_edge_manager_for_partitioners(partitioners, todo, config, None)
            except ImportError:
                from executorch.exir import to_edge

                manager = to_edge(todo, compile_config=config)
        except Exception as exc:  # to_edge raises many kinds; lowering would fail the same way, only later
            raise LoweringError(f"kernel preflight: ExecuTorch's to_edge step fails on this program: "
                                f"{type(exc).__name__}: {first_line(exc)}",
                                "lowering would fail at the same step; complex values, for one, must be "
                                "rewritten to real pairs first (replace_complex_with_real)") from exc
        done.update({name: manager.exported_program(name) for name in todo})
    return {name: done[name] for name in programs}


def _aoti_view_restore() -> Dict[Any, Any]:
    """The copy->view map the installed executorch's AOTI backend applies before compiling."""
    from executorch.backends.aoti.passes.replace_view_copy_with_view import _VIEW_TARGETS

    return {k: v for k, v in _VIEW_TARGETS.items() if isinstance(k, torch._ops.OpOverload)}


# --- meta tensors standing in for a node's inputs ---------------------------------------------------------------


class _NoMeta(Exception):
    pass


def _concrete(size: Any) -> int:
    if isinstance(size, torch.SymInt):
        hint = getattr(size.node, "hint", None)
        return int(hint) if hint is not None else 2  # an unbacked size: any value > 1 keeps the op general
    return int(size)


def _meta_of(value: Any) -> Any:
    if isinstance(value, torch.fx.Node):
        val = value.meta.get("val")
        if isinstance(val, torch.Tensor):
            return torch.empty([_concrete(s) for s in val.shape], dtype=val.dtype, device="meta")
        if isinstance(val, (torch.SymInt, int)):
            return _concrete(val)
        if isinstance(val, (torch.SymFloat, float, torch.SymBool, bool)):
            return val if isinstance(val, (float, bool)) else (float(val.node.hint) if isinstance(val, torch.SymFloat)
                                                              else bool(val.node.hint))
        raise _NoMeta(f"node {value.name} has no tensor value")
    return value


def _val(value: Any) -> Any:
    return value.meta.get("val") if isinstance(value, torch.fx.Node) else value


# --- Inductor's routing of one ATen op on CUDA ------------------------------------------------------------------


def _atomic_add_fallback(dtype: torch.dtype, capability: Optional[Tuple[int, int]]) -> Optional[bool]:
    """torch._inductor.utils.needs_fallback_due_to_atomic_add_limitations for a CUDA target of ``capability``;
    None when it depends on a GPU that is not known here (bf16 atomics exist from sm_90)."""
    if dtype == torch.bfloat16:
        return None if capability is None else tuple(capability) < (9, 0)
    return dtype in (torch.int64, torch.bool)


def _scatter_route(op: torch._ops.OpOverload, node: torch.fx.Node,
                   capability: Optional[Tuple[int, int]]) -> Tuple[Optional[bool], str]:
    """(falls back?, fallback op) for a scatter-family node, mirroring torch 2.11's scatter lowerings."""
    args = list(node.args) + [None] * 5
    kwargs = node.kwargs
    self_val = _val(args[0])
    src = args[3] if len(node.args) > 3 else kwargs.get("src", kwargs.get("value"))
    src_val = _val(src)
    src_is_tensor = isinstance(src_val, torch.Tensor)
    packet = op.overloadpacket
    if packet in (aten.scatter, aten.scatter_):
        reduce = kwargs.get("reduce", args[4] if len(node.args) > 4 else None)
        if reduce is None:
            check_op, reduce_ty, reduction = getattr(aten.scatter_, op._overloadname), "add", None
        else:  # scatter with reduce= becomes scatter_reduce_.two with sum/prod
            check_op, reduce_ty, reduction = aten.scatter_reduce_.two, "sum", {"add": "sum", "multiply": "prod"}[reduce]
    elif packet in (aten.scatter_add, aten.scatter_add_):
        check_op, reduce_ty, reduction = aten.scatter_reduce_.two, "sum", "sum"
    else:
        check_op, reduce_ty = aten.scatter_reduce_.two, "sum"
        reduction = args[4] if len(node.args) > 4 else kwargs.get("reduce")
    if check_op.overloadpacket is aten.scatter_reduce_ and reduction is None:
        return False, str(check_op)
    atomic = _atomic_add_fallback(src_val.dtype, capability) if src_is_tensor else False
    falls = (reduction not in (None, reduce_ty)
             or (reduction == reduce_ty and self_val.dtype in (torch.bool, torch.int64))
             or torch.are_deterministic_algorithms_enabled())
    if falls:
        return True, str(check_op)
    return (None if atomic is None else bool(atomic)), str(check_op)


def _index_put_route(node: torch.fx.Node, capability: Optional[Tuple[int, int]]) -> Optional[bool]:
    """Does an index_put node fall back (torch 2.11 ``index_put_impl_``)?"""
    args = list(node.args) + [None] * 4
    self_val, indices, values = _val(args[0]), args[1], _val(args[2])
    accumulate = args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    index_vals = [_val(i) for i in (indices or [])]
    bool_index = [i for i in index_vals if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)]
    if isinstance(values, torch.Tensor) and values.numel() == 1 and len(index_vals) == 1 and bool_index:
        return False  # lowered as masked_fill
    if torch.are_deterministic_algorithms_enabled() or bool_index:
        return True
    if accumulate:
        return _atomic_add_fallback(self_val.dtype, capability)
    return False


def _has_complex(node: torch.fx.Node) -> bool:
    leaves = [_val(a) for a in pytree.tree_leaves((node.args, node.kwargs))] + pytree.tree_leaves(_val(node))
    return any(isinstance(v, torch.Tensor) and v.is_complex() for v in leaves)


def _route(op: torch._ops.OpOverload, node: torch.fx.Node,
           capability: Optional[Tuple[int, int]]) -> Optional[Dict[str, Any]]:
    """How Inductor compiles one (decomposed) op on CUDA; None when it becomes generated Triton code."""
    from torch._inductor.lowering import lowerings

    if op.namespace == "triton":  # executorch's own Triton kernels (triton_op): compiled in, no shim
        return None
    if _has_complex(node):
        return {"path": "complex", "kernel": f"at::_ops::{_opname(op)}::call", "symbol": f"aoti_torch_cuda_{_opname(op)}",
                "why": "complex values: Inductor has no complex codegen and the runtime no complex dtype; "
                       "rewrite to real pairs (replace_complex_with_real)"}
    if op in GEMM_OPS:
        out = _val(node)
        if isinstance(out, torch.Tensor) and out.dtype not in GEMM_DTYPES:
            return {"path": "no_gemm_template", "kernel": str(op), "symbol": None,
                    "why": f"a {str(out.dtype).replace('torch.', '')} GEMM: Inductor's Triton GEMM templates take "
                           "fp16/bf16/fp32 only and ExecuTorch allows no ATen GEMM, so the compile has no choice; "
                           "compute it in float32 (e.g. rotary_pairs=float32)"}
        return None
    if op in SCATTER_OPS:
        falls, check_op = _scatter_route(op, node, capability)
        symbol = _direct_symbol(check_op)
        if falls is None:
            return {"path": "direct", "kernel": symbol, "symbol": symbol, "conditional": True,
                    "why": "bf16 atomic add falls back below sm_90; the lowering GPU decides"}
        return {"path": "direct", "kernel": symbol, "symbol": symbol, "why": "written directly by AOTInductor"} \
            if falls else None
    if op in INDEX_PUT_OPS:
        falls = _index_put_route(node, capability)
        if falls is None:
            return {"path": "direct", "kernel": "aoti_torch_index_put_out", "symbol": "aoti_torch_index_put_out",
                    "conditional": True, "why": "bf16 atomic add falls back below sm_90; the lowering GPU decides"}
        return {"path": "direct", "kernel": "aoti_torch_index_put_out", "symbol": "aoti_torch_index_put_out",
                "why": "written directly by AOTInductor"} if falls else None
    lowering = lowerings.get(op)
    if lowering is not None and not getattr(lowering, "_is_fallback_handler", False):
        return None
    if op.namespace != "aten":
        return {"path": "proxy_executor", "kernel": op._schema.name, "symbol": None,
                "why": "a custom op without a C shim runs through the proxy executor"}
    from torchgen.aoti.fallback_ops import inductor_fallback_ops

    if str(op) in inductor_fallback_ops:
        return {"path": "c_shim", "kernel": f"at::_ops::{_opname(op)}::call",
                "symbol": f"aoti_torch_cuda_{_opname(op)}", "why": "an ATen fallback kernel"}
    return {"path": "proxy_executor", "kernel": op._name, "symbol": None,
            "why": "no C shim: AOTInductor would call it through the proxy executor, which ExecuTorch does not have"}


def _opname(op: torch._ops.OpOverload) -> str:
    """The name torch 2.11 gives a fallback in ``at::_ops::<name>::call`` and ``aoti_torch_cuda_<name>``."""
    return op.__name__.split(".")[0] if op._overloadname == "default" else op.__name__.replace(".", "_")


def _direct_symbol(op_name: str) -> str:
    """``aten.scatter_reduce_.two`` -> ``aoti_torch_cuda_scatter_reduce_two_out`` (cpp_wrapper_cpu's naming)."""
    name = op_name.split(".", 1)[1].replace(".", "_")
    return f"aoti_torch_cuda_{name}".replace("__", "_") + "_out"


# --- decomposition, memoised -------------------------------------------------------------------------------------


class _Decomposer:
    """Inductor's decomposition of single ops, traced on meta tensors and cached by op and input dtypes.

    Sizes are left out of the cache key: decompositions branch on dtypes and flags, rarely on sizes, and the
    set of ops they produce is what matters here."""

    def __init__(self) -> None:
        from torch._inductor.decomposition import select_decomp_table

        self.table = select_decomp_table()
        self.cache: Dict[Any, Optional[List[torch.fx.Node]]] = {}

    def __call__(self, op: torch._ops.OpOverload, node: torch.fx.Node) -> Optional[List[torch.fx.Node]]:
        """The op nodes Inductor would see for ``node`` run as ``op``; None when it cannot be traced.

        Every op is traced, not only those in the table: ops with a CompositeImplicitAutograd kernel (e.g.
        executorch's ``dim_order_ops._to_dim_order_copy``) decompose in Inductor's trace as well."""
        try:
            flat, spec = pytree.tree_flatten((node.args, node.kwargs))
            # The trace runs on meta tensors: a device argument (``_to_copy(device=cpu)``, which the backend
            # moves to cuda anyway) would ask for a copy out of meta memory, so it is traced as meta too.
            flat = [torch.device("meta") if isinstance(x, torch.device) else x for x in flat]
            metas = [_meta_of(x) for x in flat]
        except _NoMeta:
            return None
        key = (op, tuple((m.dtype, m.dim()) if isinstance(m, torch.Tensor) else (type(m).__name__,
                         m if isinstance(m, (str, bool, torch.dtype)) or m is None else None) for m in metas))
        if key not in self.cache:
            self.cache[key] = self._trace(op, metas, spec)
        return self.cache[key]

    def _trace(self, op, metas, spec) -> Optional[List[torch.fx.Node]]:
        from torch.fx.experimental.proxy_tensor import make_fx

        positions = [i for i, m in enumerate(metas) if isinstance(m, torch.Tensor)]

        def run(*tensors):
            leaves = list(metas)
            for i, t in zip(positions, tensors):
                leaves[i] = t
            args, kwargs = pytree.tree_unflatten(leaves, spec)
            return op(*args, **kwargs)

        try:
            gm = make_fx(run, decomposition_table=self.table, tracing_mode="real")(*[metas[i] for i in positions])
        except Exception as exc:  # ops without meta kernels or with data-dependent shapes: judge the op itself
            log.debug("preflight: cannot trace %s on meta tensors: %s", op, exc)
            return None
        return [n for n in gm.graph.nodes if n.op == "call_function"]


# --- the check ---------------------------------------------------------------------------------------------------


def _graph_nodes(program: ExportedProgram):
    for module in program.graph_module.modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                if node.op == "call_function":
                    yield node


def _where(node: torch.fx.Node) -> str:
    return source_line(node)


def _sdpa_problems(node: torch.fx.Node) -> Tuple[List[str], str]:
    """Why executorch 1.2.0's Triton SDPA (used for every SDPA when triton_kernel_mode=ON) rejects a node or would
    compute it wrong, and the fix to name."""

    def arg(name: str) -> Any:  # the edge op keeps the ATen schema: defaults filled in where the call left them out
        return schema_get(node.target, node.args, node.kwargs, name)

    q, k, v, mask = (_val(arg(name)) for name in ("query", "key", "value", "attn_mask"))
    dropout, causal, gqa = arg("dropout_p"), arg("is_causal"), arg("enable_gqa")
    problems = []
    dtypes = {str(t.dtype).replace("torch.", "") for t in (q, k, v) if isinstance(t, torch.Tensor)}
    if dtypes != {"bfloat16"}:
        problems.append(f"takes only bf16 inputs (got {', '.join(sorted(dtypes))})")
    if any(isinstance(t, torch.Tensor) and t.dim() != 4 for t in (q, k, v)):
        problems.append("takes only 4-D [B, H, L, D] inputs")
    if isinstance(mask, torch.Tensor) and mask.dtype != torch.bool:
        problems.append(f"takes only a bool mask (got {str(mask.dtype).replace('torch.', '')})")
    if dropout:
        problems.append("takes no dropout")
    if gqa:
        problems.append("takes no enable_gqa")
    if problems:
        return problems, "set lowering.triton_kernel_mode=OFF"
    if all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        faults = triton_sdpa_faults(q, k, v, mask if isinstance(mask, torch.Tensor) else None, bool(causal))
        if faults:
            return ([f"would compute it wrong, with no error: {fault}" for fault in faults],
                    f"add {TRITON_SDPA_REWRITE} to the recipe's rewrites (or set lowering.triton_kernel_mode=OFF)")
    return [], ""


def kernel_needs(program: ExportedProgram, method: str, *, triton_kernel_mode: str = "ON",
                 capability: Optional[Tuple[int, int]] = None,
                 decomposer: Optional[_Decomposer] = None) -> Tuple[List[Dict[str, Any]], int]:
    """Every kernel the edge-dialect ``program`` would need outside generated Triton code, before any
    allow-list is applied; also the number of op nodes looked at."""
    decomposer = decomposer or _Decomposer()
    restore = _aoti_view_restore()
    found: List[Dict[str, Any]] = []
    count = 0
    for node in _graph_nodes(program):
        source = _aten_op(node.target)
        if source is None:
            continue
        count += 1
        op = restore.get(source, source)
        if op is SDPA and triton_kernel_mode == "ON":
            problems, fix = _sdpa_problems(node)
            if problems:
                found.append({"node": node, "source_op": source, "op": "triton.sdpa", "path": "triton_sdpa",
                              "kernel": "triton::sdpa", "symbol": None,
                              "why": "executorch 1.2.0's Triton SDPA " + "; ".join(problems) + ": " + fix})
            continue
        decomposed = decomposer(op, node)
        parts = [(_aten_op(n.target), n) for n in decomposed] if decomposed is not None else [(op, node)]
        for part_op, part_node in parts:
            if part_op is None:
                continue
            route = _route(part_op, part_node, capability)
            if route is not None:
                found.append({"node": node, "source_op": source, "op": str(part_op), **route})
    return found, count


def check_kernels(programs: Dict[str, ExportedProgram], runtime: str = "1.2", *, triton_kernel_mode: str = "ON",
                  capability: Optional[Tuple[int, int]] = None) -> PreflightResult:
    """The fallback kernels every method needs, judged against ExecuTorch's allow-list and ``runtime``'s shims."""
    start = time.perf_counter()
    releases = load_runtimes()
    if runtime not in releases:
        raise LoweringError(f"unknown runtime release {runtime!r} for the kernel preflight",
                            f"set lowering.runtime to one of: {', '.join(releases)}")
    release = releases[runtime]
    if capability is None and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
    allowed = supported_fallback_kernels()
    decomposer = _Decomposer()
    programs = edge_programs(programs, triton_kernel_mode)
    needs: List[KernelNeed] = []
    notes: List[str] = []
    total = 0
    seen: Set[Tuple[str, str, str]] = set()
    for method, program in programs.items():
        found, count = kernel_needs(program, method, triton_kernel_mode=triton_kernel_mode, capability=capability,
                                    decomposer=decomposer)
        total += count
        for f in found:
            node = f["node"]
            key = (method, node.name, f["kernel"])
            if key in seen:
                continue
            seen.add(key)
            refused, why = _judge(f, release, allowed)
            if f.get("conditional"):
                refused = False
                notes.append(f"{method}/{node.name}: {f['kernel']} only if the lowering GPU is below sm_90 "
                             "(bf16 atomic add); the audit of the compiled .so settles it")
            needs.append(KernelNeed(method=method, node=node.name, source_op=str(f["source_op"]), op=f["op"],
                                    path=f["path"], kernel=f["kernel"], symbol=f["symbol"], refused=refused,
                                    why=why, where=_where(node)))
    return PreflightResult(runtime=runtime, needs=needs, nodes=total, seconds=time.perf_counter() - start,
                           notes=notes)


def _judge(found: Dict[str, Any], release, allowed: Set[str]) -> Tuple[bool, str]:
    path, kernel, symbol = found["path"], found["kernel"], found["symbol"]
    if path in ("complex", "no_gemm_template", "triton_sdpa"):
        return True, found["why"]
    reasons = []
    if path == "proxy_executor":
        reasons.append(found["why"])
    elif path == "c_shim" and kernel not in allowed:
        reasons.append(f"not on the installed executorch's fallback allow-list (the compile would fail with "
                       f"'missing fallback kernels: {kernel}')")
    if symbol and symbol not in release.symbols:
        reasons.append(f"runtime {release.name} does not export {symbol}")
    if reasons:
        return True, "; ".join(reasons)
    return False, f"{found['why']}; allowed and provided by runtime {release.name}"


def require_kernels(programs: Dict[str, ExportedProgram], runtime: str = "1.2", *, triton_kernel_mode: str = "ON",
                    capability: Optional[Tuple[int, int]] = None) -> PreflightResult:
    """``check_kernels``, raising ``LoweringError`` with the refused kernels listed when there are any."""
    result = check_kernels(programs, runtime, triton_kernel_mode=triton_kernel_mode, capability=capability)
    if not result.ok:
        lines = [f"  - {n.method}: {n.kernel} (from {n.source_op} at {n.where}): {n.why}" for n in result.refused]
        raise KernelPreflightRefused(
            f"kernel preflight: {len(result.refused)} kernel(s) the ExecuTorch CUDA runtime {runtime} cannot run; "
            "refusing before the compile:\n" + "\n".join(lines),
            "rewrite these ops (e.g. views instead of split/chunk copies, float32 instead of int64 scatter-add, "
            "real pairs instead of complex), or change the recipe's lowering settings as named above")
    return result

