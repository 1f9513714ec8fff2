"""Kernel preflight: the ATen fallback kernels a program will need once compiled for the ExecuTorch CUDA
runtime, checked against that runtime before the slow compile (``require_kernels`` refuses). Each node's way to a
kernel is replayed on the CPU (``edge_programs`` here, ``kernel_routes`` for Inductor's part); why, and what is
replayed, is in docs/ARCHITECTURE.md ("The kernel preflight").
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch.export import ExportedProgram

from zoo.core.errors import KernelPreflightRefused, LoweringError, first_line
from zoo.core.report import format_table
from zoo.kernels import KERNEL_DTYPES, SPLIT_KV_ATTENTION, SPLIT_KV_ATTENTION_NAME, kernel_declines
from zoo.rewrites.graph import schema_get
from zoo.rewrites.result import source_line
from zoo.rewrites.triton_unsafe_sdpa import NAME as TRITON_SDPA_REWRITE, triton_sdpa_faults
from zoo.contract.releases import (compile_specs, gemm_features, load_runtimes, supported_fallback_kernels,
                                   with_features)
from zoo.export.lower.kernel_routes import Decomposer, kernel_route, node_value

aten = torch.ops.aten

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

    q, k, v, mask = (node_value(arg(name)) for name in ("query", "key", "value", "attn_mask"))
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


def runs_split_kv_kernel(node: torch.fx.Node) -> bool:
    """Whether a ``zoo::split_kv_attention`` node runs its own Triton kernels once compiled for CUDA (they are
    compiled into the .so, as executorch's ``triton::sdpa`` is: no fallback kernel, no shim). Otherwise the op
    computes torch's SDPA, which the CUDA backend decomposes as math (its ``sdpa_kernel([MATH])`` compile)."""
    q, k, v, mask = (node_value(schema_get(node.target, node.args, node.kwargs, name))
                     for name in ("query", "key", "value", "attn_mask"))
    return q.dtype in KERNEL_DTYPES and not kernel_declines(q, k, v, mask if isinstance(mask, torch.Tensor) else None)


def kernel_needs(program: ExportedProgram, method: str, *, triton_kernel_mode: str = "ON",
                 capability: Optional[Tuple[int, int]] = None, decomposer: Optional[Decomposer] = None,
                 gemm: str = "triton") -> Tuple[List[Dict[str, Any]], int]:
    """Every kernel the edge-dialect ``program`` would need outside generated Triton code, before any
    allow-list is applied; also the number of op nodes looked at."""
    decomposer = decomposer or Decomposer()
    restore = _aoti_view_restore()
    found: List[Dict[str, Any]] = []
    count = 0
    for node in _graph_nodes(program):
        source = _aten_op(node.target)
        if source is None:
            continue
        count += 1
        op = restore.get(source, source)
        if op is SPLIT_KV_ATTENTION:
            if runs_split_kv_kernel(node):
                continue
            op = SDPA  # its SDPA is inside the op, where executorch's Triton SDPA pass does not reach
        elif op is SDPA and triton_kernel_mode == "ON":
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
            route = kernel_route(part_op, part_node, capability, gemm)
            if route is not None:
                found.append({"node": node, "source_op": source, "op": str(part_op), **route})
    return found, count


def check_kernels(programs: Dict[str, ExportedProgram], runtime: str = "1.2", *, triton_kernel_mode: str = "ON",
                  capability: Optional[Tuple[int, int]] = None, gemm: str = "triton") -> PreflightResult:
    """The fallback kernels every method needs, judged against ExecuTorch's allow-list and ``runtime``'s shims
    (with ``gemm`` other than triton, zoo's build of the runtime: its cuBLAS shims are allowed and provided)."""
    start = time.perf_counter()
    releases = load_runtimes()
    if runtime not in releases:
        raise LoweringError(f"unknown runtime release {runtime!r} for the kernel preflight",
                            f"set lowering.runtime to one of: {', '.join(releases)}")
    release = releases[runtime]
    added = gemm_features(gemm)  # zoo's build of the release: more shims, more kernels
    if added:
        release = with_features(release, added)
    if capability is None and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
    allowed = supported_fallback_kernels().union(*(f.fallback_kernels for f in added))
    decomposer = Decomposer()
    programs = edge_programs(programs, triton_kernel_mode)
    needs: List[KernelNeed] = []
    notes: List[str] = []
    total = 0
    seen: Set[Tuple[str, str, str]] = set()
    for method, program in programs.items():
        found, count = kernel_needs(program, method, triton_kernel_mode=triton_kernel_mode, capability=capability,
                                    decomposer=decomposer, gemm=gemm)
        total += count
        compiled_in = sum(1 for node in _graph_nodes(program)
                          if _aten_op(node.target) is SPLIT_KV_ATTENTION and runs_split_kv_kernel(node))
        if compiled_in:
            notes.append(f"{method}: {compiled_in} {SPLIT_KV_ATTENTION_NAME} node(s) run zoo's split-KV Triton "
                         "kernels, compiled into the .so (no fallback kernel, no runtime shim)")
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
                    capability: Optional[Tuple[int, int]] = None, gemm: str = "triton") -> PreflightResult:
    """``check_kernels``, raising ``LoweringError`` with the refused kernels listed when there are any."""
    result = check_kernels(programs, runtime, triton_kernel_mode=triton_kernel_mode, capability=capability,
                           gemm=gemm)
    if not result.ok:
        lines = [f"  - {n.method}: {n.kernel} (from {n.source_op} at {n.where}): {n.why}" for n in result.refused]
        raise KernelPreflightRefused(
            f"kernel preflight: {len(result.refused)} kernel(s) the ExecuTorch CUDA runtime {runtime} cannot run; "
            "refusing before the compile:\n" + "\n".join(lines),
            "rewrite these ops (e.g. views instead of split/chunk copies, float32 instead of int64 scatter-add, "
            "real pairs instead of complex), or change the recipe's lowering settings as named above")
    return result

