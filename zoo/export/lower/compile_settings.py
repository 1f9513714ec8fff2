"""What a method's compile runs under: the GPU it needs, Inductor's settings (persistent cache, capped and pruned
GEMM search, the compile workers' ptxas) and how ExecuTorch serialises a lowered method (graph inputs and outputs
left out of memory planning). docs/ARCHITECTURE.md ("Lowering") and docs/benchmarks.md say why each is set.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

import torch

from zoo.contract.releases import gemm_features
from zoo.core.environ import environ_restored
from zoo.core.errors import NoGpuError

DEFAULT_INDUCTOR_CACHE = Path.home() / ".cache" / "zoo" / "inductor"


def cuda_device_info() -> Dict[str, Any]:
    """Name and compute capability of the GPU lowering runs on; ``NoGpuError`` without one."""
    if not torch.cuda.is_available():
        raise NoGpuError(
            "lowering to an ExecuTorch CUDA .pte needs a CUDA device: Inductor compiles and autotunes its kernels "
            "on the GPU, and none is visible here",
            "run `python -m zoo lower RUN_DIR` on a machine with an NVIDIA GPU (the run folder holds everything it "
            "needs); export, rewrites and the CPU check already ran here",
        )
    major, minor = torch.cuda.get_device_capability()
    return {"name": torch.cuda.get_device_name(), "capability": f"{major}{minor}",
            "torch": torch.__version__, "cuda": torch.version.cuda}


def inductor_cache_dir() -> Path:
    return Path(os.environ.get("ZOO_INDUCTOR_CACHE") or DEFAULT_INDUCTOR_CACHE)


def lowering_ptxas() -> Optional[str]:
    """The ptxas the lowering gives Triton: the operator's ``TRITON_PTXAS_PATH``, else torch's own ``bin/ptxas``,
    the one Inductor's compile workers use (``inductor_settings`` says why); None where torch ships none."""
    if os.environ.get("TRITON_PTXAS_PATH"):
        return os.environ["TRITON_PTXAS_PATH"]
    path = Path(torch.__file__).resolve().parent / "bin" / "ptxas"
    return str(path) if path.is_file() and os.access(path, os.X_OK) else None


@contextlib.contextmanager
def inductor_settings(max_mm_configs: Optional[int]) -> Iterator[Dict[str, Any]]:
    """Inductor settings for the compile: persistent cache, shared-memory pruning, capped GEMM search, and the
    ptxas of Inductor's compile workers for this process too.

    Why the ptxas: Inductor's compile workers use torch's ``bin/ptxas`` and this process, left alone, Triton's
    own; Triton's cache key holds the ptxas version, so every autotuning choice the pool compiled would be
    compiled again here, one after another (docs/benchmarks.md, "The ptxas fix"). Set before the process's
    first Triton compile (Triton caches the version); an operator's own ``TRITON_PTXAS_PATH`` is kept.

    Environment variables are restored afterwards; the shared-memory option is read into Inductor's config at
    import, so it is patched there too.
    """
    import torch._inductor.config as inductor_config

    env = {
        "TORCHINDUCTOR_MAX_AUTOTUNE_PRUNE_CHOICES_BASED_ON_SHARED_MEM": "1",
        "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(inductor_cache_dir()),
    }
    ptxas = lowering_ptxas()
    if ptxas:
        env["TRITON_PTXAS_PATH"] = ptxas
    Path(env["TORCHINDUCTOR_CACHE_DIR"]).mkdir(parents=True, exist_ok=True)
    patch = {"max_autotune_prune_choices_based_on_shared_mem": True,
             "test_configs.max_mm_configs": max_mm_configs}
    with environ_restored(env), inductor_config.patch(patch):
        os.environ.update(env)
        yield {"inductor_cache_dir": env["TORCHINDUCTOR_CACHE_DIR"], "max_mm_configs": max_mm_configs,
               "prune_choices_based_on_shared_mem": True, "triton_ptxas": ptxas}


@contextlib.contextmanager
def gemm_backends(gemm: str) -> Iterator[Dict[str, Any]]:
    """Who computes the GEMMs (recipe ``lowering.gemm``). ``triton``: ExecuTorch's CUDA backend as it is, Triton
    templates only. ``cublas``/``autotune``: Inductor's ATen GEMMs (only, or timed against the templates per
    GEMM), which the .so calls through ``aoti_torch_cuda_{mm,addmm,bmm,baddbmm}_out``: the backend is told these
    shims exist (zoo's runtime build adds them, runtime/cpp/cublas_gemm.cu). Inductor's cuBLASLt bias variant of
    addmm is left out: it has no C shim for a .so to call."""
    if gemm == "triton":
        yield {"gemm": gemm}
        return
    from unittest import mock

    import torch._inductor.config as inductor_config
    from executorch.backends.cuda.cuda_backend import CudaBackend

    kernels = sorted(k for feature in gemm_features(gemm) for k in feature.fallback_kernels)
    backends = "ATEN" if gemm == "cublas" else "ATEN,TRITON"
    compile_options = CudaBackend.get_aoti_compile_options.__func__
    fallback_kernels = CudaBackend.get_supported_fallback_kernels.__func__

    def with_aten_gemms(cls, compile_specs):
        return {**compile_options(cls, compile_specs), "max_autotune_gemm_backends": backends}

    def with_gemm_shims(cls):
        return {**fallback_kernels(cls), **{kernel: None for kernel in kernels}}

    with mock.patch.object(CudaBackend, "get_aoti_compile_options", classmethod(with_aten_gemms)), \
            mock.patch.object(CudaBackend, "get_supported_fallback_kernels", classmethod(with_gemm_shims)), \
            inductor_config.patch({"triton.autotune_cublasLt": False}):
        yield {"gemm": gemm, "max_autotune_gemm_backends": backends, "shims": kernels}


def executorch_config() -> Any:
    """How a lowered method is serialised: its graph inputs and outputs get no planned memory, so a GPU pointer
    can be bound to any input and outputs stay where the CUDA backend leaves them (docs/runtime.md, "State on
    the GPU"); everything else is ExecuTorch's default."""
    from executorch.exir import ExecutorchBackendConfig
    from executorch.exir.passes import MemoryPlanningPass

    return ExecutorchBackendConfig(
        memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False, alloc_graph_output=False))


def executorch_version() -> str:
    """The installed ExecuTorch's version, as the lowering records it ("unknown" where none is installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("executorch")
    except PackageNotFoundError:
        return "unknown"
