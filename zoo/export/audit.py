"""Runtime audit: which ExecuTorch CUDA runtime releases can load an artifact, what each does with its weights,
and which GPUs and hosts run it, all read from the compiled code (docs/ARCHITECTURE.md, "Audit and verification").

``python -m zoo audit PATH [--json] [--require RELEASE]``: PATH is a run folder, any CUDA ``.pte`` written by
ExecuTorch 1.2 (with or without its ``.ptd``), or a single ``.so``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Set, Union

from zoo.contract.artifact import PTD_NAME, PTE_NAME, SO_SUFFIX, WEIGHTS_SUFFIX, read_ptd_entries, read_pte, so_file_name
from zoo.core.errors import (
    EXIT_CHECK_FAILED,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    LoweringError,
    ZooError,
    exit_status_help,
)
from zoo.core.report import format_table
from zoo.contract.run_folder import SO_DIR, RunFolder
from zoo.contract.releases import Release, load_features, load_runtimes, row_name, with_features, zoo_build_rows
from zoo.contract.gpu_targets import KernelTargets, read_targets, reading_elf, runs_on_lines, runs_on_table

SYMBOL_PREFIX = "aoti_torch_"
INFERRED = "inferred from symbols"
DTYPE_PREFIX = "aoti_torch_dtype_"
SHARING_OPTION = "weight_sharing_across_methods"  # the CUDA backend's runtime option, from ExecuTorch 1.3
FIRST_SHARING_RELEASE = (1, 3)


def undefined_aoti_symbols(so: Union[Path, bytes], what: str = "") -> List[str]:
    """Undefined ``aoti_torch_*`` symbols of an ELF shared library: the runtime functions it needs."""
    from elftools.elf.sections import SymbolTableSection

    found: Set[str] = set()
    with reading_elf(so, what, "audit a .so compiled by AOTInductor, a CUDA .pte that holds them, or a run folder") \
            as (elf, _):
        tables = [s for s in elf.iter_sections() if isinstance(s, SymbolTableSection)]
        # The dynamic table is what the loader resolves; a static table only adds names of a non-stripped build.
        dynamic = [t for t in tables if t.name == ".dynsym"] or tables
        for table in dynamic:
            for sym in table.iter_symbols():
                if sym.name.startswith(SYMBOL_PREFIX) and sym["st_shndx"] == "SHN_UNDEF":
                    found.add(sym.name)
    return sorted(found)


@dataclass
class MethodAudit:
    method: str
    so_bytes: int
    symbols: List[str]
    dtypes: List[str]
    missing: Dict[str, List[str]]  # release -> symbols it lacks
    targets: Dict = field(default_factory=dict)  # KernelTargets.as_dict(): host machine, kernel images, GPUs

    def loadable(self, release: str) -> bool:
        return not self.missing[release]

    def kernel_targets(self) -> KernelTargets:
        return KernelTargets.from_dict(self.targets)


@dataclass
class AuditResult:
    path: str
    methods: List[MethodAudit]
    releases: Dict[str, str]  # release -> full version
    notes: List[str] = field(default_factory=list)
    # release -> how its verdict is known: "by running: ..." for a release a runtime built from it ran (or failed
    # to run) the artifact, set by ``mark_tested``; every other release is inferred from symbols
    tested: Dict[str, str] = field(default_factory=dict)
    findings: List[str] = field(default_factory=list)  # a prediction that running contradicted
    weights: Optional[Dict] = None  # weights_facts: the .ptd against one copy, GPU memory per release
    caveats: Dict[str, List[str]] = field(default_factory=dict)  # release -> what loading alone does not show

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
                             "missing": {m.method: m.missing[r] for m in self.methods if m.missing[r]},
                             "tested": self.tested_text(r),
                             "caveats": list(self.caveats.get(r, []))}
                         for r, v in self.releases.items()},
            "notes": list(self.notes),
            "findings": list(self.findings),
            "weights": self.weights,
            "gpus": self.gpus(),
        }

    def gpus(self) -> Dict[str, Dict]:
        """Per GPU of zoo's table: whether every method's kernels and host code run there, and how."""
        return runs_on_table({m.method: m.kernel_targets() for m in self.methods})

    def summary(self) -> Dict:
        """The run report's ``audit`` section; no machine path (reports and manifests get published)."""
        record = {**self.as_dict(), "table": self.table()}
        record.pop("path")
        return record

    def table(self, title: bool = False) -> str:
        """The audit tables; ``title`` names the audited path first (the command line). Reports leave it out:
        the pipeline audits a staging folder whose name means nothing once the run is moved into place."""
        methods = format_table([["method", ".so bytes", "aoti_torch symbols", "dtypes", "host", "kernel images"]]
                               + [[m.method, m.so_bytes, len(m.symbols), ", ".join(m.dtypes),
                                   m.targets.get("machine", "?"), _kernels_cell(m.targets)] for m in self.methods])
        rows = [["release", "version", "loadable", "missing symbols", "tested"]]
        marks: Dict[str, int] = {}  # caveat text -> its footnote number
        for release, version in self.releases.items():
            missing = sorted({s for m in self.methods for s in m.missing[release]})
            refs = "".join(f" [{marks.setdefault(c, len(marks) + 1)}]" for c in self.caveats.get(release, []))
            rows.append([release, version, ("yes" if self.loadable(release) else "NO") + refs,
                         ", ".join(missing) or "-", self.tested_text(release)])
        text = f"{methods}\n\n{format_table(rows)}"
        if marks:
            text += "\n" + "\n".join(f"[{n}] {caveat}" for caveat, n in marks.items())
        if title:
            text = f"runtime audit of {Path(self.path).name}\n{text}"
        text += "\n\n" + "\n".join(f"- {line}" for line in runs_on_lines(self.gpus()))
        if self.weights:
            text += "\n\n" + "\n".join(f"- {line}" for line in weights_lines(self.weights))
        if self.notes:
            text += "\n\n" + "\n".join(f"- {note}" for note in self.notes)
        if self.findings:
            text += "\n\n" + "\n".join(f"- FINDING: {finding}" for finding in self.findings)
        return text

    def tested_text(self, release: str) -> str:
        return self.tested.get(release, INFERRED)


