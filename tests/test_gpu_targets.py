"""What GPUs and hosts can run a compiled method, read from its .so (zoo.contract.gpu_targets), and the check every loader
makes before loading.

References, none of them zoo's own output:
- tests/fixtures/so/h200_kernels.so and a100_kernels.so, built with AOTInductor's own fatbin commands
  (build_kernel_fixtures.py), read by hand: ``readelf -S`` puts .rodata at file offset 0x2000, and ``xxd`` shows the
  fatbin magic 50 ed 55 ba there (and at 0x3998 in h200_kernels.so, at 0x37b0 in a100_kernels.so), then the
  entries listed in HAND_READ; ``file`` says x86-64;
- cuobjdump (the copy Triton ships) on the fatbin carved out at those hand-read offsets;
- fatbins packed here field by field, with kinds, architectures and flags chosen by hand;
- NVIDIA's compatibility rules as hand-worked cases.
"""

from __future__ import annotations

import platform
import struct

import pytest

from zoo.contract import gpu_targets
from zoo.contract.host_settings import NoHostSettings
from zoo.core.errors import GpuTargetMismatch, LoweringError, RecipeError
from zoo.contract.gpu_targets import Device, KernelImage

from support.gpu_kernels import A100, FIXTURES, H200, _cuobjdump, _cuobjdump_images, container, entry
# (file, offset, bytes as xxd shows them): the hand reading the expectations below rest on.
HAND_READ = [
    (H200, 0x2000, "50ed55ba 0100 1000 8819000000000000"),  # magic, version 1, header 16, entries 0x1988 bytes
    (H200, 0x2010, "0200 0101 40000000 4816000000000000"),  # kind 2 (SASS), header 0x40, payload 0x1648
    (H200, 0x202c, "5a000000"),  # architecture 90
    (H200, 0x2038, "1100100000000000"),  # flags 0x100011: 64-bit, Linux, arch-specific ("a")
    (H200, 0x3698, "0100 0101 50000000 b002000000000000"),  # kind 1 (PTX), header 0x50, payload 0x2b0
    (H200, 0x36b0, "0700 0800 5a000000"),  # PTX ISA 8.7, architecture 90
    (H200, 0x36c0, "1180100000000000"),  # flags 0x108011: zstd-compressed, arch-specific
    (H200, 0x3998, "50ed55ba 0100 1000"),  # the second kernel's fatbin, right after the first
    (A100, 0x2000, "50ed55ba 0100 1000 a017000000000000"),
    (A100, 0x202c, "50000000"),  # architecture 80
    (A100, 0x2038, "1100000000000000"),  # flags 0x11: no variant
    (A100, 0x37b0, "50ed55ba 0100 1000"),
]
ELF_MACHINE_OFFSET = 18  # e_machine, u16, in every ELF header


def test_the_fixtures_hold_the_bytes_read_by_hand():
    for path, offset, hexdump in HAND_READ:
        want = bytes.fromhex(hexdump.replace(" ", ""))
        assert path.read_bytes()[offset:offset + len(want)] == want, (path.name, hex(offset))


def test_the_kernels_of_an_h200_lowering_are_sm_90a_and_compute_90a_for_an_x86_64_host():
    read = gpu_targets.read_targets(H200)
    assert read.machine == "x86_64"
    assert [offset for offset, _ in gpu_targets.find_fatbins(H200.read_bytes())] == [0x2000, 0x3998]
    assert read.sections == [".rodata"]
    assert [[i.name for i in f] for f in read.fatbins] == [["sm_90a", "compute_90a"]] * 2
    assert read.images() == ["sm_90a", "compute_90a"]
    assert read.ptx_isa() == (8, 7)
    assert [i.compressed for i in read.fatbins[0]] == [False, True]
    a100 = gpu_targets.read_targets(A100)
    assert a100.images() == ["sm_80", "compute_80"] and a100.machine == "x86_64"






@pytest.mark.parametrize("so, start, end", [(H200, 0x2000, 0x3998), (A100, 0x2000, 0x37b0)])
def test_each_fatbin_carved_at_the_hand_read_offsets_is_what_cuobjdump_says(so, start, end, tmp_path):
    tool = _cuobjdump()
    if not tool:
        pytest.skip("no cuobjdump (Triton ships one; a CUDA toolkit has one)")
    carved = tmp_path / "kernel.fatbin"
    carved.write_bytes(so.read_bytes()[start:end])
    want = _cuobjdump_images(tool, carved)
    images, stop = gpu_targets.parse_fatbin(so.read_bytes(), start)
    assert stop == end
    assert [(i.kind, f"{i.arch}{i.variant}") for i in images] == want
    assert want  # cuobjdump saw the kernel






