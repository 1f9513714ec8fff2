"""One method's lowering, as each worker runs it: ExecuTorch's ``to_edge_transform_and_lower`` steps with the kernel
preflight between the edge step and the backend step (on the very edge program the backend gets), then the
delegate's I/O order read back and the method serialised. ``MethodLowering`` names the function a worker calls.
"""

from __future__ import annotations

import contextlib
import operator
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch.export import ExportedProgram

from zoo.contract.releases import compile_specs
from zoo.core.errors import LoweringError, ZooError, first_line
from zoo.export.lower.compile_settings import executorch_config, gemm_backends, inductor_settings
from zoo.export.lower.constant_plan import ConstantPlan, inductor_follows_plan, plan_values
from zoo.export.lower.preflight import PreflightResult, require_kernels
from zoo.export.lower.target import target_compile
from zoo.export.lower.workers import LoweredMethod

LOWER_ONE_METHOD = "zoo.export.lower.method_lowering:lower_one_method"


@dataclass(frozen=True)
class MethodLowering:
    """How one method is lowered: the function each worker calls (``"package.module:function"``, see
    ``zoo.export.lower.workers``), whether it needs this machine's GPU, and where else a worker imports it from."""

    function: str = LOWER_ONE_METHOD
    needs_gpu: bool = True
    pythonpath: Tuple[str, ...] = ()


CUDA_LOWERING = MethodLowering()


def lower_one_method(method: str, program: ExportedProgram, options: Dict[str, Any]) -> LoweredMethod:
    """One method through ExecuTorch's CudaPartitioner: the CUDA lowering ``lower_to_pte`` runs in each worker
    (``lower_with_partitioner``)."""
    from executorch.backends.cuda.cuda_partitioner import CudaPartitioner

    partitioner = CudaPartitioner(compile_specs(method, options.get("triton_kernel_mode", "ON")))
    return lower_with_partitioner(method, program, options, partitioner)


def lower_with_partitioner(method: str, program: ExportedProgram, options: Dict[str, Any],
                           partitioner: Any) -> LoweredMethod:
    """One method through ``partitioner``'s backend (``program`` is consumed: ExecuTorch's lowering changes it).

    ``options`` (JSON): ``triton_kernel_mode``, ``max_mm_configs``, ``gemm`` (who computes the GEMMs: the recipe's
    ``lowering.gemm``), ``runtime`` (the preflight's target),
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
        return require_kernels({method: edge_program}, options.get("runtime", "1.2"), triton_kernel_mode=mode,
                               gemm=options.get("gemm", "triton"))

    with inductor_settings(options.get("max_mm_configs")), target_compile(options.get("target")), \
            gemm_backends(options.get("gemm", "triton")):
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
