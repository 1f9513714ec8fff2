"""Running a method's compiled ``.so`` and weights blob, exactly as shipped, through torch's AOTI runner.

The ``.so`` AOTInductor builds for ExecuTorch does not link libtorch: it imports its ``aoti_torch_*`` runtime
functions by name. Python loads libtorch with RTLD_LOCAL, so those names are invisible to a library opened
later and the runner fails with "undefined symbol: aoti_torch_...". Re-opening libtorch_cpu and libtorch_cuda
with RTLD_GLOBAL|RTLD_NOLOAD (the trick ExecuTorch's own CUDA runtime plays on its shim library) makes them
visible without loading anything new. This runs the shipped kernels on libtorch's shims; pair it with the
symbol audit (zoo.export.audit), which checks the names against ExecuTorch's runtimes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
from pathlib import Path
import shutil
import tempfile
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Type, Union

import torch

from zoo.contract.artifact import extract_method_files, reusable_method_files
from zoo.contract.gpu_targets import Device, require_runs_on
from zoo.core.errors import NoGpuError, VerificationFailed, ZooError, first_line
from zoo.runtimes import shims

_PROMOTED = False


def promote_libtorch_global() -> None:
    """Make libtorch's ``aoti_torch_*`` functions visible to libraries opened after this call."""
    global _PROMOTED
    if _PROMOTED:
        return
    shims.claim(shims.LIBTORCH)
    lib_dir = Path(torch.__file__).resolve().parent / "lib"
    for name in ("libtorch_cpu.so", "libtorch_cuda.so"):
        path = lib_dir / name
        if path.exists():
            # RTLD_NOLOAD: only change the flags of the copy already loaded, never load a second one.
            ctypes.CDLL(str(path), mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD)
    _PROMOTED = True


def load_weights(container, weights_path: Union[str, Path, None]) -> bool:
    """Give a runner the constants its .so was built without; False when there are none to give.

    A method without constants has an empty weights blob, and the runner cannot mmap an empty file ("mmap()
    failed", seen on an H200), so an empty blob is skipped. ``update_constant_buffer_from_blob`` is bound in
    torch 2.11 although missing from ``_aoti.pyi``.
    """
    if not weights_path or Path(weights_path).stat().st_size == 0:
        return False
    container.update_constant_buffer_from_blob(str(weights_path))
    return True


class SharedConstants:
    """One tensor per constant name (original FQN) across the AOTI containers of one artifact's methods.

    Each method's ``.so`` runs in a container of its own, which loads its own copy of every constant from its
    weights blob. Two things want one copy instead:

    * state: a buffer the methods write in place (LingBot-VA's KV pool in the "buffer" layout) must be one
      tensor, or ``action_step`` never sees the K/V ``video_step`` wrote;
    * memory: methods of one constant-plan group have byte-identical blobs (``zoo.export.lower.constant_plan``,
      stored once in the ``.ptd``, one file once extracted), so every constant of the second is the first's.

    ``load`` does, per method, what ExecuTorch's ``weight_sharing_across_methods`` does in its CUDA backend:
    a method whose blob is a file an earlier method loaded loads none, and its container is pointed at the
    earlier tensors (``update_constant_buffer(..., user_managed=True)``, validated in full: no copy); any other
    method loads its own blob, and then only its ``state`` buffers (``so/<method>.io.json``'s
    ``mutable_buffers``) are pointed at the tensors an earlier method holds under the same names. The
    containers are torch's ``AOTIModelContainerRunnerCuda`` (or ``...Cpu``: the same methods, for CPU tests).
    """

    def __init__(self) -> None:
        self.tensors: Dict[str, torch.Tensor] = {}  # original FQN -> the tensor every container reads
        # a loaded weights file -> the method that loaded it; by (device, inode): extraction hard-links a blob two
        # methods share (``zoo.contract.artifact.extract_method_files``)
        self.blobs: Dict[Tuple[int, int], str] = {}
        self.how: Dict[str, str] = {}  # method -> what it shares, in words

    def load(self, method: str, container: Any, weights: Union[str, Path, None], state: Sequence[str] = ()) -> None:
        facts = Path(weights).stat() if weights else None
        blob = (facts.st_dev, facts.st_ino) if facts is not None and facts.st_size else None
        owner = self.blobs.get(blob) if blob is not None else None
        if owner is not None:
            self._point(container, self.tensors, full=True)
            how = f"every constant shared with {owner} (one weights blob)"
        else:
            load_weights(container, weights)
            shared = {fqn: self.tensors[fqn] for fqn in state if fqn in self.tensors}
            self._point(container, shared, full=False)
            how = f"own weights; state {sorted(shared)} shared" if shared else "own weights"
        # Recorded only once the method is loaded: a load that failed leaves nothing a later one could share.
        if owner is None and blob is not None:
            self.blobs[blob] = method
        for fqn, tensor in container.extract_constants_map(False).items():
            self.tensors.setdefault(fqn, tensor)
        self.how[method] = how

    def _point(self, container: Any, by_fqn: Mapping[str, torch.Tensor], *, full: bool) -> None:
        """Point ``container``'s constants named in ``by_fqn`` at those tensors (no copy); ``full``: all of them."""
        names = container.get_constant_names_to_original_fqns()  # internal name -> original FQN
        if full:
            missing = sorted(fqn for fqn in names.values() if fqn not in by_fqn)
            if missing:
                raise VerificationFailed(f"a method's weights blob is another's, yet its .so has constants the other "
                                         f"lacks: {missing[:3]}", "lower the run again (`python -m zoo lower RUN_DIR`)")
        if not by_fqn:
            return
        own = container.extract_constants_map(False) if not full else {}
        update = {}
        for name, fqn in names.items():
            if fqn not in by_fqn:
                continue
            mine, theirs = own.get(fqn), by_fqn[fqn]
            if mine is not None and (mine.shape != theirs.shape or mine.dtype != theirs.dtype):
                raise VerificationFailed(f"constant {fqn!r} has shape {tuple(mine.shape)} {mine.dtype} in one method "
                                         f"and {tuple(theirs.shape)} {theirs.dtype} in another: they cannot share it",
                                         "lower the run again (`python -m zoo lower RUN_DIR`)")
            update[name] = theirs
        container.update_constant_buffer(update, False, full, True)

    def unshared(self, containers: Mapping[str, Any], names: Iterable[str]) -> Dict[str, str]:
        """Of ``names`` (original FQNs), each one the ``containers`` do not all read from one tensor: name -> why."""
        held = {method: container.extract_constants_map(False) for method, container in containers.items()}
        return separate_copies(held, names, "constant")


