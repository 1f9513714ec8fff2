"""zoo_runner's check (runtime/cpp/gpu_targets.cpp) gives zoo.contract.gpu_targets' verdicts, over the same bytes.

The C++ file has no ExecuTorch or CUDA dependency, so it is compiled here with the host's C++ compiler and a
small driver, and run over the kernel fixtures, hand-packed fatbins (tests/test_gpu_targets.py) and a stand-in
for model.pte: some bytes, a method's .so, more bytes (a .pte holds each .so as it is). The verdicts of the
Python module are themselves checked against hand-worked cases in tests/test_gpu_targets.py.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from support.gpu_kernels import A100, FIXTURES, H200, container, entry
from zoo.contract import gpu_targets

ROOT = Path(__file__).resolve().parent.parent
CXX = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler")
ARCHS = [75, 80, 86, 87, 89, 90, 100, 103, 110, 120]

DRIVER = r"""
#include <cstdio>
#include <cstdlib>
#include <string>
#include "gpu_targets.h"

// usage: driver FILE MACHINE ARCH... ; prints the images, the host machines, then per ARCH "ARCH ok|no MESSAGE"
int main(int argc, char** argv) {
  std::string error;
  const zoo::BinaryTargets t = zoo::scan_file(argv[1], &error);
  if (!error.empty()) { std::printf("error %s\n", error.c_str()); return 2; }
  std::printf("fatbins");
  for (const auto& f : t.fatbins) {
    std::printf(" ");
    for (size_t i = 0; i < f.size(); ++i) std::printf("%s%s", i ? "/" : "", f[i].name().c_str());
  }
  std::printf("\nmachines");
  for (const auto& m : t.host_machines) std::printf(" %s", m.c_str());
  std::printf("\n");
  for (int i = 3; i < argc; ++i) {
    const int arch = std::atoi(argv[i]);
    const std::string why = zoo::check_targets(t, arch, "GPU", argv[2]);
    std::printf("%d %s %s\n", arch, why.empty() ? "ok" : "no", why.c_str());
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("gpu_targets_cpp")
    (work / "driver.cpp").write_text(DRIVER)
    exe = work / "driver"
    subprocess.run([CXX, "-std=c++17", "-O0", "-Wall", "-Werror", f"-I{ROOT / 'runtime' / 'cpp'}",
                    str(work / "driver.cpp"), str(ROOT / "runtime" / "cpp" / "gpu_targets.cpp"), "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    return exe


def run_driver(driver: Path, path: Path, machine: str) -> tuple:
    out = subprocess.run([str(driver), str(path), machine, *map(str, ARCHS)], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    fatbins = out[0].split()[1:]
    machines = out[1].split()[1:]
    verdicts = {int(line.split()[0]): (line.split()[1] == "ok", line.split(" ", 2)[2]) for line in out[2:]}
    return fatbins, machines, verdicts


def as_pte(tmp_path: Path, so: Path) -> Path:
    pte = tmp_path / "model.pte"
    pte.write_bytes(b"\x00ET12" * 1000 + so.read_bytes() + b"\x01" * 777)
    return pte


@pytest.mark.parametrize("so", [H200, A100], ids=["h200", "a100"])
def test_the_runner_check_agrees_with_zoo_gpu_targets_on_a_pte_holding_the_so(driver, so, tmp_path):
    read = gpu_targets.read_targets(so)
    fatbins, machines, verdicts = run_driver(driver, as_pte(tmp_path, so), "x86_64")
    assert fatbins == ["/".join(i.name for i in f) for f in read.fatbins]
    assert machines == ["x86_64"]  # the .so; the SASS ELF files inside the fatbins are not host code
    for arch in ARCHS:
        assert verdicts[arch][0] == read.verdict(arch, arch in gpu_targets.TEGRA_ARCHS).ok, arch
    _, _, on_aarch64 = run_driver(driver, as_pte(tmp_path, so), "aarch64")
    assert not any(ok for ok, _ in on_aarch64.values())
    assert "x86_64 host code; this machine is aarch64" in on_aarch64[87][1]


def test_the_runner_check_names_the_kernels_and_the_command(driver, tmp_path):
    _, _, verdicts = run_driver(driver, as_pte(tmp_path, H200), "x86_64")
    ok, why = verdicts[80]
    assert not ok and "sm_90a/compute_90a" in why and "sm_80" in why and "--target a100" in why
    assert "Jetson itself" in verdicts[87][1]


def test_hand_packed_fatbins_read_alike(driver, tmp_path):
    blob = tmp_path / "packed.bin"
    blob.write_bytes(b"x" * 5 + container(entry(2, 87), entry(1, 80, flags=0x8011, header=80))
                     + container(entry(2, 100, flags=0x1200011, header=112), entry(1, 90, flags=0x100011)))
    read = gpu_targets.KernelTargets(machine="x86_64",
                                     fatbins=[i for _, i in gpu_targets.find_fatbins(blob.read_bytes())])
    fatbins, machines, verdicts = run_driver(driver, blob, "x86_64")
    assert fatbins == ["sm_87/compute_80", "sm_100f/compute_90a"] and machines == []
    for arch in ARCHS:
        assert verdicts[arch][0] == read.verdict(arch, arch in gpu_targets.TEGRA_ARCHS).ok, arch


def test_a_file_without_kernels_is_no_reason_to_refuse(driver):
    fatbins, machines, verdicts = run_driver(driver, FIXTURES / "clean.so", "x86_64")
    assert fatbins == [] and machines == ["x86_64"] and all(ok for ok, _ in verdicts.values())
