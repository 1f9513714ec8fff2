"""What a lowering leaves behind: the methods' parts written into the run folder as one ``model.pte`` + ``.ptd`` (the
``.pte`` last, so it commits the artifact), each method's ``.so``, weights and I/O order under ``so/``, and the
records the run report keeps (``MethodArtifact``, ``LoweringResult``).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
from torch.export import ExportedProgram

from zoo.contract.artifact import PTD_NAME, PTE_NAME, SO_SUFFIX, WEIGHTS_SUFFIX, extract_method_files, weights_file_name
from zoo.contract.releases import RuntimeRequirement
from zoo.contract.run_folder import RunFolder
from zoo.core.errors import LoweringError
from zoo.core.report import format_table
from zoo.export.lower.assemble import assemble_program
from zoo.export.lower.workers import MethodPart


@dataclass
class MethodArtifact:
    """One lowered method: where its .so and weights went, and how its delegate orders inputs and outputs.

    ``input_order[k]`` is the method input (signature position) the .so takes as its k-th input;
    ``output_order[j]`` is the .so output that is the method's j-th output.
    """

    name: str
    so: str  # relative to the output folder
    weights: str
    io: str
    so_bytes: int
    weights_bytes: int
    input_names: List[str]
    output_names: List[str]
    input_order: List[int]
    output_order: List[int]
    # Buffers the method mutates; they live inside its .so and are stored in the .ptd once per method.
    mutable_buffers: Dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0  # its worker's wall time (loading the program, lowering, writing its part)
    stage_seconds: Dict[str, float] = field(default_factory=dict)  # edge, preflight, backend, to_executorch
    constants: Dict[str, Any] = field(default_factory=dict)  # its .so's constant table against the shared plan
    shares_weights_with: Optional[str] = None  # the method whose weights segment (and so/ file) this one names

    def files(self, folder: Path) -> Tuple[Path, Optional[Path]]:
        """Its extracted .so and weights under the lowering's output ``folder`` (None: a method without weights)."""
        return folder / self.so, (folder / self.weights if self.weights else None)

    @property
    def delegate_order(self) -> Dict[str, List[int]]:
        """Its two orders as ``so/<method>.io.json`` holds them, for ``verify.run_in_delegate_order``."""
        return {"input_order": self.input_order, "output_order": self.output_order}


@dataclass
class LoweringResult:
    out_dir: str
    pte: str
    ptd: str
    pte_bytes: int
    ptd_bytes: int
    seconds: float  # wall time of the whole lowering
    compile_seconds: float  # wall time of the methods' lowering (the workers, side by side)
    methods: Dict[str, MethodArtifact]
    options: Dict[str, Any]
    gpu: Dict[str, Any]
    preflight: Optional[Dict[str, Any]] = None
    workers: Dict[str, Any] = field(default_factory=dict)  # how many lowered at once, why, in this process or not
    weights: Dict[str, Any] = field(default_factory=dict)  # the .ptd: which keys share a segment, against the plan
    stage_seconds: Dict[str, float] = field(default_factory=dict)  # plan, save programs, workers, assemble, ...
    runtime: Dict[str, Any] = field(default_factory=dict)  # runtime.json: the release it needs, its I/O planning

    def as_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["methods"] = {k: asdict(v) for k, v in self.methods.items()}
        return d

    def summary(self) -> Dict[str, Any]:
        """The run report's ``lowering`` section: sizes, times, GPU, per-method I/O order, and the table."""
        record = {**self.as_dict(), "table": self.table()}
        record.pop("out_dir")  # a staging folder's path would mislead once the run is moved into place
        return record

    def table(self) -> str:
        rows = [["method", "worker", ".so", "weights", "mutable buffers", "inputs (.so order)", "outputs (.so order)"]]
        for m in self.methods.values():
            rows.append([m.name, f"{m.seconds:.1f} s", _mib(m.so_bytes),
                         _mib(m.weights_bytes) + (f" (= {m.shares_weights_with})" if m.shares_weights_with else ""),
                         _mib(sum(m.mutable_buffers.values())) if m.mutable_buffers else "-",
                         m.input_order, m.output_order])
        workers = self.workers
        head = (f"{PTE_NAME} {_mib(self.pte_bytes)}, {PTD_NAME} {_mib(self.ptd_bytes)}, "
                f"lowering {self.seconds:.1f} s wall on {self.gpu.get('name')} (sm_{self.gpu.get('capability')}"
                + (f"; {self.gpu['target']['words']}" if self.gpu.get("target") else "") + "), "
                f"{workers.get('count', 1)} at once ({workers.get('why', '')}"
                f"{', in this process' if workers.get('in_process') else ''})")
        if workers.get("reused"):
            head += (f"; reused from an earlier lowering that stopped (stamp matches): "
                     f"{', '.join(workers['reused'])}")
        if self.weights.get("segments") is not None:
            head += "\n" + weights_line(self.weights)
        if self.runtime:
            head += "\nneeds " + RuntimeRequirement.from_dict(self.runtime).describe()
        return head + "\n" + format_table(rows)