def test_hand_packed_fatbins_give_their_kinds_architectures_and_variants():
    blob = (b"junk" + struct.pack("<I", 0xBA55ED50) + b"\xff" * 12  # a magic with a broken header: not a fatbin
            + container(entry(2, 87), entry(1, 80, flags=0x8011, header=80, code=(8, 5)))
            + b"\0" * 3
            + container(entry(2, 100, flags=0x1200011, header=112), entry(1, 120, flags=0x100011))
            + container(entry(3, 80)))  # kind 3 is neither PTX nor SASS: not read as a fatbin
    found = gpu_targets.find_fatbins(blob)
    assert [[(i.name, i.compressed) for i in images] for _, images in found] == [
        [("sm_87", False), ("compute_80", True)], [("sm_100f", False), ("compute_120a", False)]]
    assert found[0][1][1].code_version == (8, 5)
    # entries that do not fill the declared size exactly are not a fatbin
    short = bytearray(container(entry(2, 80)))
    struct.pack_into("<Q", short, 8, len(short))  # claims 16 bytes more than there are
    assert gpu_targets.find_fatbins(bytes(short)) == []


# Hand-worked cases of NVIDIA's rules: (image, GPU architecture, Tegra GPU, runs).
RULES = [
    (KernelImage("sass", 80), 86, False, True),  # same major, newer minor
    (KernelImage("sass", 80), 90, False, False),  # never across major versions
    (KernelImage("sass", 86), 80, False, False),  # not on an older minor
    (KernelImage("sass", 80), 87, True, False),  # desktop SASS does not run on Orin
    (KernelImage("sass", 87), 89, False, False),  # Orin SASS does not run on a desktop 8.9
    (KernelImage("sass", 87), 87, True, True),
    (KernelImage("ptx", 80), 87, True, True),  # PTX JITs on Orin
    (KernelImage("ptx", 80), 120, False, True),
    (KernelImage("ptx", 90), 89, False, False),  # not on an older GPU
    (KernelImage("ptx", 90, "a"), 100, False, False),  # arch-specific PTX: 9.0 only
    (KernelImage("sass", 90, "a"), 90, False, True),
    (KernelImage("sass", 100, "f"), 103, False, True),  # family: 10.x, minor >= 0
    (KernelImage("sass", 100, "f"), 120, False, False),
    (KernelImage("ptx", 100, "f"), 110, True, False),
    (KernelImage("sass", 110), 110, True, True),  # Thor on Thor
]


@pytest.mark.parametrize("image, arch, tegra, runs", RULES)
def test_compatibility_rules(image, arch, tegra, runs):
    assert image.runs_on(arch, tegra) is runs


def test_which_gpus_of_the_table_run_an_h200_and_an_a100_lowering():
    h200, a100 = gpu_targets.read_targets(H200), gpu_targets.read_targets(A100)
    # sm_90a/compute_90a: 9.0 only, and only with an x86-64 host (GH200's host is aarch64)
    assert h200.gpus() == ["h100", "h200"]
    assert a100.gpus() == ["a100", "a10", "a10g", "rtx3090", "l4", "l40s", "rtx4090", "h100", "h200", "b200",
                           "rtx5090"]
    assert a100.runs_on(gpu_targets.GPUS["a100"]).how == "sass"
    jit = a100.runs_on(gpu_targets.GPUS["h200"])
    assert jit.how == "ptx" and "CUDA 12.8" in jit.why  # PTX ISA 8.7
    orin = a100.runs_on(gpu_targets.GPUS["orin"])
    assert not orin.ok and "x86_64 host code" in orin.why


def test_gpu_names_and_an_unknown_one():
    assert gpu_targets.gpu("A100").capability == (8, 0)
    assert gpu_targets.gpu("orin").machine == "aarch64" and gpu_targets.gpu("orin").tegra
    with pytest.raises(RecipeError, match="unknown GPU target 'a200'") as info:
        gpu_targets.gpu("a200")
    assert "h200" in info.value.hint


