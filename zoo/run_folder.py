"""The run folder: zoo's contract between the export half and the deploy half of the product.

The export step writes it, lowering, audit, verification, bench and publishing read it, and so will the policy
runner and the C++ runtime backend. Every file name of the folder is here and only here (the artifact's own
file names, ``model.pte`` and ``aoti_cuda_blob.ptd``, are ``zoo.artifact``'s); every reader and writer goes
through ``RunFolder``:

    recipe.yaml            the resolved recipe (overrides applied)
    source.json            repo id, revision, resolved commit, local path
    io_spec.json           per method: inputs (InputSpec dicts), output names; dynamic dims; example sizes
    host_settings.json     what the host drives the artifact with (steps, shifts, guidance, slots)
    processors/            the policy's normalisation processors (and tokenizer files)
    prompts/               prompt embeddings (`python -m zoo prompt`), one safetensors file per task text
    exported.<m>.pt2       the program torch.export returned (complex values and all): the eager reference
    reference_fp32.<m>.pt2 bf16 recipes: the same unit in float32, to judge bf16 against
    rewritten.<m>.pt2      after the recipe's rewrites: what gets lowered
    model.pte, aoti_cuda_blob.ptd   the lowered artifact (written atomically, .pte last)
    so/<m>.so, so/<m>.weights.blob  each method's compiled code and weights, taken out of the artifact
    so/<m>.io.json         the order in which the method's .so takes its inputs and returns its outputs
    report.json, report.md the run report
    manifest.json          written once verification passed: hashes and provenance
    publish/               the exact folder `python -m zoo.publish` uploads

A run is written into a staging folder beside the run folder and moved into place when it ends
(``prepare``, ``new_staging``, ``replace_with``), so the folder never holds a half-written run.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

import torch
from omegaconf import OmegaConf
from torch.export import ExportedProgram

from . import atomic
from .artifact import PTD_NAME, PTE_NAME, so_file_name, weights_file_name
from .errors import ExportError, LoweringError, ZooError
from .recipes import load_recipe
from .report import RunReport

RECIPE_YAML = "recipe.yaml"
SOURCE_JSON = "source.json"
IO_SPEC_JSON = "io_spec.json"
HOST_SETTINGS_JSON = "host_settings.json"
PROCESSORS_DIR = "processors"
# LeRobot's own processor pipeline files, as the checkpoint ships them (copied into processors/).
PREPROCESSOR_JSON = "policy_preprocessor.json"
POSTPROCESSOR_JSON = "policy_postprocessor.json"
PROMPTS_DIR = "prompts"
PROMPT_SUFFIX = ".safetensors"
REPORT_JSON = "report.json"
REPORT_MD = "report.md"
MANIFEST_JSON = "manifest.json"
PUBLISH_DIR = "publish"
SO_DIR = "so"

# The saved programs of a method: as exported, the float32 reference of a bf16 unit, and as rewritten.
PROGRAM_KINDS = ("exported", "reference_fp32", "rewritten")
# What a failed run leaves in its folder: the report saying why, and the recipe to reproduce it.
KEPT_ON_FAILURE = (REPORT_JSON, REPORT_MD, RECIPE_YAML)
# What is published from a finished run (besides processors/, copied whole, and each method's so/<m>.io.json):
# what a deploy side loads.
ARTIFACT_FILES = (PTE_NAME, PTD_NAME, IO_SPEC_JSON, HOST_SETTINGS_JSON)


class RunFolder:
    """One run folder: the paths of its files, and reading and writing them."""

    def __init__(self, path: Union[str, Path, "RunFolder"]):
        self.path = Path(path.path if isinstance(path, RunFolder) else path)

    def __repr__(self) -> str:
        return f"RunFolder({str(self.path)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunFolder) and other.path == self.path

    def __hash__(self) -> int:
        return hash(self.path)

    @property
    def name(self) -> str:
        return self.path.name

    # --- where each file is ------------------------------------------------------------------------------

    @property
    def recipe_file(self) -> Path:
        return self.path / RECIPE_YAML

    @property
    def source_file(self) -> Path:
        return self.path / SOURCE_JSON

    @property
    def io_spec_file(self) -> Path:
        return self.path / IO_SPEC_JSON

    @property
    def host_settings_file(self) -> Path:
        return self.path / HOST_SETTINGS_JSON

    @property
    def processors_dir(self) -> Path:
        return self.path / PROCESSORS_DIR

    @property
    def preprocessor_file(self) -> Path:
        return self.processors_dir / PREPROCESSOR_JSON

    @property
    def postprocessor_file(self) -> Path:
        return self.processors_dir / POSTPROCESSOR_JSON

    @property
    def prompts_dir(self) -> Path:
        return self.path / PROMPTS_DIR

    def prompt_file(self, task: str) -> Path:
        """Where ``python -m zoo prompt`` puts a task's embedding by default: a readable slug of the text and a
        hash of it (two texts never share a file)."""
        slug = re.sub(r"[^a-z0-9]+", "-", task.lower()).strip("-")[:48] or "empty"
        digest = hashlib.sha256(task.encode("utf-8")).hexdigest()[:8]
        return self.prompts_dir / f"{slug}-{digest}{PROMPT_SUFFIX}"

    def prompt_files(self) -> List[Path]:
        """Every prompt embedding file in ``prompts/``, sorted."""
        if not self.prompts_dir.is_dir():
            return []
        return sorted(p for p in self.prompts_dir.glob("*" + PROMPT_SUFFIX) if not p.name.startswith("."))

    @property
    def report_json(self) -> Path:
        return self.path / REPORT_JSON

    @property
    def report_md(self) -> Path:
        return self.path / REPORT_MD

    @property
    def manifest_file(self) -> Path:
        return self.path / MANIFEST_JSON

    @property
    def publish_dir(self) -> Path:
        return self.path / PUBLISH_DIR

    @property
    def pte(self) -> Path:
        return self.path / PTE_NAME

    @property
    def ptd(self) -> Path:
        return self.path / PTD_NAME

    @property
    def so_dir(self) -> Path:
        return self.path / SO_DIR

    def program(self, kind: str, method: str) -> Path:
        """The ``exported``, ``reference_fp32`` or ``rewritten`` program file of a method."""
        if kind not in PROGRAM_KINDS:
            raise ValueError(f"program kind {kind!r} is not one of {PROGRAM_KINDS}")
        return self.path / f"{kind}.{method}.pt2"

    def so_file(self, method: str) -> Path:
        return self.so_dir / so_file_name(method)

    def weights_file(self, method: str) -> Path:
        return self.so_dir / weights_file_name(method)

    def io_order_file(self, method: str) -> Path:
        return self.so_dir / f"{method}.io.json"

    def io_order_files(self) -> List[Path]:
        """Every ``so/<method>.io.json`` present, sorted (published with the artifact: the runner needs them)."""
        return sorted(self.so_dir.glob("*.io.json")) if self.so_dir.is_dir() else []

    def compiled_methods(self) -> Dict[str, Path]:
        """{method: .so} for every compiled method extracted into ``so/``."""
        return {path.stem: path for path in sorted(self.so_dir.glob(so_file_name("*")))}

    def is_run(self) -> bool:
        """Whether zoo wrote this folder (it holds a run report)."""
        return self.report_json.is_file()

    # --- reading and writing --------------------------------------------------------------------------------

    def write_recipe(self, recipe) -> Path:
        return atomic.write_text(self.recipe_file, recipe.to_yaml())

    def load_recipe(self, overrides: Sequence[str] = ()):
        """The resolved recipe the folder holds, with ``overrides`` applied (and validated again)."""
        if not self.recipe_file.exists():
            raise LoweringError(f"{self.recipe_file} is missing",
                                "export the recipe again (`python -m zoo.export RECIPE`)")
        return load_recipe(str(self.recipe_file), overrides, check_name=False)

    def recipe_dict(self) -> Optional[Dict[str, Any]]:
        """The saved recipe as plain data, exactly as written (no validation); None when there is none."""
        if not self.recipe_file.is_file():
            return None
        return OmegaConf.to_container(OmegaConf.load(self.recipe_file), resolve=True)  # type: ignore[return-value]

    def write_source(self, source: Dict[str, Any]) -> Path:
        return atomic.write_json(self.source_file, source)

    def write_io_spec(self, io_spec: Dict[str, Any]) -> Path:
        return atomic.write_json(self.io_spec_file, io_spec)

    def read_io_spec(self) -> Dict[str, Any]:
        return self._read_json(self.io_spec_file)

    def write_host_settings(self, settings: Dict[str, Any]) -> Path:
        return atomic.write_json(self.host_settings_file, settings)

    def read_host_settings(self) -> Dict[str, Any]:
        return self._read_json(self.host_settings_file)

    def _read_json(self, path: Path) -> Dict[str, Any]:
        """A JSON file the export wrote; a missing or damaged one is a clear error naming the folder."""
        if not path.is_file():
            raise ZooError(f"{path} is missing, so {self.path} is not a complete zoo run folder",
                           "export the recipe again (`python -m zoo.export RECIPE`), or download the whole "
                           "published folder")
        try:
            return json.loads(path.read_text())
        except ValueError as exc:
            raise ZooError(f"{path} is not valid JSON: {exc}", "export the recipe again") from None

    def copy_host_files(self, files: Iterable[Union[str, Path]]) -> List[str]:
        """Copy the unit's host files (normalisation processors, tokenizer files) flat into ``processors/``."""
        copied = []
        for src in files:
            src = Path(src)
            if not src.exists():
                raise ExportError(f"the unit lists host file {src}, which does not exist",
                                  "the family must list only files present in the checkpoint")
            self.processors_dir.mkdir(parents=True, exist_ok=True)
            if src.is_dir():
                shutil.copytree(src, self.processors_dir / src.name, dirs_exist_ok=True)
            else:
                shutil.copy2(src, self.processors_dir / src.name)
            copied.append(src.name)
        return copied

    def save_program(self, program: ExportedProgram, kind: str, method: str) -> Path:
        path = self.program(kind, method)
        with atomic.atomic_path(path) as tmp:
            with open(tmp, "wb") as fh:
                torch.export.save(program, fh)
        return path

    def load_program(self, kind: str, method: str) -> ExportedProgram:
        return torch.export.load(str(self.program(kind, method)))

    def write_io_order(self, method: str, record: Dict[str, Any]) -> Path:
        return atomic.write_json(self.io_order_file(method), record)

    def io_order(self, method: str) -> Dict[str, Any]:
        """How the method's .so orders its inputs and outputs (``input_order``, ``output_order``, names)."""
        path = self.io_order_file(method)
        if not path.exists():
            raise LoweringError(f"{path} is missing: the delegate I/O order of method {method!r} is unknown",
                                "lower the run again (`python -m zoo.lower RUN_DIR`); it writes "
                                f"{SO_DIR}/<method>.io.json")
        return json.loads(path.read_text())

    def read_report(self) -> RunReport:
        """The report the folder holds (an empty one when it holds none), to read or to continue."""
        if not self.report_json.exists():
            return RunReport(self.path)
        return RunReport.from_data(self.path, json.loads(self.report_json.read_text()))

    def write_report(self, report: RunReport) -> None:
        atomic.write_json(self.report_json, report.data)
        atomic.write_text(self.report_md, report.markdown())

    # --- a run's life: staged beside the folder, then moved into place -------------------------------------

    def prepare(self) -> "RunFolder":
        """The folder a run may be written to, resolved: new, empty, or an earlier zoo run (it gets replaced);
        anything else is refused, so that a mistyped --output-dir never deletes someone's files."""
        path = self.path.expanduser().resolve()
        if path.exists():
            if not path.is_dir():
                raise ZooError(f"output folder {path} exists and is a file", "choose another --output-dir")
            if any(path.iterdir()) and not RunFolder(path).is_run():
                raise ZooError(f"output folder {path} is not empty and holds no zoo run (no {REPORT_JSON})",
                               "choose a new or empty folder with --output-dir; zoo replaces only its own runs")
        path.parent.mkdir(parents=True, exist_ok=True)
        folder = RunFolder(path)
        folder._remove_stale_staging()
        return folder

    def new_staging(self) -> "RunFolder":
        """A fresh, empty staging folder beside this one (``.<name>.partial-<pid>``), hidden from readers."""
        staging = self.path.parent / f".{self.name}.partial-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        return RunFolder(staging)

    def keep_only(self, names: Sequence[str]) -> None:
        """Remove every file and folder except ``names``."""
        for path in self.path.iterdir():
            if path.name not in names:
                shutil.rmtree(path) if path.is_dir() else path.unlink()

    def replace_with(self, staging: "RunFolder") -> None:
        """Move ``staging`` into this folder's place; what the folder held before is removed."""
        old = None
        if self.path.exists():
            old = self.path.with_name(f".{self.name}.old-{os.getpid()}")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(self.path, old)
        os.replace(staging.path, self.path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def _remove_stale_staging(self) -> None:
        """Staging folders of runs that were killed (their process is gone) are removed."""
        for path in self.path.parent.glob(f".{self.name}.partial-*"):
            pid = path.name.rsplit("-", 1)[-1]
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
