"""Lowering for another GPU (zoo.export.lower.target): which targets a machine can lower for, the Triton stage that
makes each kernel a fatbin of the target's SASS and PTX (compiled here for a GPU that is not present: Triton needs
none), the compile settings a method's lowering runs under, and the read-back of what was lowered.

References: the compatibility rules (hand-worked in tests/test_gpu_targets.py), cuobjdump on the fatbin the stage
returns, Triton's own PTX text (``.target sm_80``), and the kernel fixtures (tests/fixtures/so).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from support.gpu_kernels import A100, H200, _cuobjdump, _cuobjdump_images
from zoo.contract import gpu_targets
from zoo.export.lower import compile_settings, lowering
from zoo.export.lower import target as lowering_target
from zoo.core.errors import GpuTargetMismatch, LoweringError, RecipeError
from zoo.contract.gpu_targets import Device
from zoo.contract.recipes import load_recipe

H200_HOST = Device("NVIDIA H200", (9, 0), "x86_64")
GH200_HOST = Device("NVIDIA GH200 480GB", (9, 0), "aarch64")


@pytest.mark.parametrize("target, mode", [("h200", "native"), ("h100", "native"), ("a100", "ptx"),
                                          ("a10g", "ptx"), ("rtx4090", "ptx"), ("t4", "ptx")])
def test_what_an_h200_lowers_for(target, mode):
    plan = lowering_target.plan_target(target, H200_HOST)
    assert plan.mode == mode and plan.arch == gpu_targets.GPUS[target].arch
    assert plan.lowered_on == "NVIDIA H200 (sm_90)"


def test_no_target_is_no_plan():
    assert lowering_target.plan_target(None, H200_HOST) is None


def test_a_jetson_target_on_an_x86_64_machine_is_refused_with_the_offline_bundle():
    with pytest.raises(GpuTargetMismatch, match="host code for the machine it runs on") as info:
        lowering_target.plan_target("orin", H200_HOST)
    assert "--platform manylinux_2_28_aarch64 --python 3.10 --have torch" in info.value.hint
    assert "`python -m zoo lower RUN_DIR` there" in info.value.hint


@pytest.mark.parametrize("target, local, why", [
    ("b200", H200_HOST, "arch-specific sm_100a"),  # 9.0 and newer: Triton's "a" code runs on its own GPU only
    ("gh200", H200_HOST, "host code"),  # an aarch64 host
    ("a100", GH200_HOST, "host code"),  # the table's A100 has an x86-64 host
    ("l4", Device("NVIDIA A100", (8, 0), "x86_64"), "cannot run code for the newer sm_89"),
])
def test_targets_a_machine_cannot_lower_for(target, local, why):
    with pytest.raises(GpuTargetMismatch, match=why):
        lowering_target.plan_target(target, local)


def test_an_orin_from_a_grace_hopper_host_is_the_ptx_plan():
    # aarch64 like the Orin, and sm_87 < 9.0: its compute_87 PTX runs on the GH200 through the JIT (not tested on one)
    plan = lowering_target.plan_target("orin", GH200_HOST)
    assert (plan.mode, plan.arch, plan.tegra, plan.machine) == ("ptx", 87, True, "aarch64")


def test_the_recipe_takes_a_target_by_name_and_refuses_an_unknown_one():
    assert load_recipe("llama-rope-tiny", ["lowering.target=A100"]).lowering.target == "a100"
    with pytest.raises(RecipeError, match="lowering.target='a200' is not allowed"):
        load_recipe("llama-rope-tiny", ["lowering.target=a200"])


def test_lowering_refuses_an_orin_target_before_compiling(monkeypatch, tmp_path):
    # The device queries stubbed: this machine is an H200 box.
    monkeypatch.setattr(compile_settings, "cuda_device_info", lambda: {"name": "NVIDIA H200", "capability": "90"})
    monkeypatch.setattr(lowering, "local_device", lambda: H200_HOST)
    monkeypatch.setattr(lowering, "ensure_flatc", lambda: pytest.fail("got past the target check"))
    recipe = load_recipe("llama-rope-tiny", ["lowering.target=orin"])
    with pytest.raises(GpuTargetMismatch, match="lowering for orin"):
        lowering.lower_to_pte({"forward": tmp_path / "rewritten.forward.pt2"}, tmp_path / "run", recipe)


def test_what_was_lowered_is_read_back_from_the_binary():
    plan = lowering_target.plan_target("a100", H200_HOST)
    assert lowering_target.check_lowered(plan, {"forward": A100}) == {"forward": ["sm_80", "compute_80"]}
    with pytest.raises(LoweringError, match="holds sm_90a/compute_90a .* the target settings did not take"):
        lowering_target.check_lowered(plan, {"forward": H200})
    assert lowering_target.check_lowered(None, {"forward": H200}) == {}


def _nvcc() -> str:
    for candidate in (os.environ.get("CUDACXX"), shutil.which("nvcc"),
                      os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc"),
                      *sorted(map(str, Path("/usr/local").glob("cuda*/bin/nvcc")))):
        if candidate and os.path.isfile(candidate):
            return candidate
    return ""


def _compile_for_a100(hook, tmp_path, monkeypatch):
    triton = pytest.importorskip("triton")
    import triton.language as tl
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def row_sum(x_ptr, y_ptr, BLOCK: tl.constexpr):  # a reduction: it uses shared memory
        i = tl.arange(0, BLOCK)
        tl.store(y_ptr, tl.sum(tl.load(x_ptr + i), axis=0))

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setattr(knobs.runtime, "add_stages_inspection_hook", hook)
    src = ASTSource(row_sum, {"x_ptr": "*fp32", "y_ptr": "*fp32", "BLOCK": "constexpr"}, {"BLOCK": 1024})
    return triton.compile(src, target=GPUTarget("cuda", 80, 32))


def test_the_stage_hook_makes_each_kernel_a_fatbin_of_the_target_sass_and_ptx(tmp_path, monkeypatch):
    nvcc = _nvcc()
    if not nvcc:
        pytest.skip("no nvcc (AOTInductor's multi-arch kernels need one too)")
    compiled = _compile_for_a100(lowering_target.stages_hook(80, 163 * 1024, nvcc), tmp_path, monkeypatch)
    assert ".target sm_80" in compiled.asm["ptx"]  # Triton's own PTX for the target
    fatbin = compiled.asm["cubin"]
    found = gpu_targets.find_fatbins(fatbin)
    assert [[i.name for i in images] for _, images in found] == [["sm_80", "compute_80"]]
    tool = _cuobjdump()
    if tool:
        (tmp_path / "kernel.fatbin").write_bytes(fatbin)
        assert sorted(_cuobjdump_images(tool, tmp_path / "kernel.fatbin")) == [("ptx", "80"), ("sass", "80")]


def test_the_stage_hook_drops_a_kernel_over_the_target_shared_memory(tmp_path, monkeypatch):
    from triton.runtime.errors import OutOfResources

    nvcc = _nvcc()
    if not nvcc:
        pytest.skip("no nvcc")
    with pytest.raises(OutOfResources, match="shared memory"):
        _compile_for_a100(lowering_target.stages_hook(80, 8, nvcc), tmp_path, monkeypatch)


def test_the_compile_settings_of_a_ptx_plan_hold_for_the_block_only(monkeypatch, tmp_path):
    import torch._inductor.config as inductor_config
    from triton import knobs

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    triton_cache = os.environ.get("TRITON_CACHE_DIR")
    before = (torch.cuda.get_device_capability, torch.cuda.get_device_properties, inductor_config.cuda.arch,
              inductor_config.compile_threads, knobs.runtime.add_stages_inspection_hook)
    plan = lowering_target.plan_target("a100", H200_HOST).record()
    with lowering_target.target_compile(plan):
        assert torch.cuda.get_device_capability(0) == (8, 0)
        assert inductor_config.cuda.arch == "80" and inductor_config.compile_threads == 1
        assert knobs.runtime.add_stages_inspection_hook is not None
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor" / "target-a100")
        assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "inductor" / "target-a100" / "triton")
    assert (torch.cuda.get_device_capability, torch.cuda.get_device_properties, inductor_config.cuda.arch,
            inductor_config.compile_threads, knobs.runtime.add_stages_inspection_hook) == before
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    assert os.environ.get("TRITON_CACHE_DIR") == triton_cache
    native = lowering_target.plan_target("h100", H200_HOST).record()
    with lowering_target.target_compile(native):  # this GPU's architecture: nothing changes
        assert torch.cuda.get_device_capability is before[0]