def audit_so(data: bytes, method: str, symbols: List[str], runtimes: Dict[str, Release], where: str) -> MethodAudit:
    """One method's .so (``symbols``: its undefined aoti_torch_* symbols) against every release."""
    what = f"the .so of method {method!r} in {where}"
    dtypes = sorted(s[len(DTYPE_PREFIX):] for s in symbols if s.startswith(DTYPE_PREFIX))
    missing = {name: sorted(set(symbols) - rel.symbols) for name, rel in runtimes.items()}
    return MethodAudit(method=method, so_bytes=len(data), symbols=symbols, dtypes=dtypes, missing=missing,
                       targets=read_targets(data, what=what).as_dict())


def _kernels_cell(targets: Dict) -> str:
    images = "/".join(targets.get("images") or []) or "none"
    return f"{images} x{targets.get('kernel_images', 0)}" if targets.get("kernel_images") else images



def _method_sos(path: Path) -> Dict[str, bytes]:
    """{method: .so bytes} from a run folder, a .pte or a .so."""
    if path.is_dir():
        run = RunFolder(path)
        if run.pte.exists():
            return _method_sos(run.pte)
        sos = run.compiled_methods()
        if not sos:
            raise LoweringError(f"{path} holds neither {PTE_NAME} nor {SO_DIR}/{so_file_name('*')}",
                                "lower the run first (`python -m zoo lower RUN_DIR`), or pass a .pte or .so")
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