def test_an_aarch64_library_is_read_as_aarch64(tmp_path):
    data = bytearray((FIXTURES / "clean.so").read_bytes())
    struct.pack_into("<H", data, ELF_MACHINE_OFFSET, 183)  # EM_AARCH64 (the ELF specification's number)
    assert gpu_targets.read_targets(bytes(data)).machine == "aarch64"
    with pytest.raises(LoweringError, match="not an ELF"):
        gpu_targets.read_targets(b"not an elf file")


A100_DEVICE = Device("NVIDIA A100-SXM4-80GB", (8, 0), "x86_64")
H200_DEVICE = Device("NVIDIA H200", (9, 0), "x86_64")
ORIN_DEVICE = Device("Orin", (8, 7), "aarch64")


def test_an_h200_artifact_is_refused_on_an_a100_with_the_command_that_fixes_it():
    with pytest.raises(GpuTargetMismatch) as info:
        gpu_targets.require_runs_on({"forward": H200}, A100_DEVICE, run_dir="runs/llama-rope-tiny")
    message, hint = info.value.message, info.value.hint
    assert "sm_90a/compute_90a" in message and "h100, h200" in message and "sm_80 (NVIDIA A100" in message
    assert "`python -m zoo lower runs/llama-rope-tiny --target a100`" in hint
    assert gpu_targets.require_runs_on({"forward": H200}, H200_DEVICE)["forward"].images() == ["sm_90a",
                                                                                             "compute_90a"]
    assert gpu_targets.require_runs_on({"forward": A100}, H200_DEVICE)["forward"].runs_on(H200_DEVICE).how == "ptx"


def test_an_x86_64_artifact_is_refused_on_a_jetson_with_the_offline_bundle_in_the_hint():
    with pytest.raises(GpuTargetMismatch, match="x86_64 host code; this machine is aarch64") as info:
        gpu_targets.require_runs_on({"forward": A100}, ORIN_DEVICE)
    assert "Jetson itself" in info.value.hint
    assert "--platform manylinux_2_28_aarch64 --python 3.10 --have torch" in info.value.hint


# --- the loaders refuse before loading, with the device query stubbed ------------------------------------------


