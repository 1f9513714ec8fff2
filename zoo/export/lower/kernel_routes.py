"""How Inductor compiles one ATen op for CUDA, replayed on the CPU for the kernel preflight: the op decomposed with
Inductor's own table (traced on meta tensors), then each resulting op routed to generated Triton code, a GEMM
template, a fallback AOTInductor writes directly (scatter, index_put: mirrored from torch 2.11) or a fallback
kernel (a C shim or the proxy executor). ``zoo.export.lower.preflight`` judges the routes against a runtime.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.utils import _pytree as pytree

log = logging.getLogger("zoo.export.lower.preflight")  # the preflight's logger: these are its debug lines

aten = torch.ops.aten

GEMM_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
            aten.convolution.default}
GEMM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # torch._inductor.utils.use_triton_template
SHIM_GEMMS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}  # zoo's cublas_gemm.cu
SCATTER_OPS = {aten.scatter.src, aten.scatter.value, aten.scatter.reduce, aten.scatter.value_reduce,
               aten.scatter_.src, aten.scatter_.value, aten.scatter_.reduce, aten.scatter_.value_reduce,
               aten.scatter_add.default, aten.scatter_add_.default,
               aten.scatter_reduce.two, aten.scatter_reduce_.two}
INDEX_PUT_OPS = {aten.index_put.default, aten.index_put_.default, aten._unsafe_index_put.default}

# --- meta tensors standing in for a node's inputs ---------------------------------------------------------------


class NoMeta(Exception):
    pass


def _concrete(size: Any) -> int:
    if isinstance(size, torch.SymInt):
        hint = getattr(size.node, "hint", None)
        return int(hint) if hint is not None else 2  # an unbacked size: any value > 1 keeps the op general
    return int(size)


def meta_of(value: Any) -> Any:
    if isinstance(value, torch.fx.Node):
        val = value.meta.get("val")
        if isinstance(val, torch.Tensor):
            return torch.empty([_concrete(s) for s in val.shape], dtype=val.dtype, device="meta")
        if isinstance(val, (torch.SymInt, int)):
            return _concrete(val)
        if isinstance(val, (torch.SymFloat, float, torch.SymBool, bool)):
            return val if isinstance(val, (float, bool)) else (float(val.node.hint) if isinstance(val, torch.SymFloat)
                                                              else bool(val.node.hint))
        raise NoMeta(f"node {value.name} has no tensor value")
    return value


def node_value(value: Any) -> Any:
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
    self_val = node_value(args[0])
    src = args[3] if len(node.args) > 3 else kwargs.get("src", kwargs.get("value"))
    src_val = node_value(src)
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
    self_val, indices, values = node_value(args[0]), args[1], node_value(args[2])
    accumulate = args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    index_vals = [node_value(i) for i in (indices or [])]
    bool_index = [i for i in index_vals if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)]
    if isinstance(values, torch.Tensor) and values.numel() == 1 and len(index_vals) == 1 and bool_index:
        return False  # lowered as masked_fill
    if torch.are_deterministic_algorithms_enabled() or bool_index:
        return True
    if accumulate:
        return _atomic_add_fallback(self_val.dtype, capability)
    return False


def has_complex(node: torch.fx.Node) -> bool:
    leaves = [node_value(a) for a in pytree.tree_leaves((node.args, node.kwargs))] + pytree.tree_leaves(node_value(node))
    return any(isinstance(v, torch.Tensor) and v.is_complex() for v in leaves)


def kernel_route(op: torch._ops.OpOverload, node: torch.fx.Node,
           capability: Optional[Tuple[int, int]], gemm: str = "triton") -> Optional[Dict[str, Any]]:
    """How Inductor compiles one (decomposed) op on CUDA; None when it becomes generated Triton code. ``gemm``:
    the recipe's ``lowering.gemm`` (with cublas or autotune a GEMM may call zoo's cuBLAS shim)."""
    from torch._inductor.lowering import lowerings

    if op.namespace == "triton":  # executorch's own Triton kernels (triton_op): compiled in, no shim
        return None
    if has_complex(node):
        return {"path": "complex", "kernel": f"at::_ops::{_opname(op)}::call", "symbol": f"aoti_torch_cuda_{_opname(op)}",
                "why": "complex values: Inductor has no complex codegen and the runtime no complex dtype; "
                       "rewrite to real pairs (replace_complex_with_real)"}
    if op in GEMM_OPS:
        out = node_value(node)
        if isinstance(out, torch.Tensor) and out.dtype not in GEMM_DTYPES:
            return {"path": "no_gemm_template", "kernel": str(op), "symbol": None,
                    "why": f"a {str(out.dtype).replace('torch.', '')} GEMM: Inductor's Triton GEMM templates take "
                           "fp16/bf16/fp32 only and ExecuTorch allows no ATen GEMM, so the compile has no choice; "
                           "compute it in float32 (e.g. rotary_pairs=float32)"}
        if gemm != "triton" and op in SHIM_GEMMS and out.dtype in (torch.bfloat16, torch.float32):
            symbol = f"aoti_torch_cuda_{op._opname}_out"
            return {"path": "c_shim", "kernel": symbol, "symbol": symbol,
                    "why": "an ATen GEMM (lowering.gemm=" + gemm + (", if Inductor times it faster than the "
                           "templates" if gemm == "autotune" else "") + "): zoo's cuBLAS shim"}
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


class Decomposer:
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
            metas = [meta_of(x) for x in flat]
        except NoMeta:
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
