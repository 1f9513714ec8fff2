"""Lowering for a GPU other than the one lowering runs on (``lowering.target``, ``python -m zoo lower --target``).

Why and how: docs/ARCHITECTURE.md, "Lowering for another GPU".
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, Mapping, Optional

import torch

from zoo.core.environ import environ_restored
from zoo.core.errors import GpuTargetMismatch, LoweringError
from zoo.contract.gpu_targets import DOCS, Device, gpu, read_targets

NATIVE, PTX = "native", "ptx"
BUNDLE_COMMAND = "python -m zoo bundle BUNDLE --platform manylinux_2_28_aarch64 --python 3.10 --have torch"


@dataclass(frozen=True)
class TargetPlan:
    """How a lowering meets its target: ``native`` (this GPU's architecture) or ``ptx`` (an older one, see the
    module's docstring)."""

    name: Optional[str]  # the target's name in gpu_targets.GPUS; None: this machine's GPU
    label: str
    arch: int  # 80 for sm_80
    machine: str
    tegra: bool
    shared_memory: int  # bytes a block may use on the target; 0: this GPU's limit
    mode: str
    lowered_on: str  # this GPU, "NVIDIA H200 (sm_90)"

    @property
    def capability(self) -> str:
        return f"{self.arch // 10}{self.arch % 10}"

    def record(self) -> Dict[str, Any]:
        """What the lowering report and the manifest keep (``lowering.gpu.target``)."""
        return {**asdict(self), "capability": self.capability}

    def words(self) -> str:
        how = ("the architecture of this GPU" if self.mode == NATIVE
               else f"sm_{self.arch} SASS + compute_{self.arch} PTX, run here through the driver's JIT")
        return f"for {self.name} ({self.label}, sm_{self.arch}): {how}"


def local_device() -> Device:
    major, minor = torch.cuda.get_device_capability()
    return Device(torch.cuda.get_device_name(), (major, minor), platform.machine())


def plan_target(name: Optional[str], local: Device) -> Optional[TargetPlan]:
    """The plan for lowering on ``local`` for the GPU named ``name`` (None: no target asked, no plan); a target
    this machine cannot lower for is refused (``GpuTargetMismatch``) with where to lower it instead."""
    if name is None:
        return None
    target = gpu(name)
    here = f"{local.name} (sm_{local.arch}, host {local.machine})"
    what = f"lowering for {target.name} ({target.label}, sm_{target.arch}, host {target.machine}) on {here}"
    if target.machine != local.machine:
        hint = (f"lower on the {target.label} itself: on a connected machine `{BUNDLE_COMMAND}`, copy BUNDLE and the "
                f"run folder over, install it and run `python -m zoo lower RUN_DIR` there ({DOCS})"
                if target.tegra else f"lower on a machine with a {target.machine} host and that GPU ({DOCS})")
        raise GpuTargetMismatch(f"{what} is not possible: AOTInductor compiles each method's .so as host code for "
                                f"the machine it runs on, and torch cross-compiles to Windows only", hint)
    mode = NATIVE if target.arch == local.arch else PTX
    if mode == PTX and target.arch >= 90:
        raise GpuTargetMismatch(f"{what} is not possible: Triton writes arch-specific sm_{target.arch}a code for "
                                "GPUs of 9.0 and newer, which only that architecture runs, and Inductor runs "
                                "every kernel it compiles", f"lower on a {target.label} ({DOCS})")
    if mode == PTX and target.arch > local.arch:
        raise GpuTargetMismatch(f"{what} is not possible: Inductor runs every kernel it compiles, and this GPU "
                                f"cannot run code for the newer sm_{target.arch}",
                                f"lower on a {target.label}, or on a GPU newer than it ({DOCS})")
    return TargetPlan(name=target.name, label=target.label, arch=target.arch, machine=target.machine,
                      tegra=target.tegra, shared_memory=target.shared_memory, mode=mode,
                      lowered_on=f"{local.name} (sm_{local.arch})")


def check_lowered(plan: Optional[TargetPlan], sos: Mapping[str, Path]) -> Dict[str, Any]:
    """Read every method's .so back and fail (``LoweringError``) unless all its kernels carry SASS the target
    runs as is; returns the kernel images per method."""
    if plan is None:
        return {}
    found: Dict[str, Any] = {}
    for method, so in sos.items():
        read = read_targets(so, what=f"the .so of method {method!r}")
        verdict = read.verdict(plan.arch, plan.tegra)
        if read.machine != plan.machine or not verdict.ok or verdict.how != "sass":
            raise LoweringError(f"asked to lower for {plan.name} (sm_{plan.arch}), but the .so of method {method!r} "
                                f"holds {read.text()}: the target settings did not take",
                                "report this with the lowering log; lower on the target GPU itself meanwhile")
        found[method] = read.images()
    return found


# --- inside each method's lowering ------------------------------------------------------------------------------


class _TargetProperties:
    """``torch.cuda.get_device_properties`` of this GPU, answering for the target where Inductor asks."""

    def __init__(self, real: Any, plan: Mapping[str, Any]):
        self._real = real
        self.major, self.minor = divmod(plan["arch"], 10)
        self.name = plan["label"]
        if plan.get("shared_memory"):
            self.shared_memory_per_block_optin = plan["shared_memory"]

    def __getattr__(self, key: str) -> Any:
        return getattr(self._real, key)


def ptx_fatbin(ptx: str, arch: int, nvcc: str) -> bytes:
    """``ptx`` as a fatbin of ``sm_<arch>`` SASS and ``compute_<arch>`` PTX, made by AOTInductor's own command."""
    with tempfile.TemporaryDirectory(prefix="zoo-target-") as work:
        src, out = Path(work) / "kernel.ptx", Path(work) / "kernel.fatbin"
        src.write_text(ptx)
        done = subprocess.run([nvcc, "-fatbin", str(src), "-o", str(out),
                               "-gencode", f"arch=compute_{arch},code=compute_{arch}",
                               "-gencode", f"arch=compute_{arch},code=sm_{arch}"], capture_output=True, text=True)
        if done.returncode != 0:
            raise LoweringError(f"{nvcc} -fatbin for sm_{arch} failed: {done.stderr.strip()[:400]}",
                                "AOTInductor's multi-arch kernels need nvcc (CUDA_HOME or CUDACXX names it)")
        return out.read_bytes()


def stages_hook(arch: int, shared_memory: int, nvcc: str):
    """A Triton ``add_stages_inspection_hook``: the cubin stage returns the fatbin of ``ptx_fatbin`` (this GPU
    loads it through the driver's JIT), after Triton's own ptxas run for the target; a kernel needing more
    shared memory than ``shared_memory`` is out of resources (Inductor then drops that config)."""
    from triton.runtime.errors import OutOfResources

    def hook(*args: Any) -> None:
        stages = next(a for a in args if isinstance(a, dict))
        make_cubin = stages["cubin"]

        def cubin(src: str, metadata: Dict[str, Any]) -> bytes:
            make_cubin(src, metadata)  # ptxas for the target: Triton's own checks and errors
            if shared_memory and (metadata.get("shared") or 0) > shared_memory:
                raise OutOfResources(metadata["shared"], shared_memory, "shared memory")
            return ptx_fatbin(src, arch, nvcc)

        stages["cubin"] = cubin

    return hook


@contextlib.contextmanager
def target_compile(plan: Optional[Mapping[str, Any]]) -> Iterator[None]:
    """The compile settings of a ``ptx`` plan (``TargetPlan.record()``) for the block; nothing for another.
    Entered inside ``compile_settings.inductor_settings`` (its cache folder gets a subfolder per target)."""
    if not plan or plan.get("mode") != PTX:
        yield
        return
    import torch._inductor.config as inductor_config
    from torch._inductor.codegen.cuda import compile_utils, cuda_env
    from torch._inductor.runtime.hints import DeviceProperties
    from triton import knobs

    capability = divmod(plan["arch"], 10)
    cache = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or tempfile.gettempdir()) / f"target-{plan['name']}"
    env = {"TORCHINDUCTOR_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(cache / "triton")}
    real_capability, real_properties = torch.cuda.get_device_capability, torch.cuda.get_device_properties
    previous_hook = knobs.runtime.add_stages_inspection_hook
    patch = {"cuda.arch": str(plan["arch"]), "compile_threads": 1, "use_static_cuda_launcher": False}

    def clear_caches() -> None:  # both remember the GPU they first saw
        DeviceProperties.create.cache_clear()
        cuda_env.get_cuda_arch.cache_clear()

    with environ_restored(env), inductor_config.patch(patch):
        os.environ.update(env)
        try:
            torch.cuda.get_device_capability = lambda device=None: capability
            torch.cuda.get_device_properties = lambda device=None: _TargetProperties(real_properties(device), plan)
            clear_caches()
            knobs.runtime.add_stages_inspection_hook = stages_hook(plan["arch"], plan.get("shared_memory") or 0,
                                                                   compile_utils._cuda_compiler() or "nvcc")
            yield
        finally:
            knobs.runtime.add_stages_inspection_hook = previous_hook
            torch.cuda.get_device_capability, torch.cuda.get_device_properties = real_capability, real_properties
            clear_caches()
