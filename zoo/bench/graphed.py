"""The strongest PyTorch a user could write for a policy's steps, without an artifact: the chunk bench's ``pytorch``
candidate.

Each method is the whole step as one graph (the rewritten program: rotary math in real pairs, no complex
values, no host sync inside), compiled by ``torch.compile(fullgraph=True)`` with Inductor's defaults (cuBLAS
GEMMs, the flash/efficient SDPA kernels, Inductor's fused Triton elsewhere), then captured once per input
shape in a CUDA graph and replayed, the state in persistent buffers (``zoo.runner.graphs.GraphReplay``, the same
replay the artifact runner gets with ``cuda_graphs=True``).

The host loop around it is zoo.runner's (slot bookkeeping and schedules on the GPU, as LeRobot computes them):
the candidate times the steps, not another loop. docs/benchmarks.md, "The strong PyTorch baseline", says what was
measured and what each choice buys.
"""

from __future__ import annotations

from typing import Callable, Dict, List

import torch
from torch.utils import _pytree as pytree

from zoo.contract.run_folder import RunFolder
from zoo.runner.backends import EagerBackend
from zoo.runner.graphs import GraphReplay


class GraphedBackend(GraphReplay, EagerBackend):
    """The rewritten programs, compiled whole and replayed as CUDA graphs, the state in persistent buffers."""

    name = "pytorch"

    def __init__(self, run: RunFolder, device: str):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            # The programs' own device asserts then name the same device as the tensors Dynamo fakes ("cuda:0"):
            # moved to a bare "cuda", they fail its fake-tensor pass.
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(run, str(device))
        self._compiled: Dict[str, Callable] = {}
        self._init_graphs()
        # Every program loaded now: the buffers the methods share by name (a KV pool in the "buffer" layout) are
        # settled before any step is compiled and captured, whose graphs then write them where they live.
        for method in self.methods():
            self._module(method)

    def _step(self, method: str, args: List[torch.Tensor]) -> List[torch.Tensor]:
        if method not in self._compiled:
            self._compiled[method] = torch.compile(self._module(method), fullgraph=True, dynamic=False)
        out = self._compiled[method](*args)
        return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]

    def _inside_state(self, method: str) -> List[torch.Tensor]:
        return [self.shared.tensors[name] for name in sorted(self.shared.written)]

    def close(self) -> None:
        self._close_graphs()
        self._compiled.clear()
        self._modules.clear()
