"""What each ExecuTorch CUDA runtime release can run, and how zoo asks ExecuTorch's CUDA backend to compile for it:
the release table (``zoo/data/runtimes.json``: dtypes and ``aoti_torch_*`` symbols per release), the fallback
allow-list, the compile specs, and ``RuntimeRequirement`` (``runtime.json``: the release an artifact needs, checked
against a zoo_runner build). Why an artifact is tied to one release line: docs/ARCHITECTURE.md, "Audit and
verification".
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set

from zoo.core.errors import LoweringError, RuntimeMismatch, ZooError

RUNTIMES_JSON = Path(__file__).resolve().parents[1] / "data" / "runtimes.json"


@dataclass
class Release:
    name: str
    version: str
    dtypes: List[str]
    symbols: Set[str]
    allowed_fallback_kernels: Set[str]


def load_runtimes(path: Path = RUNTIMES_JSON) -> Dict[str, Release]:
    """The releases in ``runtimes.json``, each resolved through its ``base`` chain to full sets."""
    raw = json.loads(Path(path).read_text())["releases"]
    resolved: Dict[str, Release] = {}

    def resolve(name: str, seen: tuple = ()) -> Release:
        if name in resolved:
            return resolved[name]
        if name in seen or name not in raw:
            raise LoweringError(f"{path}: release {name!r} has a missing or circular base", "fix runtimes.json")
        entry = raw[name]
        base = resolve(entry["base"], seen + (name,)) if entry.get("base") else None
        release = Release(
            name=name, version=entry["version"],
            dtypes=(list(base.dtypes) if base else []) + [d for d in entry["dtypes"] if not base or d not in base.dtypes],
            symbols=(set(base.symbols) if base else set()) | set(entry["symbols"]),
            allowed_fallback_kernels=(set(base.allowed_fallback_kernels) if base else set())
            | set(entry["allowed_fallback_kernels"]))
        resolved[name] = release
        return release

    for name in raw:
        resolve(name)
    return {name: resolved[name] for name in raw}


@dataclass
class Feature:
    """What zoo's runtime build adds to ExecuTorch's runtime of some releases (runtimes.json "features")."""

    name: str
    about: str
    releases: List[str]
    symbols: Set[str]
    fallback_kernels: Set[str]


GEMM_CHOICES = ("triton", "cublas", "autotune")  # recipe lowering.gemm: ExecuTorch's default, cuBLAS, either per GEMM
GEMM_FEATURE = "cublas-gemm"


def load_features(path: Path = RUNTIMES_JSON) -> Dict[str, Feature]:
    raw = json.loads(Path(path).read_text()).get("features") or {}
    return {name: Feature(name=name, about=entry["about"], releases=list(entry["releases"]),
                          symbols=set(entry["symbols"]), fallback_kernels=set(entry["fallback_kernels"]))
            for name, entry in raw.items()}


def gemm_features(gemm: str) -> List[Feature]:
    """What zoo's runtime build must add for GEMMs computed as recipe ``lowering.gemm`` says: its cuBLAS shims for
    ``cublas`` and ``autotune``, nothing for ExecuTorch's own ``triton``."""
    return [load_features()[GEMM_FEATURE]] if gemm != "triton" else []


def lowering_features(lowering: Any) -> List[str]:
    """The features an artifact lowered with these recipe settings may need from the runtime (none by default)."""
    return [f.name for f in gemm_features(getattr(lowering, "gemm", "triton"))]


def row_name(release: str, features: Sequence[str]) -> str:
    """The audit's row for ``release`` built by zoo with ``features``: ``1.2+cublas-gemm``; the release alone when
    there are none."""
    return "+".join([release, *sorted(features)])


