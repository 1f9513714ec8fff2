"""Which GPUs and hosts can run a compiled method, read from its ``.so``: the host machine from the ELF header, the
GPU code from every NVIDIA fatbin embedded in it.

Why and how: docs/ARCHITECTURE.md, "Which GPUs and hosts run a `.so`".
"""

from __future__ import annotations

import contextlib
import io
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple, Union

from zoo.core.errors import GpuTargetMismatch, LoweringError, RecipeError

FATBIN_MAGIC = b"\x50\xed\x55\xba"  # 0xBA55ED50, little-endian
KIND_PTX, KIND_ELF = 1, 2
FLAG_LZ4, FLAG_ZSTD = 0x2000, 0x8000
FLAG_ARCH_SPECIFIC, FLAG_FAMILY_SPECIFIC = 0x100000, 0x200000
# Tegra architectures (Jetson TX1/Nano, TX2, Xavier, Orin, Thor as CUDA 12.x and as CUDA 13 number it).
TEGRA_ARCHS = frozenset({53, 62, 72, 87, 101, 110})
# ELF e_machine (pyelftools' names) -> the machine name ``uname -m`` / ``platform.machine()`` prints.
MACHINES = {"EM_X86_64": "x86_64", "EM_AARCH64": "aarch64"}
# PTX ISA version -> the first CUDA release whose driver compiles it (NVIDIA's PTX ISA release notes; Triton 3.6
# keeps the same table in ``ptx_get_version``). 8.0-8.4 are CUDA 12.0-12.4.
PTX_ISA_CUDA = {(8, 5): "12.5", (8, 6): "12.7", (8, 7): "12.8", (8, 8): "12.9", (9, 0): "13.0", (9, 1): "13.1"}
DOCS = "README, 'GPU targets and Jetson'"


@dataclass(frozen=True)
class Gpu:
    """A GPU by the name users know it: its compute capability, the host CPU of the machines it comes in."""

    name: str
    label: str
    capability: Tuple[int, int]
    machine: str = "x86_64"
    tegra: bool = False
    # Most shared memory a block may opt in to, in bytes (NVIDIA's CUDA programming guide, technical
    # specifications per compute capability); 0 where not known. A lowering for this GPU elsewhere caps its
    # kernels at it.
    shared_memory: int = 0

    @property
    def arch(self) -> int:
        return self.capability[0] * 10 + self.capability[1]


KIB = 1024
GPUS: Dict[str, Gpu] = {g.name: g for g in (
    Gpu("t4", "NVIDIA T4", (7, 5), shared_memory=64 * KIB),
    Gpu("a100", "NVIDIA A100", (8, 0), shared_memory=163 * KIB),
    Gpu("a10", "NVIDIA A10", (8, 6), shared_memory=99 * KIB),
    Gpu("a10g", "NVIDIA A10G", (8, 6), shared_memory=99 * KIB),
    Gpu("rtx3090", "NVIDIA GeForce RTX 3090", (8, 6), shared_memory=99 * KIB),
    Gpu("l4", "NVIDIA L4", (8, 9), shared_memory=99 * KIB),
    Gpu("l40s", "NVIDIA L40S", (8, 9), shared_memory=99 * KIB),
    Gpu("rtx4090", "NVIDIA GeForce RTX 4090", (8, 9), shared_memory=99 * KIB),
    Gpu("h100", "NVIDIA H100", (9, 0), shared_memory=227 * KIB),
    Gpu("h200", "NVIDIA H200", (9, 0), shared_memory=227 * KIB),
    Gpu("gh200", "NVIDIA GH200 (Grace Hopper)", (9, 0), "aarch64", shared_memory=227 * KIB),
    Gpu("b200", "NVIDIA B200", (10, 0), shared_memory=227 * KIB),
    Gpu("rtx5090", "NVIDIA GeForce RTX 5090", (12, 0), shared_memory=99 * KIB),
    Gpu("orin", "NVIDIA Jetson Orin (AGX, NX, Nano)", (8, 7), "aarch64", tegra=True, shared_memory=163 * KIB),
    # Thor reports 11.0 under CUDA 13 (JetPack 7); CUDA 12.8/12.9 called it 10.1.
    Gpu("thor", "NVIDIA Jetson Thor", (11, 0), "aarch64", tegra=True),
)}