@pytest.fixture
def fake_a100(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")


def test_the_aoti_runner_refuses_before_loading(fake_a100, monkeypatch):
    from zoo.runtimes import aoti as aoti_runner

    def never(*args, **kwargs):
        raise AssertionError("the .so was loaded before its kernels were checked")

    monkeypatch.setattr(aoti_runner, "promote_libtorch_global", never)
    with pytest.raises(GpuTargetMismatch, match="sm_90a/compute_90a"):
        aoti_runner.AotiRunner(H200, None, "cuda")


def test_the_artifact_backend_refuses_every_method_before_loading_any(fake_a100, monkeypatch, tmp_path):
    from zoo.contract.run_folder import RunFolder
    from zoo.runner import backends

    run = RunFolder(tmp_path / "run")
    run.path.mkdir()
    run.pte.write_bytes(b"stands in: the extraction below is replaced")
    methods = {"video_step": H200, "action_step": A100}
    run.io_spec_file.write_text('{"format": 1, "dtype": "float32", "methods": {"video_step": {"inputs": [], '
                                '"outputs": []}, "action_step": {"inputs": [], "outputs": []}}, "dynamic": {}, '
                                '"example_sizes": {}}')
    for m in methods:
        run.write_io_order(m, {"method": m, "input_order": [], "output_order": []})
    from zoo.runtimes import aoti

    monkeypatch.setattr(aoti, "extract_method_files",
                        lambda pte, ptd, folder, names: {m: {"so": so, "weights": None} for m, so in methods.items()})
    monkeypatch.setattr(backends, "AotiRunner", lambda *a, **k: pytest.fail("a method was loaded"))
    with pytest.raises(GpuTargetMismatch) as info:
        backends.make_backend("artifact", run, "cuda")
    assert "method 'video_step'" in info.value.message and str(run.path) in info.value.hint


# --- what the audit, the manifest and the model card state ------------------------------------------------------


def test_the_audit_states_each_methods_host_kernels_and_the_gpus_that_run_it():
    from zoo.export import audit

    result = audit.audit_artifact(H200)
    method = result.methods[0]
    assert method.targets["machine"] == "x86_64" and method.targets["images"] == ["sm_90a", "compute_90a"]
    assert method.targets["image_sets"] == [{"images": ["sm_90a", "compute_90a"], "kernels": 2}]
    assert [g for g, v in result.gpus().items() if v["ok"]] == ["h100", "h200"]
    table = result.table()
    assert "x86_64" in table and "sm_90a/compute_90a x2" in table
    assert "- not on gh200, orin, thor: host aarch64; the .so is x86_64 host code" in table
    # what a report keeps reads back to the same verdicts
    back = gpu_targets.KernelTargets.from_dict(method.targets)
    here = gpu_targets.read_targets(H200)
    for arch in (80, 86, 87, 89, 90, 100, 120):
        tegra = arch in gpu_targets.TEGRA_ARCHS
        assert back.verdict(arch, tegra) == here.verdict(arch, tegra), arch


def test_the_manifest_and_the_card_state_the_target_and_what_runs_it():
    from support.manifests import manifest as card_manifest
    from zoo.export import audit
    from zoo.export.lower import target as lowering_target
    from zoo.export.publish.manifest import gpus_section
    from zoo.export.publish.model_card import render_card

    plan = lowering_target.plan_target("a100", H200_DEVICE)
    data = {"lowering": {"gpu": {"name": "NVIDIA H200", "capability": "90", "target": plan.record()}},
            "audit": audit.audit_artifact(A100).summary(),
            "verification": {"gpu": {"name": "NVIDIA H200", "capability": "90"}}}
    gpu = gpus_section(data)
    assert gpu["built_for"] == {"name": "NVIDIA A100", "compute_capability": "8.0"}
    assert gpu["lowered_on"] == {"name": "NVIDIA H200", "compute_capability": "9.0"} and gpu["target"] == "a100"
    kernels = gpu["kernels"]
    assert kernels["kernel_images"] == ["sm_80", "compute_80"] and kernels["hosts"] == ["x86_64"]
    assert kernels["runs_on"] == ["a100", "a10", "a10g", "rtx3090", "l4", "l40s", "rtx4090"]
    assert kernels["runs_on_through_ptx_jit"] == ["h100", "h200", "b200", "rtx5090"]
    assert kernels["not_on"] == {"the kernels are sm_80/compute_80": ["t4"],
                                 "host aarch64; the .so is x86_64 host code": ["gh200", "orin", "thor"]}
    card = render_card(card_manifest(gpu=gpu), None, NoHostSettings(), "org/tiny")
    assert "## Which GPUs and hosts can run it" in card
    assert "the kernels are `sm_80`, `compute_80`" in card and "NVIDIA A100 (compute capability 8.0, sm_80)" in card
    assert "| h100, h200, b200, rtx5090 | yes, through the driver's JIT compile of the PTX (PTX ISA 8.7" in card
    assert "lowered on NVIDIA H200 (compute capability 9.0, sm_90)" in card


def test_the_cuda_release_named_for_a_ptx_isa_version_is_the_first_whose_driver_takes_it():
    # Triton keeps NVIDIA's table the other way round: the newest PTX ISA each CUDA release takes.
    compiler = pytest.importorskip("triton.backends.nvidia.compiler")
    releases = ["12.0", "12.1", "12.2", "12.3", "12.4", "12.5", "12.6", "12.7", "12.8", "12.9", "13.0", "13.1"]
    for isa in [(8, 0), (8, 3), (8, 5), (8, 6), (8, 7), (8, 8), (9, 0), (9, 1)]:
        first = gpu_targets.ptx_isa_cuda(isa)
        takes = [r for r in releases if compiler.ptx_get_version(r) >= isa[0] * 10 + isa[1]]
        assert first == takes[0], isa


def test_nvcc_built_code_in_nv_fatbin_reads_as_cuobjdump_reads_the_library(tmp_path):
    # nvcc_kernels.so: sm_87 SASS (Orin) + compute_80 PTX, in .nv_fatbin (build_kernel_fixtures.py says how)
    so = FIXTURES / "nvcc_kernels.so"
    read = gpu_targets.read_targets(so)
    assert read.sections == [".nv_fatbin"] and read.machine == "x86_64"
    tool = _cuobjdump()
    if tool:  # cuobjdump finds .nv_fatbin in the library by itself
        assert [(i.kind, f"{i.arch}{i.variant}") for f in read.fatbins for i in f] == _cuobjdump_images(tool, so)
    # two containers: nvlink's device-link image (sm_87 SASS only) and the kernels' (sm_87 SASS + compute_80 PTX)
    assert [[i.name for i in f] for f in read.fatbins] == [["sm_87"], ["sm_87", "compute_80"]]
    assert read.verdict(87, True).how == "sass"  # on an Orin the SASS runs as is
