"""manifest.json: what a verified run folder contains and where it came from, with a sha256 for every file.

The pipeline calls ``write_manifest(run_dir, report)`` once verification has passed. Publishing re-hashes
every file and refuses when anything differs, so what reaches the Hub is byte for byte what was verified.
The verification, audit and rewrite tables are copied from the run report, never passed in separately.
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Union

from zoo import __version__
from zoo.core import atomic
from zoo.contract.artifact import io_memory_planning
from zoo.core.errors import PublishRefused, ZooError
from zoo.export.publish.model_card import resolve_license
from zoo.core.progress import steps
from zoo.core.report import RunReport
from zoo.contract.run_folder import ARTIFACT_FILES, MANIFEST_JSON, RunFolder
from zoo.contract.releases import requirement_for
from zoo.contract.gpu_targets import artifact_summary

FORMAT = "zoo-manifest/1"

# Distributions whose versions decide whether the artifact can be reproduced or loaded.
VERSIONED = ("torch", "executorch", "lerobot", "huggingface_hub", "safetensors")

_CHUNK = 8 << 20  # artifacts reach gigabytes: hash in chunks, never read a whole file into memory


def sha256_file(path: Union[str, Path]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def artifact_files(run_dir: Union[RunFolder, Path]) -> List[str]:
    """Paths (relative, POSIX) of every file that is published from ``run_dir``, sorted: the artifact files
    (``run_folder.ARTIFACT_FILES``), each method's delegate I/O order (``so/<method>.io.json``: the policy
    runner's artifact backend feeds a downloaded artifact's ``.so`` files with it) and, if present, ``runtime.json``
    (the ExecuTorch runtime release it needs) and all of ``processors/``.

    Hidden names are left out: they are interrupted atomic writes (``.<name>.tmp-*``), never artifacts.
    """
    run = RunFolder(run_dir)
    missing = [name for name in ARTIFACT_FILES if not (run.path / name).is_file()]
    if missing:
        raise PublishRefused(f"run folder {run.path} has no {', '.join(missing)}",
                             "lower and verify the run first; only a finished run folder can be published")
    files = list(ARTIFACT_FILES) + [path.relative_to(run.path).as_posix() for path in run.io_order_files()]
    if run.runtime_file.is_file():
        files.append(run.runtime_file.relative_to(run.path).as_posix())
    if run.processors_dir.is_dir():
        for path in sorted(run.processors_dir.rglob("*")):
            rel = path.relative_to(run.path)
            if path.is_file() and not any(part.startswith(".") for part in rel.parts):
                files.append(rel.as_posix())
    return sorted(files)


def file_table(run_dir: Union[RunFolder, Path]) -> Dict[str, Dict[str, Any]]:
    run_dir = RunFolder(run_dir).path
    return {rel: {"sha256": sha256_file(run_dir / rel), "size": (run_dir / rel).stat().st_size}
            for rel in artifact_files(run_dir)}


def versions() -> Dict[str, Optional[str]]:
    """Versions of the packages in this process; None for one that is not installed (lerobot on a GPU box).

    Read from package metadata, so lerobot is never imported by the core; torch's own version string is
    used instead because only it names the CUDA build (``2.11.0+cu130``), which the metadata drops.
    """
    import torch

    found: Dict[str, Optional[str]] = {"zoo": __version__, "python": platform.python_version()}
    for dist in VERSIONED:
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = None
    found["torch"] = torch.__version__
    found["cuda"] = torch.version.cuda
    return found


def gpu_from(section: Any) -> Optional[Dict[str, Optional[str]]]:
    """GPU name and compute capability recorded in a report section ("lowering" or "verification").

    Accepted: ``{"gpu": {"name": .., "capability": "90"}}`` (zoo.export.lower.lowering's record), ``"compute_capability"``
    for the capability key, or a flat ``{"gpu": "NVIDIA H200", "compute_capability": "9.0"}``. The capability
    is normalised to ``"major.minor"``: ``"90"``, ``[9, 0]`` and ``"9.0"`` all become ``"9.0"``.
    """
    if not isinstance(section, Mapping):
        return None
    gpu = section.get("gpu")
    nested: Mapping[str, Any] = gpu if isinstance(gpu, Mapping) else section
    name = nested.get("name") if gpu is nested else (gpu if isinstance(gpu, str) else section.get("gpu_name"))
    cap = nested.get("compute_capability", nested.get("capability"))
    if name is None and cap is None:
        return None
    return {"name": name, "compute_capability": _capability(cap)}


def gpus_section(data: Mapping[str, Any]) -> Dict[str, Any]:
    """The manifest's ``gpu``: the GPU the kernels were built for (the lowering's ``--target``, else the GPU it ran
    on), where it was lowered and verified, and what the audit read from the binary: host machines, kernel
    images, the GPUs of zoo's table that run it (as is, through PTX) and those that do not, and why."""
    lowering = data.get("lowering")
    lowered_on = gpu_from(lowering)
    target = ((lowering or {}).get("gpu") or {}).get("target") if isinstance(lowering, Mapping) else None
    built_for = ({"name": target.get("label"), "compute_capability": _capability(target.get("capability"))}
                 if isinstance(target, Mapping) else lowered_on)
    audit = data.get("audit") if isinstance(data.get("audit"), Mapping) else {}
    kernels = (artifact_summary(audit["gpus"], list(audit.get("methods") or []))
               if isinstance(audit.get("gpus"), Mapping) else None)
    return {"built_for": built_for, "lowered_on": lowered_on, "target": target.get("name") if target else None,
            "verified_on": gpu_from(data.get("verification")), "kernels": kernels}


