"""What AOTInductor would be handed for a program under ExecuTorch's CUDA partitioner, without a GPU.

``ZooInductorProbe`` stands in for the CUDA backend (executorch finds a backend by its class name): its
preprocess runs the steps the real one runs before ``aot_compile`` (the view-copy pass and the backend's
decompositions) and records the result instead of compiling it.
"""

from __future__ import annotations

import copy

from executorch.backends.aoti.aoti_partitioner import AotiPartitioner
from executorch.backends.aoti.passes.replace_view_copy_with_view import ReplaceViewCopyWithViewPass
from executorch.backends.cuda.cuda_backend import CudaBackend
from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower
from executorch.exir.backend.backend_details import BackendDetails, PreprocessResult

_CAPTURED = []


class ZooInductorProbe(BackendDetails):
    @staticmethod
    def preprocess(edge_program, compile_specs):
        ep = copy.deepcopy(edge_program)
        ReplaceViewCopyWithViewPass()(ep.graph_module)
        _CAPTURED.append(ep.run_decompositions(CudaBackend.get_decomposition_table()))
        return PreprocessResult(processed_bytes=b"", debug_handle_map={})


def inductor_input(ep):
    """The program AOTInductor would compile for ``ep`` under the CUDA backend's partitioner."""
    _CAPTURED.clear()
    to_edge_transform_and_lower(copy.deepcopy(ep), partitioner=[AotiPartitioner("ZooInductorProbe", [])],
                                compile_config=EdgeCompileConfig(_check_ir_validity=False))
    (captured,) = _CAPTURED
    return captured


def fallback_ops(ep):
    """Ops Inductor can neither lower nor decompose: they would become ATen fallback kernels."""
    import torch
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.lowering import lowerings

    table = select_decomp_table()
    out = set()
    for node in ep.graph.nodes:
        target = node.target
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target not in lowerings \
                and target not in table \
                and not torch._C._dispatch_has_kernel_for_dispatch_key(target.name(), "CompositeImplicitAutograd"):
            out.add(str(target))
    return out
