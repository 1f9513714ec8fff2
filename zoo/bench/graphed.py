"""The strongest PyTorch a user could write for a policy's steps, without an artifact: the chunk bench's ``pytorch``
candidate.

Each method is the whole step as one graph (the rewritten program: rotary math in real pairs, no complex
values, no host sync inside), compiled by ``torch.compile(fullgraph=True)`` with Inductor's defaults (cuBLAS
GEMMs, the flash/efficient SDPA kernels, Inductor's fused Triton elsewhere), then captured once per input
shape in a CUDA graph and replayed. The state a host loop hands from call to call (LingBot-VA's KV pool and VAE
caches, Fast-WAM's video K/V) lives in one persistent GPU buffer per name, which every graph that reads it reads
as it is and every graph that returns it writes into (one device copy, inside the CUDA graph), so no state
crosses to the host or is copied into a graph's inputs. Other inputs are copied into the graph's static inputs;
other outputs are cloned out of the graph's memory (a host loop may hold one across the next call of the
method). On a CPU there is no CUDA graph: the compiled steps run as they are, which checks this code.

The host loop around it is zoo.runner's (slot bookkeeping and schedules on the GPU, as LeRobot computes them):
the candidate times the steps, not another loop. docs/benchmarks.md, "The strong PyTorch baseline", says what was
measured and what each choice buys.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from zoo.bench.roofline import shape_key
from zoo.contract.run_folder import RunFolder
from zoo.runner.backends import EagerBackend


class _Graph:
    """One method at one set of input shapes: its CUDA graph, static inputs and outputs."""

    def __init__(self, graph: Optional[torch.cuda.CUDAGraph], inputs: List[torch.Tensor], outputs: List[torch.Tensor]):
        self.graph, self.inputs, self.outputs = graph, inputs, outputs


class GraphedBackend(EagerBackend):
    """The rewritten programs, compiled whole and replayed as CUDA graphs, the state in persistent buffers."""

    name = "pytorch"

    def __init__(self, run: RunFolder, device: str):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            # The programs' own device asserts then name the same device as the tensors Dynamo fakes ("cuda:0"):
            # moved to a bare "cuda", they fail its fake-tensor pass.
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(run, str(device))
        self.buffers: Dict[str, torch.Tensor] = {}
        self._compiled: Dict[str, Callable] = {}
        self._graphs: Dict[Tuple[str, Tuple], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        self.captures = 0

    def zeros(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        # Zeroed in place when it exists: every captured graph keeps reading this very buffer.
        buf = self.buffers.get(name)
        if buf is None or tuple(buf.shape) != tuple(shape) or buf.dtype != dtype:
            buf = self.buffers[name] = torch.zeros(list(shape), dtype=dtype, device=self.device)
        else:
            buf.zero_()
        return buf

    def _compiled_step(self, method: str) -> Callable:
        if method not in self._compiled:
            self._compiled[method] = torch.compile(self._module(method), fullgraph=True, dynamic=False)
        return self._compiled[method]

    def _step_into_buffers(self, method: str, static: List[torch.Tensor]) -> List[torch.Tensor]:
        """The compiled step on the static inputs, each state output copied into the buffer of its name.

        The copy is outside the compiled graph on purpose: written inside it (an input mutated in place),
        Inductor computed wrong VAE caches on the CPU, so the baseline pays one device copy per state per call
        instead (docs/benchmarks.md says what that costs)."""
        io = self.method_io(method)
        outputs = list(self._compiled_step(method)(*static))
        for out, name in self.state.get(method, {}).items():
            j = io.outputs.index(out)
            self.buffers[name].copy_(outputs[j])
            outputs[j] = self.buffers[name]
        return outputs

    def _capture(self, method: str, args: List[torch.Tensor]) -> _Graph:
        io = self.method_io(method)
        names = [spec.name for spec in io.inputs]
        held = {name for outs in self.state.values() for name in outs.values()}
        static = []
        for name, arg in zip(names, args):
            if name in held and name in self.buffers:
                static.append(self.buffers[name])
            else:  # a state seen first here becomes its buffer: later calls hand it back as it is
                static.append(arg.clone())
                if name in held:
                    self.buffers[name] = static[-1]
        step = self._compiled_step(method)
        cuda = self.device.type == "cuda"
        side = torch.cuda.Stream(self.device) if cuda else None
        if cuda:
            side.wait_stream(torch.cuda.current_stream(self.device))
        with (torch.cuda.stream(side) if cuda else contextlib.nullcontext()), torch.no_grad():
            for _ in range(2 if cuda else 1):  # compile and warm up on copies: the state buffers must not move yet
                outs = step(*[a.clone() for a in static])
        if cuda:
            torch.cuda.current_stream(self.device).wait_stream(side)
        for out, name in self.state.get(method, {}).items():  # a state this method returns: its buffer
            ref = outs[io.outputs.index(out)]
            buf = self.buffers.get(name)
            if buf is None or buf.shape != ref.shape or buf.dtype != ref.dtype:
                self.buffers[name] = torch.empty_like(ref)
        del outs
        if not cuda:  # no CUDA graph on a CPU (a check of this code): the compiled step runs at every call
            return _Graph(None, static, [])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool), torch.no_grad():
            outputs = self._step_into_buffers(method, static)
        self.captures += 1
        return _Graph(graph, static, outputs)

    def _run(self, method: str, args: List[torch.Tensor]) -> List[torch.Tensor]:
        key = (method, shape_key(args))
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture(method, args)
        for static, given in zip(graph.inputs, args):
            if static.data_ptr() != given.data_ptr():
                static.copy_(given)
        if graph.graph is None:
            with torch.no_grad():
                outputs = self._step_into_buffers(method, graph.inputs)
        else:
            graph.graph.replay()
            outputs = graph.outputs
        held = {id(b) for b in self.buffers.values()}
        return [out if id(out) in held else out.clone() for out in outputs]

    def close(self) -> None:
        self._graphs.clear()
        self._compiled.clear()
        self.buffers.clear()
        self._modules.clear()
