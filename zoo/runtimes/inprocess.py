"""ExecuTorch's runtime inside this process: ``libzoo_session.so`` (runtime/cpp/zoo_session.h) through ctypes.

The same runtime and CUDA backend as ``zoo_runner`` (zoo.runtimes.executorch), without the process boundary: a
CUDA tensor goes to the backend as its device pointer, with no tensor file, no pipe and no host-to-device copy,
and each output is copied straight into a torch tensor. What it may not share a process with (torch's AOTI
runner) and why: docs/runtime.md, "In this process".
"""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from zoo.contract.tensor_file import CODE_DTYPES, DTYPE_CODES
from zoo.contract.releases import RuntimeRequirement
from zoo.core.errors import GpuTargetMismatch, RuntimeCallFailed, RuntimeConflict, RuntimeNotBuilt
from zoo.runtimes import shims
from zoo.runtimes.executorch import BUILD_HINT, RUNNER_ENV, CallTiming

LIBRARY_ENV = "ZOO_ET_SESSION"
LIBRARY_NAME = "libzoo_session.so"
ABI = 1
MAX_DIMS = 16
_ERROR_SIZE = 4096
PathLike = Union[str, Path]


class _Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_uint32), ("ndim", ctypes.c_uint32),
                ("sizes", ctypes.c_int64 * MAX_DIMS)]


_lib: Optional[ctypes.CDLL] = None
_lib_path: Optional[Path] = None  # what _lib was loaded from: a process holds one library, so another is refused


def find_library(path: Optional[PathLike] = None) -> Path:
    """``path``, else ``$ZOO_ET_SESSION``, else the library built beside ``$ZOO_ET_RUNNER``'s zoo_runner."""
    chosen = path or os.environ.get(LIBRARY_ENV)
    if not chosen and os.environ.get(RUNNER_ENV):
        chosen = Path(os.environ[RUNNER_ENV]).parent / LIBRARY_NAME
    if not chosen:
        raise RuntimeNotBuilt(f"no in-process ExecuTorch runtime given: pass {LIBRARY_NAME}, or set {LIBRARY_ENV} "
                              f"(or {RUNNER_ENV}, with the library beside it)", BUILD_HINT)
    chosen = Path(chosen)
    if not chosen.is_file():
        raise RuntimeNotBuilt(f"{chosen} is not a built {LIBRARY_NAME}", BUILD_HINT)
    return chosen


def load_library(path: Optional[PathLike] = None) -> ctypes.CDLL:
    """The library, loaded once per process. It is made global (its shims serve the compiled code's
    ``aoti_torch_*`` imports), so it is refused in a process whose libtorch already serves them."""
    global _lib, _lib_path
    if _lib is not None:
        if path is not None and Path(path).resolve() != _lib_path:
            raise RuntimeConflict(f"this process already loaded {_lib_path}; {path} cannot be loaded beside it (a "
                                  f"library cannot be unloaded)", "name the same library, or use another process")
        return _lib
    found = find_library(path)
    shims.claim(shims.EXECUTORCH)
    try:
        lib = ctypes.CDLL(str(found), mode=os.RTLD_NOW | os.RTLD_GLOBAL)
    except OSError as e:
        shims.release(shims.EXECUTORCH)
        raise RuntimeNotBuilt(f"{found} does not load: {e}", BUILD_HINT) from None
    err = ctypes.c_char_p
    lib.zoo_session_abi.restype = ctypes.c_int
    lib.zoo_session_build.restype = ctypes.c_char_p
    lib.zoo_session_open.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int,
                                     ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_double), err,
                                     ctypes.c_size_t]
    lib.zoo_session_close.argtypes = [ctypes.c_void_p]
    lib.zoo_session_close.restype = None
    lib.zoo_session_signature.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint32),
                                          ctypes.POINTER(ctypes.c_uint32), err, ctypes.c_size_t]
    lib.zoo_session_output_meta.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint32,
                                            ctypes.POINTER(_Tensor), err, ctypes.c_size_t]
    lib.zoo_session_call.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(_Tensor), ctypes.c_uint32,
                                     ctypes.POINTER(_Tensor), ctypes.c_uint32, ctypes.POINTER(ctypes.c_double),
                                     ctypes.POINTER(ctypes.c_double), err, ctypes.c_size_t]
    if lib.zoo_session_abi() != ABI:
        raise RuntimeNotBuilt(f"{found} speaks zoo_session ABI {lib.zoo_session_abi()}, this zoo speaks {ABI}",
                              "rebuild it from this checkout: " + BUILD_HINT)
    _lib, _lib_path = lib, found.resolve()
    return lib