def audit_artifact(path: Union[str, Path], runtimes: Optional[Dict[str, Release]] = None, *,
                   lowered_with: Optional[str] = None) -> AuditResult:
    """Audit every method's .so in ``path`` against every release in ``runtimes`` (default: runtimes.json), and
    what each release does with its weights. ``lowered_with``: the executorch version that wrote the .pte
    (default: the installed one, the only one whose programs zoo reads)."""
    runtimes = runtimes if runtimes is not None else load_runtimes()
    path = Path(path)
    sos = _method_sos(path)
    symbols = {name: undefined_aoti_symbols(data, what=f"the .so of method {name!r} in {path}")
               for name, data in sos.items()}
    # An artifact that imports what only zoo's runtime build adds (runtimes.json "features") gets that build's row
    # beside the stock releases, which cannot load it.
    runtimes = {**runtimes, **zoo_build_rows(runtimes, set().union(*symbols.values()))}
    methods = [audit_so(data, name, symbols[name], runtimes, str(path)) for name, data in sos.items()]
    result = AuditResult(path=str(path), methods=methods, releases={n: r.version for n, r in runtimes.items()})
    result.notes = _notes(result, runtimes)
    result.weights = weights_facts(path)
    result.caveats = release_caveats(result.releases, result.weights, lowered_with or _installed_executorch())
    return result


# --- the weights: what the .ptd holds, what each runtime loads -------------------------------------------------


def _release_tuple(text: str) -> tuple:
    return tuple(int(p) if p.isdigit() else 0 for p in text.split(".")[:2])


def _installed_executorch() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("executorch")
    except PackageNotFoundError:
        return "unknown"