def gpu(name: str) -> Gpu:
    """A GPU of the table by name (case-insensitive); an unknown name is refused with the names there are."""
    key = str(name).strip().lower()
    if key not in GPUS:
        raise RecipeError(f"unknown GPU target {name!r}",
                          f"use one of: {', '.join(GPUS)} (zoo.contract.gpu_targets.GPUS; {DOCS})")
    return GPUS[key]


@dataclass(frozen=True)
class Device:
    """The GPU and host a loader is about to run on (``aoti_runner.cuda_device`` reads it through torch)."""

    name: str
    capability: Tuple[int, int]
    machine: str

    @property
    def arch(self) -> int:
        return self.capability[0] * 10 + self.capability[1]

    @property
    def tegra(self) -> bool:
        return self.arch in TEGRA_ARCHS

    def text(self) -> str:
        return f"sm_{self.arch} ({self.name}, host {self.machine})"


@dataclass(frozen=True)
class KernelImage:
    """One entry of a fatbin: SASS (machine code) or PTX (compiled by the driver), for one architecture."""

    kind: str  # "sass" or "ptx"
    arch: int  # 90 for sm_90
    variant: str = ""  # "a" (arch-specific), "f" (family-specific) or ""
    code_version: Tuple[int, int] = (0, 0)  # PTX: the PTX ISA version
    compressed: bool = False

    @property
    def name(self) -> str:
        return f"{'sm' if self.kind == 'sass' else 'compute'}_{self.arch}{self.variant}"

    @classmethod
    def from_name(cls, name: str, code_version: Tuple[int, int] = (0, 0)) -> "KernelImage":
        """``sm_90a`` / ``compute_80`` back to an image (what ``KernelTargets.as_dict`` records)."""
        match = re.fullmatch(r"(sm|compute)_(\d+)([af]?)", name)
        if match is None:
            raise ValueError(f"not a kernel image name: {name!r}")
        return cls("sass" if match[1] == "sm" else "ptx", int(match[2]), match[3], code_version)

    def runs_on(self, arch: int, tegra: bool) -> bool:
        """Whether a GPU of ``arch`` (87 for 8.7) runs this image (PTX: the driver permitting its ISA version)."""
        major, minor = divmod(arch, 10)
        own_major, own_minor = divmod(self.arch, 10)
        if self.variant == "a":
            return arch == self.arch
        if self.variant == "f":
            return major == own_major and minor >= own_minor and tegra == (self.arch in TEGRA_ARCHS)
        if self.kind == "ptx":
            return arch >= self.arch
        if tegra or self.arch in TEGRA_ARCHS:  # no binary compatibility between Tegra and desktop, nor across Tegra
            return arch == self.arch and tegra
        return major == own_major and minor >= own_minor


@dataclass(frozen=True)
class Verdict:
    """Whether a method's kernels run on a GPU: ``how`` "sass", "ptx" (some kernel through the driver's JIT) or
    "" when some kernel has no image the GPU runs; ``why`` in words."""

    ok: bool
    how: str
    why: str


