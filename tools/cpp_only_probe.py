#!/usr/bin/env python3
"""What AOTInductor's ``package_cpp_only`` route leaves to the target machine: a small module compiled with
``aot_inductor.package_cpp_only=True`` on this machine, and what its generated CMake project needs to build.

    python tools/cpp_only_probe.py

The route would let a Jetson build the ``.so`` from C++ without running Inductor itself. This prints, read from
the package: the files it holds, the packages ``find_package`` asks for, the libraries it links, the compile
flags that name this machine's CPU, and the object files in it (with the machine they were compiled for). It runs
on a CPU machine (a CPU module: the wrapper and weights are the same for a CUDA one, which adds its kernels' PTX and
cubins for the lowering GPU). docs/jetson.md ("Why the artifact is lowered on the Jetson") reads its output.
"""

from __future__ import annotations

import argparse
import platform
import re
import struct
import sys
import zipfile
from pathlib import Path

import torch

ELF_MACHINES = {0x3E: "x86-64", 0xB7: "aarch64"}


def elf_machine(data: bytes) -> str:
    """The machine an ELF object was compiled for (e_machine), or what the bytes are instead."""
    if data[:4] != b"\x7fELF":
        return "not an ELF file"
    (machine,) = struct.unpack_from("<H", data, 18)
    return ELF_MACHINES.get(machine, f"e_machine {machine:#x}")


def build_package() -> Path:
    """The package of a small module, where torch puts it (a temporary file)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    program = torch.export.export(model, (torch.randn(2, 8),))
    return Path(torch._inductor.aoti_compile_and_package(
        program, inductor_configs={"aot_inductor.package_cpp_only": True}))


def describe(package: Path) -> None:
    with zipfile.ZipFile(package) as archive:
        names = [n for n in archive.namelist() if "/aotinductor/" in n]
        print("files:", ", ".join(sorted(Path(n).suffix or Path(n).name for n in names)))
        for name in names:
            if name.endswith("CMakeLists.txt"):
                cmake = archive.read(name).decode()
                print("find_package:", ", ".join(re.findall(r"find_package\((\w+)", cmake)) or "none")
                print("links:", " ".join(re.findall(r"target_link_libraries\(\S+ PRIVATE ([^)]*)\)", cmake)))
                flags = sorted(set(re.findall(r"-march=\S+|-mavx\w*|-mamx\S*|-mfma", cmake)))
                print("flags for this machine's CPU:", " ".join(flags) or "none")
            elif name.endswith(".o"):
                print(f"object {Path(name).name}: compiled for {elf_machine(archive.read(name))}")


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    print(f"torch {torch.__version__}, this machine: {platform.machine()}")
    package = build_package()
    print(f"package: {package}")
    describe(package)
    return 0


if __name__ == "__main__":
    sys.exit(main())