def weights_facts(path: Union[str, Path]) -> Optional[Dict]:
    """What the artifact's ``.ptd`` holds of each method's weights, read from its index (no weights read):
    each method's blob size, which keys share a segment (byte-identical blobs stored once), and the GPU
    memory the weights take with every method loaded, each method keeping its own copy (ExecuTorch 1.2's CUDA
    backend, and later ones without the sharing option) or one copy for all. None without a ``.ptd``.
    Also the mutable buffers (``so/<method>.io.json``) that two methods hold under one name: the sharing
    option shares constants by name and cannot tell them apart from weights."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    ptd = folder / PTD_NAME
    if path.suffix == ".so" or not ptd.is_file():
        return None
    entries = [e for e in read_ptd_entries(ptd) if e.key.endswith(WEIGHTS_SUFFIX)]
    if not entries:
        return None
    blobs = {e.key[: -len(WEIGHTS_SUFFIX)]: e.size for e in entries}
    by_segment: Dict[tuple, List[str]] = {}
    for e in entries:
        by_segment.setdefault((e.offset, e.size), []).append(e.key[: -len(WEIGHTS_SUFFIX)])
    segments = list(by_segment.values())
    buffers: Dict[str, List[str]] = {}
    run = RunFolder(folder)
    for method in blobs:
        order = run.io_order_file(method)
        if order.is_file():
            for name in (json.loads(order.read_text()).get("mutable_buffers") or {}):
                buffers.setdefault(name, []).append(method)
    # "shared": some methods' blobs are one segment (the methods of a constant-plan group: zoo.export.lower.constant_plan).
    # One copy is every segment once: the weights of each group, and of each method on its own.
    return {"ptd_bytes": ptd.stat().st_size, "blobs": blobs, "segments": segments,
            "shared": any(len(segment) > 1 for segment in segments),
            "gpu_bytes_each_method_own_copy": sum(blobs.values()),
            "gpu_bytes_one_copy": sum(blobs[segment[0]] for segment in segments),
            "mutable_buffers_in_several_methods": {k: v for k, v in buffers.items() if len(v) > 1}}


def how_blobs_are_stored(segments: Sequence[Sequence[str]], quote: str = "") -> str:
    """The ``.ptd``'s segments (``weights_facts``) in words: which methods' weights blobs are stored once."""
    names = lambda segment: " = ".join(f"{quote}{m}{quote}" for m in segment)  # noqa: E731
    if not any(len(segment) > 1 for segment in segments):
        return "each method's weights blob is stored apart"
    if len(segments) == 1:
        return "every method's weights blob is the same bytes, stored once"
    return ("the methods that read the same weights have one blob, stored once: "
            + "; ".join(names(segment) for segment in segments if len(segment) > 1))


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def weights_lines(w: Dict) -> List[str]:
    """The weights facts in words: the .ptd against one copy, the GPU memory with every method loaded."""
    blobs, one, own = w["blobs"], w["gpu_bytes_one_copy"], w["gpu_bytes_each_method_own_copy"]
    names = ", ".join(f"{m} {_gib(b)}" for m, b in blobs.items())
    if w["shared"]:
        stored = (f"{PTD_NAME} is {_gib(w['ptd_bytes'])} for one copy of the weights ({_gib(one)}, "
                  f"{w['ptd_bytes'] / one:.2f}x): {how_blobs_are_stored(w['segments'])}")
    else:
        stored = (f"{PTD_NAME} is {_gib(w['ptd_bytes'])}, {w['ptd_bytes'] / one:.2f}x the methods' weights blobs "
                  f"({_gib(one)}): each method's blob is stored" + (" apart" if len(blobs) > 1 else ""))
    lines = [f"weights blobs: {names}", stored]
    if len(blobs) > 1:
        lines.append(f"GPU memory for the weights with all {len(blobs)} methods loaded, where each method keeps "
                     f"its own copy (ExecuTorch 1.2; later releases without {SHARING_OPTION}): {_gib(own)} "
                     "(the sum of the blobs; read in the runtime's source, measured numbers: docs/gpu-results.md)")
    return lines


def release_caveats(releases: Dict[str, str], weights: Optional[Dict], lowered_with: str) -> Dict[str, List[str]]:
    """Per release, what the symbol audit alone does not show: how it loads the weights of several methods,
    and whether a .pte written by ``lowered_with`` can run on it. Read in each release's source, not run."""
    old_writer = lowered_with == "unknown" or _release_tuple(lowered_with) < FIRST_SHARING_RELEASE
    caveats: Dict[str, List[str]] = {}
    for release in releases:
        notes: List[str] = []
        newer = _release_tuple(release) >= FIRST_SHARING_RELEASE
        if weights and len(weights["blobs"]) > 1:
            own = _gib(weights["gpu_bytes_each_method_own_copy"])
            if not newer:
                notes.append(f"each method's container copies its own weights blob onto the GPU: {own} with every "
                             "method loaded; no runtime option changes that (read in the runtime's source)")
            elif weights["shared"]:
                text = (f"with the CUDA backend option {SHARING_OPTION}=true, a method whose every constant is "
                        f"already loaded by name loads no second copy: {_gib(weights['gpu_bytes_one_copy'])} for "
                        f"all methods instead of {own}; only for an artifact lowered with executorch >= 1.3 "
                        f"(this one: {lowered_with})")
                shared_buffers = weights.get("mutable_buffers_in_several_methods") or {}
                if shared_buffers:
                    text += (f"; the option would also share the mutable buffers {sorted(shared_buffers)} between "
                             "the methods (it shares by name)")
                notes.append(text + " (read in the runtime's source, not run)")
            else:
                notes.append(f"the methods' weights blobs differ: with {SHARING_OPTION}=true a method with any "
                             f"constant not yet loaded loads its whole blob, so still {own} (read in the runtime's "
                             "source, not run)")
        if newer and old_writer:
            notes.append(f"by reading the runtime source; not run: from 1.3.0 the CUDA backend's execute refuses "
                         f"delegate inputs and outputs whose serialized device_type is not CUDA, and a .pte written "
                         f"by executorch {lowered_with} records none (read as CPU): this artifact probably loads "
                         "but fails its first execute (\"Tensor 0 expected device_type=CUDA (1), got 0\")")
        if notes:
            caveats[release] = notes
    return caveats


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
    parser.add_argument("--require", metavar="RELEASE", help="exit 1 unless this release (1.2; or zoo's build "
                        "of it with a feature, 1.2+cublas-gemm) can load the artifact")
    args = parser.parse_args(argv)
    try:
        runtimes = load_runtimes()
        required = _required_release(args.require, runtimes) if args.require else None
        result = audit_artifact(args.path, runtimes)
    except ZooError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(json.dumps(result.as_dict(), indent=2) if args.json else result.table(title=True))
    if required is not None:
        ok = all(set(m.symbols) <= required.symbols for m in result.methods)
    else:
        ok = bool(result.loadable_releases())
    return EXIT_OK if ok else EXIT_CHECK_FAILED