@dataclass
class KernelTargets:
    """What one compiled method needs: its host machine and, per embedded fatbin, the images it holds."""

    machine: str
    fatbins: List[List[KernelImage]] = field(default_factory=list)
    sections: List[str] = field(default_factory=list)  # where the fatbins were found

    def images(self) -> List[str]:
        """Every image name, SASS first, each once (``["sm_90a", "compute_90a"]``)."""
        seen = {i.name: i for fatbin in self.fatbins for i in fatbin}
        return sorted(seen, key=lambda n: (seen[n].kind != "sass", seen[n].arch, n))

    def ptx_isa(self) -> Optional[Tuple[int, int]]:
        versions = [i.code_version for fatbin in self.fatbins for i in fatbin if i.kind == "ptx"]
        return max(versions) if versions else None

    def text(self) -> str:
        kernels = f"{len(self.fatbins)} kernel image{'s' if len(self.fatbins) != 1 else ''}"
        return f"{'/'.join(self.images()) or 'no GPU code'} ({kernels}), host {self.machine}"

    def verdict(self, arch: int, tegra: bool) -> Verdict:
        jit = False
        for fatbin in self.fatbins:
            if any(i.kind == "sass" and i.runs_on(arch, tegra) for i in fatbin):
                continue
            if any(i.kind == "ptx" and i.runs_on(arch, tegra) for i in fatbin):
                jit = True
                continue
            names = "/".join(i.name for i in fatbin)
            return Verdict(False, "", f"a kernel holds only {names}, which sm_{arch} cannot run")
        if not self.fatbins:
            return Verdict(True, "sass", "no GPU code of its own")
        if jit:
            isa = self.ptx_isa()
            cuda = ptx_isa_cuda(isa) if isa else None
            need = (f" (PTX ISA {isa[0]}.{isa[1]}: a driver of CUDA {cuda} or newer)" if cuda
                    else f" (PTX ISA {isa[0]}.{isa[1]}: a driver that knows it)" if isa else "")
            return Verdict(True, "ptx", f"through the driver's JIT compile of its PTX{need}")
        return Verdict(True, "sass", "its SASS runs as is")

    def runs_on(self, target: Union[Gpu, Device]) -> Verdict:
        """The verdict for a GPU of the table or a device, the host machine included."""
        if target.machine != self.machine:
            return Verdict(False, "", f"the .so is {self.machine} host code; that host is {target.machine}")
        return self.verdict(target.arch, target.tegra)

    def gpus(self) -> List[str]:
        """The table's GPUs (with their usual host) that can run it."""
        return [g.name for g in GPUS.values() if self.runs_on(g).ok]

    def as_dict(self) -> Dict:
        """For reports and manifests: the fatbins grouped by the images they hold (AOTInductor gives every kernel
        the same ones), so a method of hundreds of kernels is a line or two."""
        groups: Dict[Tuple[str, ...], int] = {}
        for fatbin in self.fatbins:
            key = tuple(i.name for i in fatbin)
            groups[key] = groups.get(key, 0) + 1
        isa = self.ptx_isa()
        return {"machine": self.machine, "images": self.images(), "kernel_images": len(self.fatbins),
                "sections": list(self.sections), "ptx_isa": f"{isa[0]}.{isa[1]}" if isa else None,
                "image_sets": [{"images": list(k), "kernels": n} for k, n in groups.items()],
                "runs_on": self.gpus()}

    @classmethod
    def from_dict(cls, record: Mapping) -> "KernelTargets":
        """``as_dict`` read back (a report's audit); what it groups stays grouped, which changes no verdict."""
        isa = tuple(int(p) for p in record["ptx_isa"].split(".")) if record.get("ptx_isa") else (0, 0)
        fatbins = [[KernelImage.from_name(n, isa if n.startswith("compute_") else (0, 0)) for n in group["images"]]
                   for group in record.get("image_sets", []) for _ in range(group["kernels"])]
        return cls(machine=record.get("machine", "?"), fatbins=fatbins, sections=list(record.get("sections", [])))


def ptx_isa_cuda(isa: Tuple[int, int]) -> Optional[str]:
    """The first CUDA release whose driver compiles PTX of ISA version ``isa``; None for one not in the table."""
    if isa in PTX_ISA_CUDA:
        return PTX_ISA_CUDA[isa]
    return f"12.{isa[1]}" if isa[0] == 8 and isa[1] < 5 else None


# --- reading the binary ---------------------------------------------------------------------------------------


def parse_fatbin(data: bytes, offset: int) -> Optional[Tuple[List[KernelImage], int]]:
    """The images of the fatbin container starting at ``offset`` and the offset just past it; None when the bytes
    there are not a well-formed container (its entries must fill its declared size exactly)."""
    if len(data) < offset + 16 or data[offset:offset + 4] != FATBIN_MAGIC:
        return None
    version, header_size, size = struct.unpack_from("<HHQ", data, offset + 4)
    end = offset + header_size + size
    if version != 1 or header_size != 16 or size == 0 or end > len(data):
        return None
    images: List[KernelImage] = []
    at = offset + header_size
    while at < end:
        if at + 64 > end:
            return None
        kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, at)
        if kind not in (KIND_PTX, KIND_ELF) or entry_header < 64 or at + entry_header + payload > end:
            return None
        minor, major, arch = struct.unpack_from("<HHI", data, at + 24)
        (flags,) = struct.unpack_from("<Q", data, at + 40)
        variant = "a" if flags & FLAG_ARCH_SPECIFIC else "f" if flags & FLAG_FAMILY_SPECIFIC else ""
        images.append(KernelImage(kind="ptx" if kind == KIND_PTX else "sass", arch=arch, variant=variant,
                                  code_version=(major, minor), compressed=bool(flags & (FLAG_LZ4 | FLAG_ZSTD))))
        at += entry_header + payload
    return (images, end) if at == end and images else None