def with_features(release: Release, features: Sequence[Feature]) -> Release:
    """``release`` as zoo's runtime build of it, with ``features`` added."""
    return Release(name=row_name(release.name, [f.name for f in features]),
                   version=f"{release.version} built by zoo", dtypes=list(release.dtypes),
                   symbols=set(release.symbols).union(*(f.symbols for f in features)),
                   allowed_fallback_kernels=set(release.allowed_fallback_kernels).union(
                       *(f.fallback_kernels for f in features)))


def features_for(symbols: Set[str], features: Optional[Dict[str, Feature]] = None) -> List[Feature]:
    """The features of zoo's runtime build whose shims an artifact importing ``symbols`` calls."""
    features = load_features() if features is None else features
    return [f for f in features.values() if f.symbols & symbols]


def zoo_build_rows(runtimes: Dict[str, Release], symbols: Set[str],
                   features: Optional[Dict[str, Feature]] = None) -> Dict[str, Release]:
    """The zoo-built releases an artifact importing ``symbols`` needs beside the stock ones: for each release that
    zoo builds with every feature whose symbols the artifact imports, one row; none when it imports none."""
    needed = features_for(symbols, features)
    rows: Dict[str, Release] = {}
    for name, release in runtimes.items():
        if needed and all(name in f.releases for f in needed):
            row = with_features(release, needed)
            rows[row.name] = row
    return rows


def supported_fallback_kernels() -> Set[str]:
    """The installed executorch's compile-time allow-list of ATen fallback kernels."""
    from executorch.backends.cuda.cuda_backend import CudaBackend

    return set(CudaBackend.get_supported_fallback_kernels())


def compile_specs(method: str, triton_kernel_mode: str) -> list:
    """``CudaPartitioner``'s compile specs for one method: its name, and whether SDPA uses the Triton kernel."""
    from executorch.backends.cuda.cuda_backend import CudaBackend
    from executorch.exir.backend.compile_spec_schema import CompileSpec

    return [CudaBackend.generate_method_name_compile_spec(method),
            CompileSpec("triton_kernel_mode", triton_kernel_mode.encode("utf-8"))]


# --- what an artifact needs from the runtime that runs it ------------------------------------------------------------

BUILD_COMMAND = "scripts/build_runtime.sh v{version} build/runtime"  # a tag, cloned; offline: --tarball FILE


def release_of(version: str) -> str:
    """``1.2.0`` and ``1.2.0a0`` -> ``1.2``: the release line runtimes.json and runtime.json name."""
    return ".".join(str(version).strip().split(".")[:2])