def separate_copies(held: Mapping[str, Mapping[str, torch.Tensor]], names: Iterable[str],
                    what: str) -> Dict[str, str]:
    """Of ``names``, each one the methods do not all hold in one memory (``held``: method -> {name: tensor}):
    name -> why. ``what`` names the kind of value in the message (a constant of a ``.so``, a module's buffer)."""
    problems: Dict[str, str] = {}
    for name in names:
        missing = [method for method, tensors in held.items() if name not in tensors]
        if missing:
            problems[name] = f"method {missing[0]!r} holds no {what} {name!r}"
        elif len({tensors[name].data_ptr() for tensors in held.values()}) > 1:
            problems[name] = f"methods {sorted(held)} hold separate copies"
    return problems


def cuda_device(device: Union[str, torch.device] = "cuda") -> Device:
    """The GPU a loader is about to run on (name, compute capability) and this host's machine, for
    ``gpu_targets.require_runs_on``."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    return Device(name=torch.cuda.get_device_name(index), capability=tuple(torch.cuda.get_device_capability(index)),
                  machine=platform.machine())


class AotiRunner:
    """One method's ``.so`` with its weights blob loaded, ready to run on ``device`` (a CUDA device).

    Before loading, the ``.so``'s host machine and kernel images are checked against this GPU and host
    (``gpu_targets.require_runs_on``): an artifact lowered for another GPU is refused with what to do, instead of
    failing inside the loader or at its first kernel launch. ``run_dir`` goes into that message's command."""

    def __init__(self, so_path: Union[str, Path], weights_path: Union[str, Path, None], device: str = "cuda", *,
                 run_dir: Optional[Union[str, Path]] = None, single_threaded: bool = False,
                 shared: Optional[SharedConstants] = None, state: Sequence[str] = ()):
        if not torch.cuda.is_available():
            raise NoGpuError("running the compiled .so needs a CUDA device and none is visible",
                             "verify on the machine with the GPU (`python -m zoo lower RUN_DIR`)")
        self.so_path = Path(so_path)
        self.targets = require_runs_on({self.so_path.stem: self.so_path}, cuda_device(device),
                                       run_dir=str(run_dir or "RUN_DIR"))[self.so_path.stem]
        promote_libtorch_global()
        try:
            # single_threaded: the container's entry point that records no "run finished" event, so a CUDA graph
            # can capture a call (zoo.runner.graphs).
            args = (str(self.so_path), 1, device) + (("", True) if single_threaded else ())
            self._runner = torch._C._aoti.AOTIModelContainerRunnerCuda(*args)
            if shared is None:
                load_weights(self._runner, weights_path)
            else:  # the constants the methods share by name (``state``: the buffers this method writes)
                shared.load(self.so_path.stem, self._runner, weights_path, state)
        except RuntimeError as exc:  # the loader's own errors (SharedConstants raises zoo's)
            raise VerificationFailed(f"torch's AOTI runner cannot load {self.so_path}: {exc}",
                                     "the .so and its weights blob must come from one lowering, run with the torch "
                                     f"version that compiled them (this is {torch.__version__})") from exc

    @property
    def container(self) -> Any:
        """torch's AOTI container runner over the .so."""
        return self._runner

    def run(self, inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Run with inputs in the .so's own order; returns its outputs in its own order."""
        return list(self._runner.run([t.contiguous() for t in inputs]))


# (method, .so path, weights blob path or None, device) -> an object whose run(inputs) returns outputs,
# both in the .so's own order.
RunnerFactory = Callable[[str, Path, Optional[Path], str], Any]


def aoti_runner_factory(method: str, so: Path, weights: Optional[Path], device: str) -> AotiRunner:
    return AotiRunner(so, weights, device)


def sharing_runner_factory(state: Mapping[str, Sequence[str]]) -> RunnerFactory:
    """A factory whose runners share their constants by name (``SharedConstants``): ``state`` names, per method,
    the buffers it writes in place (``RunFolder.mutable_buffers``), which the methods must hold as one tensor."""
    shared = SharedConstants()

    def factory(method: str, so: Path, weights: Optional[Path], device: str) -> AotiRunner:
        return AotiRunner(so, weights, device, shared=shared, state=state.get(method, ()))

    return factory


def run_in_delegate_order(runner: Any, order: Dict[str, Any], inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Run a method's .so: ``inputs`` in the method's signature order are handed over in the delegate's order
    (``so/<method>.io.json``), and its outputs come back in the method's order."""
    outs = runner.run([inputs[i] for i in order["input_order"]])
    return [outs[j] for j in order["output_order"]]


@contextlib.contextmanager
def shipped_runners(pte: Path, ptd: Path, methods: Sequence[str], factory: RunnerFactory,
                    device: str, so_dir: Optional[Path] = None,
                    error: Type[ZooError] = VerificationFailed,
                    scratch: Optional[Path] = None) -> Iterator[Dict[str, Any]]:
    """A runner per method over the bytes that ship: each method's .so and weights as model.pte /
    aoti_cuda_blob.ptd hold them now, so a swapped or edited file is what gets run. With ``so_dir`` (the run
    folder's ``so/``), the files extracted there are used while its stamp says they are these very .pte/.ptd
    files' bytes, untouched (``artifact.reusable_method_files``: no second ~10 GB copy of a real-size blob);
    otherwise only ``methods`` are extracted, a shared weights segment once, into a folder that lives only while
    the runners are in use (under ``scratch``, default beside the .pte: a Hub snapshot is read-only). On a CUDA
    device, every method's host code and kernels are checked against this GPU before any is loaded
    (``gpu_targets.require_runs_on``). A missing or unloadable method raises ``error`` (verification's or the
    runner's)."""
    ptd_there = ptd if ptd.exists() else None
    shipped = reusable_method_files(pte, ptd_there, so_dir, methods) if so_dir is not None else None
    shipped_dir = None
    try:
        if shipped is None:
            shipped_dir = Path(tempfile.mkdtemp(prefix=".verify.tmp-", dir=scratch or pte.parent))
            shipped = extract_method_files(pte, ptd_there, shipped_dir, methods)
        absent = [m for m in methods if m not in shipped]
        if absent:
            raise error(f"{pte} holds no compiled .so for method {absent[0]!r}",
                        "lower the run again (`python -m zoo lower RUN_DIR`)")
        if str(device).startswith("cuda") and torch.cuda.is_available():  # without a GPU, the loader says so
            require_runs_on({m: shipped[m]["so"] for m in methods}, cuda_device(device),
                            artifact=f"the artifact in {pte.parent}", run_dir=str(pte.parent))
        runners = {}
        for m in methods:
            try:
                runners[m] = factory(m, shipped[m]["so"], shipped[m]["weights"], device)
            except ZooError:
                raise
            except Exception as exc:  # a loader's own error: the .so is damaged or built for another machine
                raise error(f"the .so of method {m!r} in {pte} cannot be loaded: "
                            f"{type(exc).__name__}: {first_line(exc)}",
                            "the artifact is damaged, or was built for another GPU or torch: "
                            "lower the run again (`python -m zoo lower RUN_DIR`)") from exc
        yield runners
    finally:
        if shipped_dir is not None:
            shutil.rmtree(shipped_dir, ignore_errors=True)