def find_fatbins(data: bytes) -> List[Tuple[int, List[KernelImage]]]:
    """Every fatbin container in ``data``: (offset, images), in file order."""
    found: List[Tuple[int, List[KernelImage]]] = []
    at = data.find(FATBIN_MAGIC)
    while at >= 0:
        parsed = parse_fatbin(data, at)
        if parsed is not None:
            found.append((at, parsed[0]))
            at = data.find(FATBIN_MAGIC, parsed[1])
        else:
            at = data.find(FATBIN_MAGIC, at + 1)
    return found


@contextlib.contextmanager
def reading_elf(so: Union[Path, bytes], what: str, not_elf_hint: str) -> Iterator[Tuple[Any, bytes]]:
    """A compiled method (its ``.so`` path or bytes) opened with pyelftools, and its bytes. A file that is no ELF
    library, or a damaged one, raises a LoweringError naming it, while it is opened or while it is read."""
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile

    data = so if isinstance(so, (bytes, bytearray)) else Path(so).read_bytes()
    label = what or (str(so) if not isinstance(so, (bytes, bytearray)) else "the .so")
    try:
        yield ELFFile(io.BytesIO(data)), data
    except ELFError as exc:
        raise LoweringError(f"{label} is not an ELF shared library: {exc}", not_elf_hint) from None
    except Exception as exc:  # a damaged ELF makes pyelftools fail in many ways (struct, index, unicode errors)
        raise LoweringError(f"{label} is a damaged ELF library ({type(exc).__name__}: {exc})",
                            "the file is truncated or corrupted: lower the run again, or pass the original") from None


def read_targets(so: Union[Path, bytes], what: str = "") -> KernelTargets:
    """The host machine and every kernel image of a compiled method (its ``.so`` path or bytes)."""
    with reading_elf(so, what, "pass a .so compiled by AOTInductor, a CUDA .pte holding them, or a run folder") \
            as (elf, data):
        machine = MACHINES.get(elf["e_machine"], str(elf["e_machine"]).removeprefix("EM_").lower())
        spans = [(s["sh_offset"], s["sh_offset"] + s["sh_size"], s.name) for s in elf.iter_sections()
                 if s["sh_type"] != "SHT_NOBITS" and s["sh_size"]]
    found = find_fatbins(bytes(data))
    sections = sorted({name for offset, _ in found for start, stop, name in spans if start <= offset < stop})
    return KernelTargets(machine=machine, fatbins=[images for _, images in found], sections=sections)


# --- the check before loading ---------------------------------------------------------------------------------


def lowered_for(targets: KernelTargets) -> str:
    """The GPUs of the table the kernels were written for, in words (``sm_90a: h100, h200, gh200``)."""
    sass = [i for fatbin in targets.fatbins for i in fatbin if i.kind == "sass"]
    archs = sorted({i.arch for i in sass})
    names = [g.name for g in GPUS.values() if g.arch in archs]
    return ", ".join(names) or "no GPU in zoo's table"


def lower_hint(device: Device, run_dir: str = "RUN_DIR") -> str:
    """What to do when an artifact cannot run on ``device``: lower it for this GPU, here or elsewhere."""
    known = [g.name for g in GPUS.values() if g.arch == device.arch and g.machine == device.machine]
    if device.tegra:
        return (f"lower the run on this Jetson itself: `python -m zoo lower {run_dir}` (install offline with "
                "`python -m zoo bundle BUNDLE --platform manylinux_2_28_aarch64 --python 3.10 --have torch` on a "
                f"connected machine; {DOCS})")
    target = f" --target {known[0]}" if known else ""
    return (f"lower the run for this GPU: here, `python -m zoo lower {run_dir}`, or on a machine with a GPU of the "
            f"same generation or newer, `python -m zoo lower {run_dir}{target}` ({DOCS})")


