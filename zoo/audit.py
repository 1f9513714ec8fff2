"""Runtime audit: which ExecuTorch CUDA runtime releases can load an artifact, read from its compiled code.

Each method's AOTInductor ``.so`` names every runtime function it needs as an undefined ``aoti_torch_*``
symbol (dtype constants, tensor and stream helpers, fallback kernels). The ExecuTorch CUDA runtime resolves
them against its own shim library when it loads the ``.so``, lazily: a missing one fails on the robot, at the
first call. Comparing the symbols (read with pyelftools) with what each release exports
(``zoo/data/runtimes.json``) tells before shipping which releases can load the artifact and what is missing.

``python -m zoo audit PATH [--json] [--require RELEASE]``: PATH is a run folder, any CUDA ``.pte`` written by
ExecuTorch 1.2 (with or without its ``.ptd``; only the ``.so`` matters), or a single ``.so``.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Set, Union

from .artifact import PTE_NAME, SO_SUFFIX, read_pte, so_file_name
from .errors import (
    EXIT_CHECK_FAILED,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    LoweringError,
    ZooError,
    exit_status_help,
)
from .report import format_table
from .run_folder import SO_DIR, RunFolder
from .runtimes import Release, load_runtimes

SYMBOL_PREFIX = "aoti_torch_"
DTYPE_PREFIX = "aoti_torch_dtype_"


def undefined_aoti_symbols(so: Union[Path, bytes], what: str = "") -> List[str]:
    """Undefined ``aoti_torch_*`` symbols of an ELF shared library: the runtime functions it needs."""
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile
    from elftools.elf.sections import SymbolTableSection

    data = so if isinstance(so, (bytes, bytearray)) else Path(so).read_bytes()
    label = what or (str(so) if not isinstance(so, (bytes, bytearray)) else "the .so")
    found: Set[str] = set()
    try:
        elf = ELFFile(io.BytesIO(data))
        tables = [s for s in elf.iter_sections() if isinstance(s, SymbolTableSection)]
        # The dynamic table is what the loader resolves; a static table only adds names of a non-stripped build.
        dynamic = [t for t in tables if t.name == ".dynsym"] or tables
        for table in dynamic:
            for sym in table.iter_symbols():
                if sym.name.startswith(SYMBOL_PREFIX) and sym["st_shndx"] == "SHN_UNDEF":
                    found.add(sym.name)
    except ELFError as exc:
        raise LoweringError(f"{label} is not an ELF shared library: {exc}",
                            "audit a .so compiled by AOTInductor, a CUDA .pte that holds them, or a run folder") from None
    except Exception as exc:  # a damaged ELF makes pyelftools fail in many ways (struct, index, unicode errors)
        raise LoweringError(f"{label} is a damaged ELF library ({type(exc).__name__}: {exc})",
                            "the file is truncated or corrupted: lower the run again, or pass the original") from None
    return sorted(found)


@dataclass
class MethodAudit:
    method: str
    so_bytes: int
    symbols: List[str]
    dtypes: List[str]
    missing: Dict[str, List[str]]  # release -> symbols it lacks

    def loadable(self, release: str) -> bool:
        return not self.missing[release]


@dataclass
class AuditResult:
    path: str
    methods: List[MethodAudit]
    releases: Dict[str, str]  # release -> full version
    notes: List[str] = field(default_factory=list)

    def loadable(self, release: str) -> bool:
        return all(m.loadable(release) for m in self.methods)

    def loadable_releases(self) -> List[str]:
        return [r for r in self.releases if self.loadable(r)]

    def dtypes(self) -> List[str]:
        return sorted({d for m in self.methods for d in m.dtypes})

    def as_dict(self) -> Dict:
        return {
            "path": self.path,
            "dtypes": self.dtypes(),
            "methods": [asdict(m) for m in self.methods],
            "releases": {r: {"version": v, "loadable": self.loadable(r),
                             "missing": {m.method: m.missing[r] for m in self.methods if m.missing[r]}}
                         for r, v in self.releases.items()},
            "notes": list(self.notes),
        }

    def summary(self) -> Dict:
        """The run report's ``audit`` section; no machine path (reports and manifests get published)."""
        record = {**self.as_dict(), "table": self.table()}
        record.pop("path")
        return record

    def table(self, title: bool = False) -> str:
        """The audit tables; ``title`` names the audited path first (the command line). Reports leave it out:
        the pipeline audits a staging folder whose name means nothing once the run is moved into place."""
        methods = format_table([["method", ".so bytes", "aoti_torch symbols", "dtypes"]]
                               + [[m.method, m.so_bytes, len(m.symbols), ", ".join(m.dtypes)] for m in self.methods])
        rows = [["release", "version", "loadable", "missing symbols"]]
        for release, version in self.releases.items():
            missing = sorted({s for m in self.methods for s in m.missing[release]})
            rows.append([release, version, "yes" if self.loadable(release) else "NO", ", ".join(missing) or "-"])
        text = f"{methods}\n\n{format_table(rows)}"
        if title:
            text = f"runtime audit of {Path(self.path).name}\n{text}"
        if self.notes:
            text += "\n\n" + "\n".join(f"- {note}" for note in self.notes)
        return text


def audit_so(data: bytes, method: str, runtimes: Dict[str, Release], where: str = "") -> MethodAudit:
    symbols = undefined_aoti_symbols(data, what=f"the .so of method {method!r}" + (f" in {where}" if where else ""))
    dtypes = sorted(s[len(DTYPE_PREFIX):] for s in symbols if s.startswith(DTYPE_PREFIX))
    missing = {name: sorted(set(symbols) - rel.symbols) for name, rel in runtimes.items()}
    return MethodAudit(method=method, so_bytes=len(data), symbols=symbols, dtypes=dtypes, missing=missing)


