"""On a CUDA machine: the GPU targets of real lowerings of llama-rope-tiny, read from the binary, and lowering for
an older GPU (``lowering.target=a100``) verified here through the driver's JIT compile of its PTX.

The recipe is exported once (the CPU steps), copied, and each copy lowered: for this GPU and for the A100.
``ZOO_TARGET_RUNS=DIR`` reuses DIR/native and DIR/a100 where they hold lowered runs (what
``scripts/gpu_targets_check.py --out DIR`` leaves), so that script's --tests does not lower them twice.
References: cuobjdump (the copy Triton ships) on every fatbin in each method's .so; this GPU's compute capability
from torch; ``platform.machine()`` for the host; eager PyTorch for verification (the pipeline's own stage).
"""

from __future__ import annotations

import os
import platform
import shutil
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from zoo.contract import gpu_targets
from zoo.export import pipeline  # noqa: E402
from zoo.core.errors import GpuTargetMismatch  # noqa: E402
from zoo.contract.recipes import load_recipe  # noqa: E402
from zoo.contract.run_folder import RunFolder  # noqa: E402

from support.run_export import export_run  # noqa: E402
from support.gpu_kernels import _cuobjdump, _cuobjdump_images

_CAPABILITY = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
ARCH = _CAPABILITY[0] * 10 + _CAPABILITY[1]
# Triton writes arch-specific code from 9.0 on (sm_arch_from_capability), AOTInductor's nvcc step likewise.
VARIANT = "a" if ARCH >= 90 else ""


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``make(name, overrides)``: llama-rope-tiny lowered as ``name`` (a reused run, or the CPU steps' output,
    made once, copied and lowered here)."""
    work = tmp_path_factory.mktemp("targets")
    given = os.environ.get("ZOO_TARGET_RUNS")

    def make(name: str, overrides=()) -> RunFolder:
        if given and RunFolder(Path(given) / name).pte.is_file():
            return RunFolder(Path(given) / name)
        source = work / "exported"
        if not source.is_dir():
            export_run(load_recipe("llama-rope-tiny"), source)
        run = work / name
        if not RunFolder(run).pte.is_file():
            shutil.copytree(source, run)
            report = pipeline.lower_run(run, list(overrides))
            assert report.get("status") == "verified", report.get("error")
        return RunFolder(run)

    return make


def lowered(exported, name: str, overrides=()) -> RunFolder:
    return exported(name, overrides)


def cuobjdump_check(run: RunFolder, tmp_path: Path) -> list:
    """Every fatbin of every method's .so, carved out and described by cuobjdump; returns their (kind, arch)."""
    tool = _cuobjdump()
    if not tool:
        pytest.skip("no cuobjdump")
    seen = []
    for method, so in run.compiled_methods().items():
        data = so.read_bytes()
        found = gpu_targets.find_fatbins(data)
        assert found, f"{method}: no kernel image in its .so"
        for offset, images in found:
            _, end = gpu_targets.parse_fatbin(data, offset)
            carved = tmp_path / f"{method}-{offset}.fatbin"
            carved.write_bytes(data[offset:end])
            described = _cuobjdump_images(tool, carved)
            assert [(i.kind, f"{i.arch}{i.variant}") for i in images] == described
            seen += described
    return sorted(set(seen))


def test_this_gpus_lowering_holds_its_own_architecture_and_host(exported, tmp_path):
    run = lowered(exported, "native")
    audit = run.read_report().data["audit"]
    for method in audit["methods"]:
        assert method["targets"]["images"] == [f"sm_{ARCH}{VARIANT}", f"compute_{ARCH}{VARIANT}"]
        assert method["targets"]["machine"] == platform.machine()
    assert cuobjdump_check(run, tmp_path) == [("ptx", f"{ARCH}{VARIANT}"), ("sass", f"{ARCH}{VARIANT}")]
    print(gpu_targets.runs_on_lines(audit["gpus"]))


@pytest.mark.skipif(ARCH <= 80 or ARCH >= 100, reason="the A100 plan needs a GPU newer than sm_80 that runs its PTX")
def test_an_a100_lowering_here_holds_sm_80_and_is_verified_through_the_jit(exported, tmp_path):
    run = lowered(exported, "a100", ["lowering.target=a100"])
    report = run.read_report().data
    assert report["lowering"]["gpu"]["target"]["mode"] == "ptx"
    assert [m["targets"]["images"] for m in report["audit"]["methods"]] == [["sm_80", "compute_80"]]
    assert cuobjdump_check(run, tmp_path) == [("ptx", "80"), ("sass", "80")]
    # verified on this GPU, which has no sm_80 SASS to run: the driver compiled the PTX
    assert report["audit"]["gpus"]["a100"]["how"] == "sass"
    here = gpu_targets.read_targets(next(iter(run.compiled_methods().values())))
    assert here.verdict(ARCH, False).how == "ptx"
    assert report["verification"]["rows"] and all(r["ok"] for r in report["verification"]["rows"])


def test_this_gpus_artifact_is_refused_on_an_a100_before_loading(exported, monkeypatch):
    if ARCH == 80:
        pytest.skip("this is an A100")
    run = lowered(exported, "native")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    from zoo.runner.backends import make_backend

    with pytest.raises(GpuTargetMismatch, match=f"sm_{ARCH}{VARIANT}/compute_{ARCH}{VARIANT}") as info:
        make_backend("artifact", run, "cuda")  # llama has no action loop: the runner's backend itself
    assert "--target a100" in info.value.hint


def test_an_orin_target_is_refused_here_and_the_run_is_unchanged(exported):
    if platform.machine() == "aarch64":
        pytest.skip("an aarch64 host may lower for an Orin")
    run = lowered(exported, "native")
    before = run.pte.read_bytes()
    with pytest.raises(GpuTargetMismatch, match="lowering for orin"):
        pipeline.lower_run(run.path, ["lowering.target=orin"])
    assert run.pte.read_bytes() == before
