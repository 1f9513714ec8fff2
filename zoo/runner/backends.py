"""What runs a method of the artifact for a host loop: ``eager`` (the rewritten program), ``artifact`` (each shipped
``.so`` through torch's AOTI runner), ``executorch`` (``model.pte`` + ``.ptd`` on ExecuTorch's runtime in a
process of its own, the state kept on the GPU as ``DeviceValue`` handles) or ``executorch-inprocess`` (the same
runtime loaded into this process, CUDA tensors in and out). All take and return tensors by name in the method's
signature order (docs/host-loops.md, "The backends a host loop drives").
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.export.passes import move_to_device_pass
from torch.utils import _pytree as pytree

from zoo.contract.artifact import WEIGHTS_SUFFIX, io_memory_planning, read_ptd_entries
from zoo.contract.io_spec import IoSpec, MethodIo
from zoo.core.errors import RunnerError
from zoo.runtimes.executorch import DeviceValue, RuntimeSession
from zoo.runtimes.inprocess import InProcessSession
from zoo.core.progress import warn
from zoo.contract.run_folder import RunFolder
from zoo.contract.releases import requirement_for
from zoo.runtimes.aoti import AotiRunner, SharedConstants, run_in_delegate_order, shipped_runners
from zoo.runner.state import SharedBuffers

# The backends that run the lowered artifact (the others run the rewritten programs).
ARTIFACT_BACKENDS = ("artifact", "executorch", "executorch-inprocess")
BACKENDS = ("eager",) + ARTIFACT_BACKENDS
# {method: {output name: the name it is kept and fed back under}}
DeviceState = Dict[str, Dict[str, str]]


def refuse_cpu_device(backend: str, device: str) -> None:
    if not str(device).startswith("cuda"):
        raise RunnerError(f"backend {backend!r} runs the compiled CUDA kernels; device {device!r} cannot",
                          "pass device='cuda' (on a machine with a GPU), or use backend='eager'")


def refuse_unlowered(run: RunFolder) -> None:
    if not run.pte.is_file():
        raise RunnerError(f"{run.pte} is missing: the run was not lowered",
                          "lower it on a GPU machine (`python -m zoo lower RUN_DIR`), or use backend='eager'")


class Backend:
    """Runs methods by name: ``call(method, **inputs) -> {output name: tensor}``."""

    name = "?"

    def __init__(self, run: RunFolder, device: str):
        self.run = run
        self.device = torch.device(device)
        self.io_spec: IoSpec = run.read_io_spec()
        self.state: DeviceState = {}

    def methods(self) -> List[str]:
        return list(self.io_spec.methods)

    def keep_state(self, state: DeviceState) -> None:
        """The outputs the family feeds back into later calls; a backend that can keeps them where they are."""
        check_state(state, self.io_spec.methods)
        self.state = {m: dict(outs) for m, outs in state.items()}

    def zeros(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> Any:
        """Zero-filled state to start with (a KV pool), under the name the family feeds it back as."""
        return torch.zeros(list(shape), dtype=dtype, device=self.device)

    def sharing_problem(self, methods: Sequence[str], buffers: Sequence[str]) -> Optional[str]:
        """Why ``methods`` do not all read and write one copy of each of ``buffers`` (state the methods keep inside
        under these names: LingBot-VA's KV pool in the "buffer" layout), or None when they do."""
        return f"backend {self.name!r} gives each method its own copy of the state it keeps inside"

    def hold(self, name: str, tensor: torch.Tensor) -> Any:
        """An input the host loop passes unchanged call after call (a prompt's embedding): a backend that keeps
        values where the methods run hands the same one back while its content stays the same."""
        return tensor.to(self.device)

    @property
    def last_call(self) -> Any:
        """Where the last call's time went, for a backend that can say (``executorch``: a ``CallTiming``)."""
        return None

    def method_io(self, method: str) -> MethodIo:
        methods = self.io_spec.methods
        if method not in methods:
            raise RunnerError(f"the run in {self.run.path} has no method {method!r} (it has "
                              f"{', '.join(methods) or 'none'})", "export the recipe with that method in unit.methods")
        return methods[method]

    def _ordered(self, method: str, inputs: Dict[str, Any]) -> List[Any]:
        io = self.method_io(method)
        names = [spec.name for spec in io.inputs]
        missing = [n for n in names if n not in inputs]
        extra = sorted(set(inputs) - set(names))
        if missing or extra:
            raise RunnerError(f"method {method!r} takes {names}; missing {missing}, unexpected {extra}",
                              "this is a zoo.runner bug: the family runner and io_spec.json disagree")
        return [inputs[n] for n in names]

    def call(self, method: str, **inputs: torch.Tensor) -> Dict[str, torch.Tensor]:
        io = self.method_io(method)
        args = [t.to(self.device) for t in self._ordered(method, inputs)]
        outs = self._run(method, args)
        if len(outs) != len(io.outputs):
            raise RunnerError(f"method {method!r} returned {len(outs)} outputs, io_spec.json names "
                              f"{len(io.outputs)}", "export and lower the run again")
        return dict(zip(io.outputs, outs))

    def _run(self, method: str, args: List[torch.Tensor]) -> List[torch.Tensor]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class EagerBackend(Backend):
    """The rewritten programs, run by PyTorch on ``device``; each is loaded on first use."""

    name = "eager"

    def __init__(self, run: RunFolder, device: str):
        super().__init__(run, device)
        self._modules: Dict[str, torch.nn.Module] = {}
        self.shared = SharedBuffers()  # the buffers the programs write, one tensor per name across them

    def _module(self, method: str) -> torch.nn.Module:
        if method not in self._modules:
            path = self.run.program("rewritten", method)
            if not path.is_file():
                raise RunnerError(f"{path} is missing: the eager backend runs the rewritten programs",
                                  "use a run folder from `python -m zoo.export`, or backend='artifact' for a "
                                  "published artifact")
            program = self.run.load_program("rewritten", method)
            if self.device.type != "cpu":
                program = move_to_device_pass(program, str(self.device))
            self._modules[method] = self.shared.module_of(program)
        return self._modules[method]

    def sharing_problem(self, methods: Sequence[str], buffers: Sequence[str]) -> Optional[str]:
        return _in_words(self.shared.unshared({m: self._module(m) for m in methods}, buffers))

    def _run(self, method: str, args: List[torch.Tensor]) -> List[torch.Tensor]:
        with torch.no_grad():
            out = self._module(method)(*args)
        return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


class ArtifactBackend(Backend):
    """Each method's shipped ``.so`` and weights through torch's AOTI runner (needs a CUDA device)."""

    name = "artifact"

    def __init__(self, run: RunFolder, device: str, methods: Sequence[str]):
        self._stack = contextlib.ExitStack()
        self._runners: Dict[str, AotiRunner] = {}
        self.shared = SharedConstants()  # one tensor per constant name across the methods' containers
        refuse_cpu_device(self.name, device)
        super().__init__(run, device)
        refuse_unlowered(run)
        missing = [str(run.io_order_file(m)) for m in methods if not run.io_order_file(m).is_file()]
        if missing:
            raise RunnerError(f"{', '.join(missing)} missing: the compiled .so's input order is unknown",
                              "lower the run (`python -m zoo lower RUN_DIR`) or download the whole published folder")
        self._orders = {m: run.io_order(m) for m in methods}
        # The bytes that ship, taken out of model.pte / aoti_cuda_blob.ptd now (not copies left by lowering),
        # into a private temporary folder: a run may be a read-only Hub snapshot. Every method is checked against
        # this GPU and host before any is loaded (zoo.contract.gpu_targets).
        self._runners = self._stack.enter_context(shipped_runners(
            run.pte, run.ptd, methods, self._load, str(self.device), error=RunnerError,
            scratch=Path(tempfile.gettempdir())))

    def _load(self, method: str, so: Path, weights: Optional[Path], device: str) -> AotiRunner:
        return AotiRunner(so, weights, device, run_dir=self.run.path, shared=self.shared,
                          state=self.run.mutable_buffers(method))

    def _run(self, method: str, args: List[torch.Tensor]) -> List[torch.Tensor]:
        return run_in_delegate_order(self._runners[method], self._orders[method], args)

    def sharing_problem(self, methods: Sequence[str], buffers: Sequence[str]) -> Optional[str]:
        return _in_words(self.shared.unshared({m: self._runners[m].container for m in methods}, buffers))

    def close(self) -> None:
        self._runners = {}
        self._stack.close()

    def __del__(self):  # the extracted .so files are only a cache of model.pte's bytes
        self.close()


def _in_words(problems: Dict[str, str]) -> Optional[str]:
    """``{buffer: why it is not one copy}`` in one line, or None when there is no problem."""
    if not problems:
        return None
    names = sorted(problems)
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    return f"{len(names)} buffer(s) not one copy ({shown}): {problems[names[0]]}"


def check_state(state: DeviceState, methods: Dict[str, MethodIo]) -> None:
    """Each kept output is an output of its method, and each name it is kept under is an input of some method
    (the one it is fed back to); a method the run does not have is skipped (an optional method)."""
    inputs = {spec.name for io in methods.values() for spec in io.inputs}
    for method, outs in state.items():
        if method not in methods:
            continue
        for output, name in outs.items():
            if output not in methods[method].outputs or name not in inputs:
                raise RunnerError(f"the host loop keeps output {output!r} of {method!r} as {name!r}, but the run's "
                                  f"io_spec.json has no such {'output' if name in inputs else 'input'}",
                                  "this is a zoo.runner bug: the family's device_state and io_spec.json disagree")


class ExecuTorchRuntimeBackend(Backend):
    """What the two backends on ExecuTorch's runtime share (``self.session``: a RuntimeSession or an
    InProcessSession over the run's ``model.pte`` + ``.ptd``): the release check's requirement, constant sharing,
    the warning about state an old artifact plans in host memory, the last call's timing, closing."""

    def __init__(self, run: RunFolder, device: str):
        self.session: Any = None
        super().__init__(run, device)
        refuse_unlowered(run)
        self.requirement = requirement_for(run, io_memory_planning)

    def sharing_problem(self, methods: Sequence[str], buffers: Sequence[str]) -> Optional[str]:
        # The runtime is opaque from here, so what decides whether its CUDA backend shares a method's constants
        # (docs/runtime.md, "State on the GPU") is checked instead. It shares them when the option is on and every
        # constant of the later method is on the GPU already, which the methods of one constant-plan group
        # guarantee: one constant table, one weights blob (one segment of the .ptd).
        sharing = self.session.build.get("weight_sharing_across_methods")
        if not self.session.weight_sharing or sharing != "on":
            return (f"this runtime build shares no constants between methods (weight sharing across methods: "
                    f"{sharing if self.session.weight_sharing else 'off'})")
        for method in methods:
            held = set(self.run.mutable_buffers(method))
            missing = [b for b in buffers if b not in held]
            if missing:
                return (f"method {method!r}'s compiled code does not write {missing[:3]} in place "
                        f"({self.run.io_order_file(method).name} lists {sorted(held)[:4] or 'none'})")
        if not self.run.ptd.is_file():
            return f"{self.run.ptd} is missing: the methods' constants cannot be shared"
        segments = {e.key: (e.offset, e.size) for e in read_ptd_entries(self.run.ptd)}
        blobs = {segments.get(m + WEIGHTS_SUFFIX) for m in methods}
        if len(blobs) != 1 or None in blobs:
            return (f"the weights blobs of {', '.join(methods)} differ, so ExecuTorch's weight sharing, which shares "
                    "a method's constants only when all of them are loaded already, gives each its own copy")
        return None

    def keep_state(self, state: DeviceState) -> None:
        super().keep_state(state)
        if state and not self.requirement.device_io:
            warn(f"the artifact in {self.run.path} plans its graph inputs in host memory (lowered before zoo left "
                 "them out): the state it hands from call to call is copied to the host and back in every call; "
                 "lower the run again to keep it on the GPU")

    @property
    def last_call(self) -> Any:
        return self.session.last_call if self.session is not None else None

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None


class ExecuTorchBackend(ExecuTorchRuntimeBackend):
    """``model.pte`` + ``aoti_cuda_blob.ptd`` in ExecuTorch's own C++ runtime (one zoo_runner process, every method
    loaded); the family's state kept there. ``device`` is where the host side computes (noise, schedulers)."""

    name = "executorch"

    def __init__(self, run: RunFolder, device: str, methods: Sequence[str], executable: Optional[str] = None,
                 require_cuda: bool = True):
        super().__init__(run, device)
        self.session = RuntimeSession(run.pte, run.ptd if run.ptd.is_file() else None, executable=executable,
                                      methods=methods, require_cuda=require_cuda, requirement=self.requirement)
        self._held: Dict[str, Tuple[torch.Tensor, DeviceValue]] = {}

    def zeros(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> DeviceValue:
        return self.session.zeros(name, shape, dtype)

    def hold(self, name: str, tensor: torch.Tensor) -> DeviceValue:
        # Uploaded once and passed by name while equal: a host input otherwise goes through a tensor file and a
        # host-to-device copy in every call (LingBot-VA's CFG prompt embedding: 8 MiB, 74 calls a chunk).
        key = f"held.{name}." + "x".join(str(d) for d in tensor.shape)
        held = self._held.get(key)
        if held is not None and held[0].dtype == tensor.dtype and torch.equal(held[0], tensor.to(held[0].device)):
            return held[1]
        value = self.session.upload(key, tensor.detach().to("cpu"))
        self._held[key] = (tensor.detach().clone(), value)
        return value

    def call(self, method: str, **inputs: Any) -> Dict[str, Any]:
        io = self.method_io(method)
        outputs = list(io.outputs)
        kept = self.state.get(method, {})
        keep = {k: kept[name] for k, name in enumerate(outputs) if name in kept}
        outs = self.session.call(method, self._ordered(method, inputs), keep=keep)
        if len(outs) != len(outputs):
            raise RunnerError(f"method {method!r} returned {len(outs)} outputs, io_spec.json names {len(outputs)}",
                              "export and lower the run again")
        return {name: out if isinstance(out, DeviceValue) else out.to(self.device) for name, out in zip(outputs, outs)}

    def __del__(self):  # the runner process and its temporary folder
        self.close()


class InProcessBackend(ExecuTorchRuntimeBackend):
    """``model.pte`` + ``aoti_cuda_blob.ptd`` in ExecuTorch's runtime loaded into this process
    (zoo.runtimes.inprocess): CUDA tensors in, each output copied into a CUDA tensor, state kept as torch tensors.
    Not for a process that also runs torch's AOTI runner (zoo.runtimes.shims refuses it)."""

    name = "executorch-inprocess"

    def __init__(self, run: RunFolder, device: str, methods: Sequence[str], library: Optional[str] = None):
        refuse_cpu_device(self.name, device)
        super().__init__(run, device)
        self.session = InProcessSession(run.pte, run.ptd if run.ptd.is_file() else None, library=library,
                                        methods=methods, device=device, requirement=self.requirement)

    def _run(self, method: str, args: List[torch.Tensor]) -> List[torch.Tensor]:
        return self.session.call(method, args)


def make_backend(name: str, run: RunFolder, device: str, et_runner: Optional[str] = None) -> Backend:
    if name == "eager":
        return EagerBackend(run, device)
    if name == "artifact":
        return ArtifactBackend(run, device, list(run.read_io_spec().methods))
    if name == "executorch":
        return ExecuTorchBackend(run, device, list(run.read_io_spec().methods), executable=et_runner)
    if name == "executorch-inprocess":
        return InProcessBackend(run, device, list(run.read_io_spec().methods))
    raise RunnerError(f"unknown runner backend {name!r}", f"use one of: {', '.join(BACKENDS)}")