def weights_line(weights: Mapping[str, Any]) -> str:
    """One line on what the .ptd holds: which methods' weights share a segment, its size against the plan."""
    shared = [keys for keys in weights["segments"] if len(keys) > 1]
    text = (f"{PTD_NAME}: " + ("; ".join(" = ".join(k[: -len(WEIGHTS_SUFFIX)] if k.endswith(WEIGHTS_SUFFIX) else k
                                                  for k in keys) + " (one segment)" for keys in shared)
                               if shared else "no entries share a segment"))
    if weights.get("plan_bytes"):
        text += (f"; {_mib(weights['file_bytes'])} for {_mib(weights['plan_bytes'])} of planned constants "
                 f"({weights['file_bytes'] / weights['plan_bytes']:.3f}x)")
    return text


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def program_files(programs: Mapping[str, Union[ExportedProgram, Path]], folder: Path,
                   stage_seconds: Dict[str, float]) -> Tuple[Dict[str, Path], List[Path]]:
    """Where each worker loads its program from: the file given, or the program saved into ``folder``."""
    files: Dict[str, Path] = {}
    saved: List[Path] = []
    mark = time.perf_counter()
    for method, program in programs.items():
        if isinstance(program, ExportedProgram):
            folder.mkdir(parents=True, exist_ok=True)
            files[method] = RunFolder(folder).program("rewritten", method)  # a scratch folder, run-folder names
            torch.export.save(program, str(files[method]))
            saved.append(files[method])
        else:
            files[method] = Path(program)
    if saved:
        stage_seconds["save_programs"] = round(time.perf_counter() - mark, 3)
    return files, saved


def write_artifacts(parts: Mapping[str, MethodPart], run: RunFolder, stage_seconds: Dict[str, float],
                    assembled_hook: Callable[[], None] = lambda: None
              ) -> Tuple[Dict[str, MethodArtifact], Optional[Dict[str, Any]]]:
    """The I/O orders into ``so/``, the parts merged into model.pte + .ptd (the .pte last), the parts' files
    deleted and ``assembled_hook`` called, each method's .so and weights extracted; returns the MethodArtifacts
    and what the .ptd holds."""
    for method, part in parts.items():
        if not part.record.get("io"):
            raise LoweringError(f"the lowering of method {method!r} recorded no delegate I/O order",
                                "a method lowering function records it as record['io'] (zoo.export.lower.method_lowering.delegate_io_order)")
        run.write_io_order(method, {"method": method, **part.record["io"]})
    mark = time.perf_counter()
    assembled = assemble_program([part.as_program_part() for part in parts.values()], run.path, pte_name=PTE_NAME)
    stage_seconds["assemble"] = round(time.perf_counter() - mark, 3)
    for part in parts.values():  # disk: each part's .ptd holds its method's whole weights
        for path in [part.pte, *part.data_files.values()]:
            path.unlink(missing_ok=True)
    # Before the extraction writes the methods' weights out again: kept parts are hard links of the parts, so
    # at real size (~10 GB a method) they would otherwise hold a second copy of every method's weights on disk.
    assembled_hook()
    mark = time.perf_counter()
    files = extract_method_files(run.pte, run.ptd if run.ptd.exists() else None, run.so_dir)
    stage_seconds["extract"] = round(time.perf_counter() - mark, 3)
    methods: Dict[str, MethodArtifact] = {}
    for name, part in parts.items():
        if name not in files:
            raise LoweringError(f"method {name!r} has no {name}{SO_SUFFIX} in the written .pte",
                                "the CUDA backend did not compile this method; see the lowering log")
        entry, order = files[name], part.record["io"]
        record = {"method": name, **order, "so_bytes": entry["so_bytes"], "weights_bytes": entry["weights_bytes"]}
        io_path = run.write_io_order(name, record)
        methods[name] = MethodArtifact(
            name=name, so=str(entry["so"].relative_to(run.path)),
            weights=str(entry["weights"].relative_to(run.path)) if entry["weights"] else "",
            io=str(io_path.relative_to(run.path)), so_bytes=entry["so_bytes"],
            weights_bytes=entry["weights_bytes"], input_names=order["input_names"],
            output_names=order["output_names"], input_order=order["input_order"],
            output_order=order["output_order"], mutable_buffers=order.get("mutable_buffers", {}),
            seconds=round(part.seconds, 3), stage_seconds=dict(part.record.get("seconds", {})),
            constants=dict(part.record.get("constants", {})),
            shares_weights_with=(entry["shares_weights_with"] or "").removesuffix(weights_file_name("")) or None)
    summary = assembled.data_files.get(PTD_NAME)
    return methods, summary.as_dict() if summary is not None else None


def clean_work_folder(work: Path, keep_logs: bool) -> None:
    """Remove the lowering's scratch folder; after a failure keep the workers' logs and errors (the error
    names them), never the program and part files (GBs each at real size)."""
    if keep_logs and any(work.glob("methods/*/worker.log")):
        for path in sorted(work.rglob("*"), reverse=True):
            if path.is_file() and path.name not in ("worker.log", "error.json"):
                path.unlink()
        return
    shutil.rmtree(work, ignore_errors=True)


def weights_record(decision: Mapping[str, Any], ptd_summary: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The ``weights`` of a ``LoweringResult``: the constant plan's decision, what the .ptd holds, and whether every
    group that got a shared table holds its weights once (its methods' blobs name one segment)."""
    weights = {"plan": decision, "plan_bytes": decision["bytes"] if decision["applied"] else None,
               **(ptd_summary or {"segments": None})}
    if ptd_summary:
        shared = [[m + WEIGHTS_SUFFIX for m in record["methods"]] for record in decision["groups"]
                  if record["applied"]]
        weights["stored_once"] = bool(shared) and all(
            any(set(keys) <= set(segment) for segment in ptd_summary["segments"]) for keys in shared)
    return weights