def _capability(cap: Any) -> Optional[str]:
    if cap is None:
        return None
    if isinstance(cap, (list, tuple)):
        return ".".join(str(int(x)) for x in cap)
    text = str(cap).strip().lower().replace("sm_", "")
    if text.isdigit() and len(text) >= 2:  # torch's "sm_XY" spelling: the last digit is the minor version
        return f"{text[:-1]}.{text[-1]}"
    return text


# Keys of report sections that hold paths on the exporting machine: they mean nothing to whoever downloads the
# artifact and may name a user's home folder, so the published manifest leaves them out.
LOCAL_PATH_KEYS = ("path", "out_dir", "run_dir", "local_dir", "cache_dir")


def public_section(value: Any) -> Any:
    """A report section as the manifest publishes it: the same, less its top-level local paths."""
    if isinstance(value, Mapping):
        return {k: v for k, v in value.items() if k not in LOCAL_PATH_KEYS}
    return value


def _report_data(report: Union[RunReport, Mapping[str, Any]]) -> Dict[str, Any]:
    return dict(report.data if isinstance(report, RunReport) else report)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as exc:
        raise PublishRefused(f"{path} is not valid JSON ({exc})", "re-run the step that writes it") from None


def _runtime_record(run: RunFolder) -> Optional[Dict[str, Any]]:
    """The runtime release the artifact needs (runtime.json, or inferred for a run lowered before zoo wrote it);
    None when the .pte cannot tell."""
    try:
        return requirement_for(run, io_memory_planning).as_dict() if run.pte.is_file() else None
    except ZooError:
        return None


def build_manifest(run_dir: Union[RunFolder, Path], report: Union[RunReport, Mapping[str, Any]],
                   files: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The manifest of a run folder; ``files`` replaces the hashed file table (an unverified preview has none)."""
    run = RunFolder(run_dir)
    data = _report_data(report)
    recipe = run.recipe_dict()
    if recipe is None:
        recipe = dict(data.get("recipe") or {})
    source = _read_json(run.source_file) or {}
    return {
        "format": FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "recipe": recipe,
        "overrides": list(data.get("overrides") or []),
        # Paths on the exporting machine (path, local_dir, cache_dir) mean nothing to whoever downloads it.
        "source": {k: source.get(k) for k in ("repo_id", "revision", "commit", "fabricated")},
        "license": resolve_license(source, recipe),
        "versions": versions(),
        "gpu": gpus_section(data),
        "rewrites": public_section(data.get("rewrites")),
        "audit": public_section(data.get("audit")),
        "verification": public_section(data.get("verification")),
        "policy_check": public_section(data.get("policy_check")),
        "runtime": _runtime_record(run),
        "files": file_table(run.path) if files is None else files,
    }


def write_manifest(run_dir: Union[RunFolder, Path], report: Union[RunReport, Mapping[str, Any]]) -> Path:
    """Write ``RUN_DIR/manifest.json`` from the run folder and its report; return its path."""
    run = RunFolder(run_dir)
    return atomic.write_json(run.manifest_file, build_manifest(run, report))


def read_manifest(run_dir: Union[RunFolder, Path]) -> Dict[str, Any]:
    path = RunFolder(run_dir).manifest_file
    manifest = _read_json(path)
    if manifest is None:
        raise PublishRefused(f"{path} does not exist: the run never finished verification",
                             "a run gets its manifest when verification passes; finish the run on a CUDA machine")
    if not (isinstance(manifest, dict) and manifest.get("format") == FORMAT
            and isinstance(manifest.get("files"), dict)):
        raise PublishRefused(f"{path} is not a {FORMAT} manifest", "re-run verification to rewrite it")
    return manifest


def check_files(run_dir: Union[RunFolder, Path], manifest: Mapping[str, Any]) -> None:
    """Refuse unless the run folder's artifact files are exactly the manifest's, with the same sha256."""
    run_dir = RunFolder(run_dir).path
    listed: Dict[str, Dict[str, Any]] = dict(manifest["files"])
    present = set(artifact_files(run_dir))
    problems = [f"{rel}: listed in {MANIFEST_JSON} but missing" for rel in sorted(set(listed) - present)]
    problems += [f"{rel}: present but not in {MANIFEST_JSON}" for rel in sorted(present - set(listed))]
    for rel in steps(sorted(present & set(listed)), "check file hashes", unit="file"):
        actual = sha256_file(run_dir / rel)
        if actual != listed[rel].get("sha256"):
            problems.append(f"{rel}: sha256 {actual} differs from {MANIFEST_JSON}'s {listed[rel].get('sha256')}")
    if problems:
        raise PublishRefused("the run folder no longer matches what was verified:\n    " + "\n    ".join(problems),
                             "restore the original files, or re-run lowering and verification to produce a new "
                             "verified artifact")