@dataclass
class RuntimeRequirement:
    """``runtime.json``: the ExecuTorch runtime release a lowered artifact needs, and how its graph I/O is planned
    (per method, which inputs and outputs live in the method's planned host memory)."""

    release: str  # "1.2"
    lowered_with: str  # the executorch package that lowered it, "1.2.0"
    memory_planned: Dict[str, Dict[str, List[bool]]] = field(default_factory=dict)
    inferred: bool = False  # a run lowered before zoo wrote runtime.json: read from its report and model.pte
    features: List[str] = field(default_factory=list)  # what it needs of zoo's runtime build (runtimes.json)

    @property
    def device_io(self) -> bool:
        """No method plans a graph input or output: any input may be a GPU pointer and outputs can stay there. A
        requirement that knows no method's plan (a model.pte this executorch could not read) claims nothing."""
        return bool(self.memory_planned) and not any(any(p["inputs"]) or any(p["outputs"]) for p in self.memory_planned.values())

    def planned_inputs(self, method: str) -> List[bool]:
        return list(self.memory_planned.get(method, {}).get("inputs", []))

    def as_dict(self) -> Dict[str, Any]:
        record = asdict(self)
        record["device_io"] = self.device_io
        return record

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "runtime.json") -> "RuntimeRequirement":
        try:
            planned = {str(m): {"inputs": [bool(x) for x in p["inputs"]], "outputs": [bool(x) for x in p["outputs"]]}
                       for m, p in dict(data.get("memory_planned") or {}).items()}
            return cls(release=str(data["release"]), lowered_with=str(data["lowered_with"]), memory_planned=planned,
                       inferred=bool(data.get("inferred", False)),
                       features=[str(f) for f in data.get("features") or []])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ZooError(f"{where} is not a runtime requirement ({type(exc).__name__}: {exc})",
                           "lower the run again (`python -m zoo lower RUN_DIR`) to rewrite it") from None

    def describe(self) -> str:
        io = ("graph inputs and outputs are not memory-planned: state stays on the GPU between calls"
              if self.device_io else "some graph inputs or outputs are memory-planned: state handed from call to "
              "call crosses to the host")
        needs = f", built by zoo with {', '.join(self.features)}" if self.features else ""
        return f"ExecuTorch runtime {self.release}{needs} (lowered with executorch {self.lowered_with}); {io}"

    def check(self, runner_info: Mapping[str, Any], runner: Any = "zoo_runner") -> None:
        """Refuse a zoo_runner build of another release than the artifact's (its ``--info``)."""
        version = str(runner_info.get("executorch_version") or "unknown")
        if release_of(version) == self.release:
            missing = [f for f in self.features if f not in (runner_info.get("features") or [])]
            if missing:
                raise RuntimeMismatch(
                    f"the artifact needs {', '.join(missing)} from zoo's build of ExecuTorch's runtime "
                    f"{self.release} (its lowering used them: runtime.json); {runner} was built without",
                    "build the runtime with zoo's script, which adds them: "
                    f"{BUILD_COMMAND.format(version=self.lowered_with)} (docs/runtime.md), or lower the run again "
                    "with lowering.gemm=triton")
            return
        why = ("; its graph I/O is left out of memory planning and its state kept on the GPU through that release's "
               "CUDA backend") if self.device_io else ""
        raise RuntimeMismatch(
            f"the artifact needs ExecuTorch's runtime {self.release} (lowered with executorch {self.lowered_with}"
            f"{why}); {runner} is ExecuTorch {version}",
            f"build zoo_runner from ExecuTorch {self.release}'s source: "
            f"{BUILD_COMMAND.format(version=self.lowered_with)} (docs/runtime.md), or lower the run again with the "
            "executorch release of the runtime you have")


def lowering_requirement(executorch_version: str, memory_planned: Mapping[str, Mapping[str, List[bool]]],
                         features: Sequence[str] = ()) -> RuntimeRequirement:
    """What a lowering by ``executorch_version`` that planned the methods' I/O as given, with ``features`` of
    zoo's runtime build, needs at runtime."""
    return RuntimeRequirement(release=release_of(executorch_version), lowered_with=executorch_version.split("+")[0],
                              memory_planned={m: {"inputs": list(p["inputs"]), "outputs": list(p["outputs"])}
                                              for m, p in memory_planned.items()}, features=list(features))


def requirement_for(run: Any, read_planned: Optional[Any] = None) -> RuntimeRequirement:
    """The run folder's ``runtime.json``; for a run lowered before zoo wrote it, inferred from its report (the
    executorch that lowered it, else the recipe's target runtime) and ``read_planned(pte)`` (zoo.contract.artifact's
    ``io_memory_planning``) over its model.pte."""
    data = run.read_runtime_requirement()
    if data is not None:
        return RuntimeRequirement.from_dict(data, str(run.runtime_file))
    version = None
    if run.report_json.is_file():
        lowering = run.read_report().data.get("lowering") or {}
        version = (lowering.get("options") or {}).get("executorch")
    if not version or version == "unknown":
        recipe = run.recipe_dict() or {}
        version = str((recipe.get("lowering") or {}).get("runtime") or "1.2") + ".0"
    planned: Dict[str, Any] = {}
    if read_planned is not None and run.pte.is_file():
        try:
            planned = read_planned(run.pte)
        except ZooError:  # not a program this executorch reads: the runtime will say more when it loads it
            planned = {}
    requirement = lowering_requirement(version, planned)
    requirement.inferred = True
    return requirement
