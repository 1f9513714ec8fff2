"""Each method replayed as a CUDA graph: what removes the host's kernel launches from a call.

A host loop calls a step hundreds of times a chunk with the same input shapes. Captured once per method and set of
input shapes, a step is then one ``cudaGraphLaunch`` instead of the thousand-odd launches of its kernels. The state
a host loop hands from call to call (a KV pool, the VAE caches, Fast-WAM's video K/V) lives in one persistent GPU
buffer per name: every graph that reads it reads that very buffer, and every graph that returns it copies its
output into it (one device copy inside the graph), so no state moves into a graph's static inputs. Other inputs are
copied into the graph's static inputs; other outputs are cloned out of the graph's memory, because a host loop may
hold one across the next call of the method.

State a method keeps inside (mutable buffers: LingBot-VA's KV pool in the "buffer" layout) needs none of that: the
graph writes it where it lives, the tensor every method shares by name (``zoo.runner.state``,
``zoo.runtimes.aoti.SharedConstants``), at a fixed address. Only the warm-up calls before a capture would change
it for real (a captured graph runs nothing until replayed), so it is saved before them and put back after.

``GraphReplay`` is a mixin over a backend's ``_step(method, args)``, the call it captures: the artifact's ``.so``
through torch's AOTI runner (``zoo.runner.load(..., cuda_graphs=True)``), or the chunk bench's compiled PyTorch
steps (``zoo.bench.graphed``). On a CPU there is no CUDA graph: the step runs at every call, which checks the
buffer logic.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from zoo.core.errors import VerificationFailed
from zoo.runner.backends import ArtifactBackend
from zoo.runtimes.aoti import AotiRunner


def shape_key(values: Sequence[Any]) -> Tuple:
    """What tells two calls of a method apart, for a captured graph and for the roofline's FLOP count: each input's
    shape and dtype (a tensor, or a runtime's handle of one)."""
    return tuple((tuple(int(d) for d in getattr(v, "shape", ())), str(getattr(v, "dtype", ""))) for v in values)


class _Graph:
    """One method at one set of input shapes: its CUDA graph, static inputs and outputs."""

    def __init__(self, graph: Optional[torch.cuda.CUDAGraph], inputs: List[torch.Tensor], outputs: List[torch.Tensor]):
        self.graph, self.inputs, self.outputs = graph, inputs, outputs


class GraphReplay:
    """Mixin: ``_run`` replays a CUDA graph of ``self._step`` per method and input shapes (see the module)."""

    # The CUDA graph capture mode; "relaxed" lets a step's runtime query an event it recorded earlier.
    capture_mode = "global"

    def _init_graphs(self) -> None:
        self.buffers: Dict[str, torch.Tensor] = {}
        self._graphs: Dict[Tuple[str, Tuple], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        self.captures = 0

    def _step(self, method: str, args: List[torch.Tensor]) -> List[torch.Tensor]:
        raise NotImplementedError

    def _inside_state(self, method: str) -> List[torch.Tensor]:
        """The tensors the methods write in place (their state inside), once ``method`` is ready to run."""
        return []

    def zeros(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        # Zeroed in place when it exists: every captured graph keeps reading this very buffer.
        buf = self.buffers.get(name)
        if buf is None or tuple(buf.shape) != tuple(shape) or buf.dtype != dtype:
            buf = self.buffers[name] = torch.zeros(list(shape), dtype=dtype, device=self.device)
        else:
            buf.zero_()
        return buf

    def _step_into_buffers(self, method: str, static: List[torch.Tensor]) -> List[torch.Tensor]:
        """The step on the static inputs, each state output copied into the buffer of its name.

        The copy is outside the step on purpose: written inside a compiled step (an input mutated in place),
        Inductor computed wrong VAE caches on the CPU, and a shipped ``.so`` returns new tensors anyway."""
        io = self.method_io(method)
        outputs = list(self._step(method, static))
        for out, name in self.state.get(method, {}).items():
            j = io.outputs.index(out)
            self.buffers[name].copy_(outputs[j])
            outputs[j] = self.buffers[name]
        return outputs

    def _static_inputs(self, method: str, args: List[torch.Tensor]) -> List[torch.Tensor]:
        names = [spec.name for spec in self.method_io(method).inputs]
        held = {name for outs in self.state.values() for name in outs.values()}
        static = []
        for name, arg in zip(names, args):
            if name in held and name in self.buffers:
                static.append(self.buffers[name])
            else:  # a state seen first here becomes its buffer: later calls hand it back as it is
                static.append(arg.clone())
                if name in held:
                    self.buffers[name] = static[-1]
        return static

    def _capture(self, method: str, args: List[torch.Tensor]) -> _Graph:
        io = self.method_io(method)
        static = self._static_inputs(method, args)
        cuda = self.device.type == "cuda"
        inside = self._inside_state(method)
        with torch.no_grad():
            saved = [t.clone() for t in inside]  # the warm-up calls write it: this call must find it as it was
        side = torch.cuda.Stream(self.device) if cuda else None
        if cuda:
            side.wait_stream(torch.cuda.current_stream(self.device))
        with (torch.cuda.stream(side) if cuda else contextlib.nullcontext()), torch.no_grad():
            for _ in range(2 if cuda else 1):  # compile and warm up on copies: the state buffers must not move yet
                outs = self._step(method, [a.clone() for a in static])
        if cuda:
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize(self.device)  # a runtime's own "run finished" event is complete before capture
        with torch.no_grad():
            for tensor, before in zip(inside, saved):
                tensor.copy_(before)
        del saved
        for out, name in self.state.get(method, {}).items():  # a state this method returns: its buffer
            ref = outs[io.outputs.index(out)]
            buf = self.buffers.get(name)
            if buf is None or buf.shape != ref.shape or buf.dtype != ref.dtype:
                self.buffers[name] = torch.empty_like(ref)
        del outs
        if not cuda:  # no CUDA graph on a CPU (a check of this code): the step runs at every call
            return _Graph(None, static, [])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode=self.capture_mode), torch.no_grad():
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

    def _close_graphs(self) -> None:
        self._graphs.clear()
        self.buffers.clear()


class GraphedArtifactBackend(GraphReplay, ArtifactBackend):
    """The shipped ``.so`` files through torch's AOTI runner, each method replayed as a CUDA graph."""

    name = "artifact"

    def __init__(self, run, device: str, methods: Sequence[str]):
        super().__init__(run, device, methods)
        self._init_graphs()

    def _load(self, method, so, weights, device):
        # The single-threaded entry point records no "run finished" event, which a capture could not query.
        sharing = {"shared": self.shared, "state": self.run.mutable_buffers(method)}
        try:
            return AotiRunner(so, weights, device, run_dir=self.run.path, single_threaded=True, **sharing)
        except VerificationFailed:  # no such entry point: the event is queried, which "relaxed" capture allows
            self.capture_mode = "relaxed"
            return AotiRunner(so, weights, device, run_dir=self.run.path, **sharing)

    def _step(self, method: str, args: List[torch.Tensor]) -> List[torch.Tensor]:
        return ArtifactBackend._run(self, method, args)

    def _inside_state(self, method: str) -> List[torch.Tensor]:
        names = sorted({name for m in self._runners for name in self.run.mutable_buffers(m)})
        return [self.shared.tensors[name] for name in names if name in self.shared.tensors]

    def close(self) -> None:
        if hasattr(self, "_graphs"):
            self._close_graphs()
        super().close()