def _required_release(name: str, runtimes: Dict[str, Release]) -> Release:
    """``--require``'s release: one of the table's (``1.2``), or zoo's build of one with features
    (``1.2+cublas-gemm``)."""
    base, *wanted = name.split("+")
    features = load_features()
    if base not in runtimes or any(f not in features or base not in features[f].releases for f in wanted):
        rows = [*runtimes, *(row_name(r, [f]) for f, feature in features.items() for r in feature.releases)]
        raise LoweringError(f"unknown runtime release {name!r}", f"releases in the table: {', '.join(rows)}")
    return with_features(runtimes[base], [features[f] for f in wanted]) if wanted else runtimes[base]


# --- tested by running: the audit's prediction against a runtime that ran the artifact ----------------------------


def release_of(version: str) -> str:
    """The release a runtime version belongs to, as runtimes.json names them: ``1.2.0`` and ``1.2.0a0`` -> ``1.2``."""
    return ".".join(version.strip().split(".")[:2])


def audit_agreement(audited: AuditResult, version: str, ran: bool, why: str = "", gpu: str = "",
                    features: Sequence[str] = ()) -> Dict:
    """The audit's prediction for the release of runtime ``version`` (built by zoo with ``features``, the ones
    the artifact needs that the runtime has) next to what running it showed (``ran``: it loaded and every call
    returned; ``why``: else, the failure; ``gpu``: where). A disagreement either way is a finding: the audit or
    the artifact needs fixing. ``reason`` says why the audit predicts a failure."""
    release = row_name(release_of(version), features)
    tested = f"by running: ok on {gpu or 'a GPU'}" if ran else f"by running: FAILED: {why or '?'}"
    record = {"release": release, "version": version, "ran": ran, "why": why, "tested": tested}
    if release not in audited.releases:
        return {**record, "predicted_loadable": None, "agrees": None, "missing": [], "reason": "",
                "verdict": f"the audit has no release {release!r} (runtime {version}); ran: {ran}"}
    predicted = audited.loadable(release)
    missing = sorted({s for m in audited.methods for s in m.missing[release]})
    reason = f"{release} lacks {', '.join(missing)}" if missing else ""
    if predicted and ran:
        verdict = f"{release}: loadable by the audit, and it ran"
    elif not predicted and not ran:
        verdict = f"{release}: not loadable by the audit ({reason}), and it failed to run, as predicted"
    elif predicted:
        verdict = f"{release}: the audit calls it loadable, but it failed to run: {why}"
    else:
        verdict = f"{release}: the audit says not loadable ({reason}), but it ran"
    return {**record, "predicted_loadable": predicted, "agrees": predicted == ran, "missing": missing,
            "reason": reason, "verdict": verdict}


def mark_tested(audited: AuditResult, agreement: Dict) -> None:
    """Put what running showed into the audit's table (its ``tested`` column); a disagreement is a finding."""
    release = agreement.get("release")
    if release in audited.releases:
        audited.tested[release] = agreement["tested"]
    if agreement.get("agrees") is False and agreement["verdict"] not in audited.findings:
        audited.findings.append(agreement["verdict"])