def require_runs_on(sos: Mapping[str, Union[Path, bytes]], device: Device, *, artifact: str = "this artifact",
                    run_dir: str = "RUN_DIR") -> Dict[str, KernelTargets]:
    """Read each method's ``.so`` and refuse (``GpuTargetMismatch``) when any cannot run on ``device``: the
    check a loader makes before it loads. Returns what was read, per method."""
    read = {m: read_targets(so, what=f"the .so of method {m!r}") for m, so in sos.items()}
    for method, targets in read.items():
        verdict = targets.runs_on(device)
        if verdict.ok:
            continue
        if targets.machine != device.machine:
            message = (f"{artifact} (method {method!r}) is {targets.machine} host code; this machine is "
                       f"{device.machine}: the .so cannot be loaded here")
        else:
            message = (f"{artifact} (method {method!r}) holds kernels {'/'.join(targets.images())} (written for "
                       f"{lowered_for(targets)}); this GPU is {device.text()}: {verdict.why}")
        raise GpuTargetMismatch(message, lower_hint(device, run_dir))
    return read


def runs_on_table(read: Mapping[str, KernelTargets]) -> Dict[str, Dict]:
    """Per GPU of the table: whether every method runs there (``ok``), ``how`` ("sass", "ptx": some kernel
    through the driver's JIT) and, when not, ``why`` (of the first method that cannot; worded alike for every GPU
    it excludes, so that a report can group them)."""
    table: Dict[str, Dict] = {}
    for g in GPUS.values():
        verdicts = {m: t.runs_on(g) for m, t in read.items()}
        refused = next((m for m, v in verdicts.items() if not v.ok), None)
        if refused:
            t = read[refused]
            why = (f"host {g.machine}; the .so is {t.machine} host code" if t.machine != g.machine
                   else f"the kernels are {'/'.join(t.images())}")
            table[g.name] = {"ok": False, "how": "", "why": why}
        else:
            how = "ptx" if any(v.how == "ptx" for v in verdicts.values()) else "sass"
            table[g.name] = {"ok": True, "how": how, "why": ""}
    return table


def runs_on_lines(gpus: Mapping[str, Mapping]) -> List[str]:
    """``runs_on_table`` in words, the GPUs it excludes grouped by reason."""
    summary = artifact_summary(gpus)
    lines = [f"runs on (kernel images and host read from each .so): {', '.join(summary['runs_on']) or 'none'}"]
    if summary["runs_on_through_ptx_jit"]:
        lines.append("runs through the driver's JIT compile of its PTX on: "
                     + ", ".join(summary["runs_on_through_ptx_jit"]))
    return lines + [f"not on {', '.join(names)}: {why}" for why, names in summary["not_on"].items()]


def artifact_summary(gpus: Mapping[str, Mapping], methods: Optional[List[Mapping]] = None) -> Dict:
    """What a manifest and a model card state, from an audit record (``gpus``: ``runs_on_table``; ``methods``:
    its methods, each with its ``targets``): the GPUs of the table it runs on as is, through PTX, and not (by
    reason); with ``methods``, the host machines and kernel images too."""
    out: Dict = {"runs_on": [n for n, v in gpus.items() if v["ok"] and v["how"] == "sass"],
                 "runs_on_through_ptx_jit": [n for n, v in gpus.items() if v["ok"] and v["how"] == "ptx"],
                 "not_on": {}}
    for name, verdict in gpus.items():
        if not verdict["ok"]:
            out["not_on"].setdefault(verdict["why"], []).append(name)
    if methods is not None:
        targets = [m.get("targets") or {} for m in methods]
        out["hosts"] = sorted({t.get("machine", "?") for t in targets})
        names = {n: KernelImage.from_name(n) for t in targets for n in t.get("images") or []}
        out["kernel_images"] = sorted(names, key=lambda n: (names[n].kind != "sass", names[n].arch, n))
        out["ptx_isa"] = max((t["ptx_isa"] for t in targets if t.get("ptx_isa")), default=None,
                             key=lambda v: tuple(int(p) for p in v.split(".")))
    return out