def _method_sos(path: Path) -> Dict[str, bytes]:
    """{method: .so bytes} from a run folder, a .pte or a .so."""
    if path.is_dir():
        run = RunFolder(path)
        if run.pte.exists():
            return _method_sos(run.pte)
        sos = run.compiled_methods()
        if not sos:
            raise LoweringError(f"{path} holds neither {PTE_NAME} nor {SO_DIR}/{so_file_name('*')}",
                                "lower the run first (`python -m zoo.lower RUN_DIR`), or pass a .pte or .so")
        return {method: so.read_bytes() for method, so in sos.items()}
    if not path.exists():
        raise LoweringError(f"{path} does not exist", "pass a run folder, a CUDA .pte or a .so")
    if path.suffix == ".pte":
        methods, named = read_pte(path)
        out: Dict[str, bytes] = {}
        for name, method in methods.items():
            if method.so_key:
                out[name] = named[method.so_key]
        # Releases after 1.2 key the blobs by content hash: keep any .so blob no method name claimed.
        claimed = {m.so_key for m in methods.values()}
        for key, data in named.items():
            if key.endswith(SO_SUFFIX) and key not in claimed:
                out[key[: -len(SO_SUFFIX)]] = data
        if not out:
            backends = sorted({m.backend for m in methods.values() if m.backend}) or ["none"]
            raise LoweringError(f"{path} holds no compiled CUDA .so (delegates: {', '.join(backends)})",
                                "the audit reads CUDA .pte files written by ExecuTorch's CudaBackend")
        return out
    return {path.stem: path.read_bytes()}


def audit_artifact(path: Union[str, Path], runtimes: Optional[Dict[str, Release]] = None) -> AuditResult:
    """Audit every method's .so in ``path`` against every release in ``runtimes`` (default: runtimes.json)."""
    runtimes = runtimes if runtimes is not None else load_runtimes()
    path = Path(path)
    methods = [audit_so(data, name, runtimes, where=str(path)) for name, data in _method_sos(path).items()]
    result = AuditResult(path=str(path), methods=methods, releases={n: r.version for n, r in runtimes.items()})
    result.notes = _notes(result, runtimes)
    return result


def _notes(result: AuditResult, runtimes: Dict[str, Release]) -> List[str]:
    """Plain words for the reasons a release cannot load the artifact."""
    notes: List[str] = []
    used = set(result.dtypes())
    for dtype in sorted(used):
        having = [n for n, r in runtimes.items() if dtype in r.dtypes]
        if len(having) == len(runtimes):
            continue
        where = f"only releases {', '.join(having)} have it" if having else "no release in the table has it"
        hint = ""
        if dtype == "float64":
            hint = ("; float64 tensors come from rotary_pairs=float64 (or float64 constants in the source): "
                    "set rotary_pairs=float32 to load on a released runtime, or ship for a runtime with float64")
        elif dtype.startswith("complex"):
            hint = "; complex values must be rewritten to real pairs (replace_complex_with_real)"
        notes.append(f"dtype {dtype}: the .so holds {dtype} tensors; {where}{hint}")
    kernels = sorted({s for m in result.methods for s in m.symbols
                      if not s.startswith(DTYPE_PREFIX) and any(s in m.missing[r] for r in runtimes)})
    for symbol in kernels:
        having = [n for n, r in runtimes.items() if symbol in r.symbols]
        where = f"only releases {', '.join(having)} provide it" if having else "no release in the table provides it"
        notes.append(f"{symbol}: needed by the .so; {where}")
    return notes


def audit_main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m zoo audit PATH [--json] [--require RELEASE]``.

    Exit 0 when the artifact loads on ``--require`` (or, without it, on at least one release), 1 when it does
    not, and a ZooError's code when PATH cannot be read.
    """
    parser = argparse.ArgumentParser(
        prog="python -m zoo audit", description="Which ExecuTorch CUDA runtime releases can load an artifact.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=exit_status_help([EXIT_OK, EXIT_CHECK_FAILED, EXIT_ERROR, EXIT_INTERRUPTED], {
            EXIT_OK: "the artifact loads on --require (without it: on at least one release)",
            EXIT_CHECK_FAILED: "it does not",
            EXIT_ERROR: "PATH cannot be read: missing, not a CUDA .pte or .so, truncated or damaged",
            EXIT_INTERRUPTED: "interrupted (Ctrl-C)"}))
    parser.add_argument("path", help="a run folder, a CUDA .pte written by ExecuTorch 1.2, or a .so")
    parser.add_argument("--json", action="store_true", help="print the audit as JSON")
    parser.add_argument("--require", metavar="RELEASE", help="exit 1 unless this release can load the artifact")
    args = parser.parse_args(argv)
    try:
        runtimes = load_runtimes()
        if args.require and args.require not in runtimes:
            raise LoweringError(f"unknown runtime release {args.require!r}",
                                f"releases in the table: {', '.join(runtimes)}")
        result = audit_artifact(args.path, runtimes)
    except ZooError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(json.dumps(result.as_dict(), indent=2) if args.json else result.table(title=True))
    ok = result.loadable(args.require) if args.require else bool(result.loadable_releases())
    return EXIT_OK if ok else EXIT_CHECK_FAILED