def library_build(path: Optional[PathLike] = None) -> Dict[str, Any]:
    """What the library is (ExecuTorch version, CUDA, backends, patches), as ``zoo_runner --info`` says."""
    return json.loads(load_library(path).zoo_session_build().decode())


def _describe(tensor: torch.Tensor) -> _Tensor:
    if tensor.dtype not in DTYPE_CODES:
        raise RuntimeCallFailed(f"a {tensor.dtype} tensor cannot be passed to ExecuTorch's runtime",
                                f"use one of {', '.join(str(d).replace('torch.', '') for d in DTYPE_CODES)}")
    if tensor.dim() > MAX_DIMS:
        raise RuntimeCallFailed(f"a rank-{tensor.dim()} tensor is over the runtime's {MAX_DIMS} dimensions")
    out = _Tensor()
    out.data = tensor.data_ptr() if tensor.numel() else None
    out.dtype = DTYPE_CODES[tensor.dtype]
    out.ndim = tensor.dim()
    for d, size in enumerate(tensor.shape):
        out.sizes[d] = size
    return out


class InProcessSession:
    """One loaded program in this process; ``call(method, inputs)`` in the method's signature order returns its
    outputs as tensors on ``device`` (copied out of the backend before the call returns)."""

    def __init__(self, pte: PathLike, ptd: Optional[PathLike] = None, *, library: Optional[PathLike] = None,
                 methods: Optional[Sequence[str]] = None, device: Union[str, torch.device, None] = None,
                 weight_sharing: bool = True, requirement: Optional[RuntimeRequirement] = None):
        self._lib = load_library(library)
        self.build = library_build(library)
        if requirement is not None:  # an artifact of another runtime release is refused before it is loaded
            requirement.check(self.build, find_library(library))
        self.device = torch.device(device) if device is not None else \
            torch.device("cuda" if self.build.get("cuda") and torch.cuda.is_available() else "cpu")
        self.weight_sharing = weight_sharing
        if self.device.type == "cuda" and (self.device.index or 0) != 0:
            # ExecuTorch 1.2's CUDA backend runs every method on device 0 (DEFAULT_CUDA_DEVICE).
            raise RuntimeCallFailed(f"the in-process runtime runs on cuda:0, not {self.device}",
                                    "make the GPU device 0 of this process (CUDA_VISIBLE_DEVICES=N)")
        if self.device.type == "cuda":
            torch.cuda.init()  # one CUDA context for torch and the backend: the device's primary context
        handle, load_ms = ctypes.c_void_p(), ctypes.c_double()
        error = ctypes.create_string_buffer(_ERROR_SIZE)
        ptd_arg = str(ptd).encode() if ptd is not None else None
        csv = ",".join(methods).encode() if methods else None
        status = self._lib.zoo_session_open(str(pte).encode(), ptd_arg, csv, int(weight_sharing), ctypes.byref(handle),
                                            ctypes.byref(load_ms), error, _ERROR_SIZE)
        if status == 2:
            raise GpuTargetMismatch(f"{pte}: {error.value.decode()}")  # the runtime's words say what to do
        if status != 0:
            raise RuntimeCallFailed(f"ExecuTorch's runtime could not load {pte}: {error.value.decode()}",
                                    "its log on stderr says more; `zoo_runner --model ... --plan -` loads the same "
                                    "program in a process of its own")
        self._handle: Optional[ctypes.c_void_p] = handle
        self.load_ms = load_ms.value
        self._outputs: Dict[str, List[Tuple[torch.dtype, Tuple[int, ...]]]] = {}
        self.last_call: Optional[CallTiming] = None
        self.stats = {"calls": 0}

    def _check(self, status: int, error: Any, what: str) -> None:
        if status != 0:
            raise RuntimeCallFailed(f"{what}: {error.value.decode()}", "ExecuTorch's log on stderr says more")

    def outputs_of(self, method: str) -> List[Tuple[torch.dtype, Tuple[int, ...]]]:
        """Each output's dtype and static shape, read from the loaded program once."""
        if method not in self._outputs:
            error = ctypes.create_string_buffer(_ERROR_SIZE)
            n_in, n_out = ctypes.c_uint32(), ctypes.c_uint32()
            self._check(self._lib.zoo_session_signature(self._open(), method.encode(), ctypes.byref(n_in),
                                                        ctypes.byref(n_out), error, _ERROR_SIZE), error, method)
            metas = []
            for k in range(n_out.value):
                meta = _Tensor()
                self._check(self._lib.zoo_session_output_meta(self._handle, method.encode(), k, ctypes.byref(meta),
                                                              error, _ERROR_SIZE), error, method)
                if meta.dtype not in CODE_DTYPES:
                    raise RuntimeCallFailed(f"output {k} of {method} has dtype code {meta.dtype}, which torch "
                                            "cannot hold here")
                metas.append((CODE_DTYPES[meta.dtype], tuple(meta.sizes[d] for d in range(meta.ndim))))
            self._outputs[method] = metas
        return self._outputs[method]

    def _open(self) -> ctypes.c_void_p:
        if self._handle is None:
            raise RuntimeCallFailed("the in-process session is closed", "open a new InProcessSession")
        return self._handle

    def call(self, method: str, inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Run ``method`` once. A CUDA input goes to the backend as it is; a CPU one is copied by the backend."""
        metas = self.outputs_of(method)
        outputs = [torch.empty(shape, dtype=dtype, device=self.device) for dtype, shape in metas]
        # The backend runs on a stream of its own, which waits for the default stream's work but not for another
        # stream's: inputs written on a side stream must be finished first.
        if self.device.type == "cuda" and torch.cuda.current_stream() != torch.cuda.default_stream():
            torch.cuda.current_stream().synchronize()
        contiguous = [t.detach().contiguous() for t in inputs]  # kept alive until the call returns
        ins = (_Tensor * max(1, len(contiguous)))(*[_describe(t) for t in contiguous])
        outs = (_Tensor * max(1, len(outputs)))(*[_describe(t) for t in outputs])
        ms, io_ms = ctypes.c_double(), ctypes.c_double()
        error = ctypes.create_string_buffer(_ERROR_SIZE)
        status = self._lib.zoo_session_call(self._open(), method.encode(), ins, len(contiguous), outs, len(outputs),
                                            ctypes.byref(ms), ctypes.byref(io_ms), error, _ERROR_SIZE)
        self._check(status, error, f"running {method} in process")
        self.stats["calls"] += 1
        self.last_call = CallTiming(write=0.0, execute=ms.value, runtime_io=io_ms.value, pipe=0.0, read=0.0)
        return outputs

    def runner(self, method: str) -> "InProcessMethod":
        return InProcessMethod(self, method)

    def close(self) -> None:
        if self._handle is not None:
            self._lib.zoo_session_close(self._handle)
            self._handle = None

    def __enter__(self) -> "InProcessSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if getattr(self, "_handle", None) is not None:
            self.close()


class InProcessMethod:
    """One method of an in-process session with zoo.runtimes.executorch.MethodRunner's calling shape (inputs and
    outputs in the method's signature order)."""

    order = "method"

    def __init__(self, session: InProcessSession, method: str):
        self.session, self.method = session, method

    def run(self, inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        return self.session.call(self.method, inputs)
