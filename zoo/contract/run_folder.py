"""The run folder: zoo's contract between the export half and the deploy half of the product.

Every file name of the folder is here and only here (the artifact's two are ``zoo.contract.artifact``'s), and every
reader and writer goes through ``RunFolder``; docs/ARCHITECTURE.md ("The run folder") lists the files. An attempt
at writing a folder is ``zoo.contract.attempt.Attempt``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

import torch
from omegaconf import OmegaConf
from torch.export import ExportedProgram

import zoo.kernels  # noqa: F401  registers zoo's custom ops, which a saved program may call (read_program)
from zoo.core import atomic
from zoo.contract.artifact import PTD_NAME, PTE_NAME, so_file_name, weights_file_name
from zoo.contract.host_settings import HostSettings, host_settings_from_json
from zoo.contract.io_spec import IoSpec
from zoo.core.errors import ExportError, LoweringError, ZooError, storage_error
from zoo.core.progress import say
from zoo.contract.recipes import load_recipe
from zoo.core.report import RunReport

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
RUNTIME_JSON = "runtime.json"
PUBLISH_DIR = "publish"
SO_DIR = "so"
ATTEMPTS_DIR = "attempts"
# The commands that write a run folder, each with its own log (``log_file``).
LOGGED_COMMANDS = ("export", "lower")

# The saved programs of a method: as exported, the float32 reference of a bf16 unit, and as rewritten.
PROGRAM_KINDS = ("exported", "reference_fp32", "rewritten")
# What a failed run keeps: the report saying why, the recipe to reproduce it, and what the command printed.
KEPT_ON_FAILURE = (REPORT_JSON, REPORT_MD, RECIPE_YAML) + tuple(f"{c}.log" for c in LOGGED_COMMANDS)
# What is derived from a run's artifact: a new artifact makes them stale.
ARTIFACT_OUTPUTS = (PTE_NAME, PTD_NAME, SO_DIR, RUNTIME_JSON)
# A run whose report says one of these holds nothing good (an earlier zoo may have left "running").
NOT_GOOD = ("failed", "interrupted", "running")
# What is published from a finished run (besides processors/, copied whole, and each method's so/<m>.io.json):
# what a deploy side loads.
ARTIFACT_FILES = (PTE_NAME, PTD_NAME, IO_SPEC_JSON, HOST_SETTINGS_JSON)
# Beside the run, never in it: ``.<run name>.lowered/<method>/``, the lowered parts of a lowering that stopped
# part way, each with the stamp of what it was lowered from (zoo.export.lower.kept_parts). Outside the run so
# that a failed attempt never changes a good run; beside it so that hard links reach it (one file system).
KEPT_PARTS_SUFFIX = ".lowered"
KEPT_STAMP_JSON = "stamp.json"
# A staging folder's name: the run's name between a dot and ``.partial-<pid>`` (``RunFolder.new_staging``).
_STAGING_NAME = re.compile(r"\.(?P<run>.+)\.partial-\d+")


def read_program(path: Path) -> ExportedProgram:
    """A saved program; a missing, truncated or foreign file is a clear error, not torch's traceback. zoo's
    custom ops (``zoo.kernels``, which a rewrite may have put in) are registered by this module's import."""
    if not path.is_file():
        raise LoweringError(f"{path} is missing",
                            "export the recipe again (`python -m zoo.export RECIPE`); it saves every method's programs")
    try:
        return torch.export.load(str(path))
    except Exception as exc:  # zipfile, pickle and torch raise many kinds on a damaged file
        said = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise LoweringError(f"{path} cannot be read as a saved program: {type(exc).__name__}"
                            + (f": {said}" if said else ""),
                            "the file is damaged or truncated: export the recipe again "
                            "(`python -m zoo.export RECIPE`)") from exc


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
    def runtime_file(self) -> Path:
        return self.path / RUNTIME_JSON

    @property
    def so_dir(self) -> Path:
        return self.path / SO_DIR

    @property
    def attempts_dir(self) -> Path:
        return self.path / ATTEMPTS_DIR

    def log_file(self, command: str) -> Path:
        """The log ``python -m zoo.<command>`` writes while it works on this folder."""
        if command not in LOGGED_COMMANDS:
            raise ValueError(f"no log for command {command!r}: one of {LOGGED_COMMANDS}")
        return self.path / f"{command}.log"

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

    @property
    def run_name(self) -> str:
        """The name of the run this folder holds, or stages (``.<name>.partial-<pid>``)."""
        staged = _STAGING_NAME.fullmatch(self.name)
        return staged.group("run") if staged else self.name

    @property
    def kept_parts_dir(self) -> Path:
        """``.<run name>.lowered/`` beside the run (and beside its staging folders): the lowered methods a
        lowering that stopped part way kept for the next one."""
        return self.path.parent / f".{self.run_name}{KEPT_PARTS_SUFFIX}"

    def is_run(self) -> bool:
        """Whether zoo wrote this folder (it holds a run report)."""
        return self.report_json.is_file()

    def status(self) -> Optional[str]:
        """The status its report gives ("done", "verified", "failed", ...); None where there is no readable one."""
        try:
            return json.loads(self.report_json.read_text()).get("status")
        except (OSError, ValueError, AttributeError):
            return None

    def holds_good_run(self) -> bool:
        """A run that finished (done, lowered, verified, ...): one a later attempt must not destroy."""
        return self.is_run() and self.status() not in NOT_GOOD

    def attempts(self) -> List["RunFolder"]:
        """The attempts kept beside this run, oldest first."""
        if not self.attempts_dir.is_dir():
            return []
        return [RunFolder(p) for p in sorted(self.attempts_dir.iterdir()) if p.is_dir()]

    def latest_attempt(self) -> Optional["RunFolder"]:
        """The newest attempt kept beside the run, when its report is newer than the run's own (a re-run that
        failed or got less far); None when the run is the latest word."""
        kept = [a for a in self.attempts() if a.report_json.is_file()]
        if not kept:
            return None
        newest = max(kept, key=lambda a: a.report_json.stat().st_mtime)
        if self.report_json.is_file() and newest.report_json.stat().st_mtime < self.report_json.stat().st_mtime:
            return None
        return newest

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

    def write_io_spec(self, io_spec: IoSpec) -> Path:
        return atomic.write_json(self.io_spec_file, io_spec.to_json())

    def read_io_spec(self) -> IoSpec:
        """``io_spec.json`` as an ``IoSpec``; a ``ContractError`` for a format this zoo does not read."""
        return IoSpec.from_json(self._read_json(self.io_spec_file), str(self.io_spec_file))

    def write_runtime_requirement(self, requirement: Dict[str, Any]) -> Path:
        return atomic.write_json(self.runtime_file, requirement)

    def read_runtime_requirement(self) -> Optional[Dict[str, Any]]:
        """``runtime.json`` as written by lowering; None for a run lowered before zoo wrote it."""
        return self._read_json(self.runtime_file) if self.runtime_file.is_file() else None

    def write_host_settings(self, settings: HostSettings) -> Path:
        return atomic.write_json(self.host_settings_file, settings.to_json())

    def read_host_settings(self) -> HostSettings:
        """``host_settings.json`` as its family's dataclass; a ``ContractError`` for a format this zoo does not
        read."""
        return host_settings_from_json(self._read_json(self.host_settings_file), str(self.host_settings_file))

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
        return read_program(self.program(kind, method))

    def write_io_order(self, method: str, record: Dict[str, Any]) -> Path:
        return atomic.write_json(self.io_order_file(method), record)

    def mutable_buffers(self, method: str) -> List[str]:
        """The buffers the method's compiled code writes in place (its state inside, e.g. a KV pool in the
        "buffer" layout), by name, as the lowering recorded them; none when the run is not lowered."""
        path = self.io_order_file(method)
        return sorted(json.loads(path.read_text()).get("mutable_buffers") or {}) if path.exists() else []

    def io_order(self, method: str) -> Dict[str, Any]:
        """How the method's .so orders its inputs and outputs (``input_order``, ``output_order``, names)."""
        path = self.io_order_file(method)
        if not path.exists():
            raise LoweringError(f"{path} is missing: the delegate I/O order of method {method!r} is unknown",
                                "lower the run again (`python -m zoo lower RUN_DIR`); it writes "
                                f"{SO_DIR}/<method>.io.json")
        return json.loads(path.read_text())

    def read_report(self) -> RunReport:
        """The report the folder holds (an empty one when it holds none), to read or to continue."""
        if not self.report_json.exists():
            return RunReport(self.path)
        try:
            data = json.loads(self.report_json.read_text())
            if not isinstance(data, dict) or not isinstance(data.get("stages", []), list):
                raise ValueError("not a zoo run report")
        except ValueError as exc:
            raise ZooError(f"{self.report_json} is damaged: {exc}",
                           "restore it, or export the run again (`python -m zoo.export RECIPE`)") from None
        data.setdefault("stages", [])
        return RunReport.from_data(self.path, data)

    def write_report(self, report: RunReport) -> None:
        atomic.write_json(self.report_json, report.data)
        atomic.write_text(self.report_md, report.markdown())

    # --- a run's life: staged beside the folder, then moved into place -------------------------------------

    def prepare(self, existing: bool = False) -> "RunFolder":
        """The folder a run may be written to, resolved: new, empty, or an earlier zoo run; anything else is
        refused, so that a mistyped --output-dir never touches someone's files. ``existing``: the folder is a
        saved run that the caller checked (``python -m zoo lower``). Staging folders of dead processes beside
        it are cleaned up."""
        path = self.path.expanduser().resolve()
        if path.exists():
            if not path.is_dir():
                raise ZooError(f"output folder {path} exists and is a file", "choose another --output-dir")
            if not existing and any(path.iterdir()) and not RunFolder(path).is_run():
                raise ZooError(f"output folder {path} is not empty and holds no zoo run (no {REPORT_JSON})",
                               "choose a new or empty folder with --output-dir; zoo replaces only its own runs")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise (storage_error(exc) or exc) from exc
        folder = RunFolder(path)
        folder._remove_stale_staging()
        return folder

    def new_staging(self) -> "RunFolder":
        """A fresh, empty staging folder beside this one (``.<name>.partial-<pid>``), hidden from readers."""
        staging = self.path.parent / f".{self.name}.partial-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            staging.mkdir(parents=True)
        except OSError as exc:
            raise (storage_error(exc) or exc) from exc
        return RunFolder(staging)

    def link_into(self, staging: "RunFolder", skip: Sequence[str]) -> None:
        """Fill ``staging`` with hard links to this run's files (a copy where the file system has none), except
        the top-level entries ``skip``. The run's files are never written through these links: zoo writes
        atomically (a new file replaces the link), so the run stays byte for byte as it was."""
        for root, dirs, files in os.walk(self.path):
            rel = Path(root).relative_to(self.path)
            if rel == Path("."):
                dirs[:] = [d for d in dirs if d not in skip]
                files = [f for f in files if f not in skip]
            (staging.path / rel).mkdir(parents=True, exist_ok=True)
            for name in files:
                src, dst = Path(root) / name, staging.path / rel / name
                try:
                    os.link(src, dst)
                except OSError:
                    shutil.copy2(src, dst)

    def keep_only(self, names: Sequence[str]) -> None:
        """Remove every file and folder except ``names``."""
        for path in self.path.iterdir():
            if path.name not in names:
                shutil.rmtree(path) if path.is_dir() else path.unlink()

    def replace_with(self, staging: "RunFolder") -> None:
        """Move ``staging`` into this folder's place; what the folder held before is removed, except its
        ``attempts/``, which the new run keeps."""
        if not self.path.exists():
            os.replace(staging.path, self.path)
            return
        if atomic.exchange(staging.path, self.path):
            old = staging.path  # the earlier run, now under the staging name: a dead process's leftover if killed
        else:
            old = self.path.with_name(f".{self.name}.old-{os.getpid()}")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(self.path, old)
            os.replace(staging.path, self.path)
        _carry_attempts(old, self)
        shutil.rmtree(old, ignore_errors=True)

    def new_attempt_folder(self, status: str) -> Path:
        """``attempts/<time>-<status>``, a name no earlier attempt has."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        folder = self.attempts_dir / f"{stamp}-{status}"
        n = 2
        while folder.exists():
            folder = self.attempts_dir / f"{stamp}-{status}-{n}"
            n += 1
        return folder

    def _remove_stale_staging(self) -> None:
        """Staging folders of attempts that were killed (their process is gone) are removed; attempts/ kept in
        them go back to the run. A run moved aside by a process killed before it could move the new one in
        (``.<name>.old-<pid>``, where the system cannot swap two folders in one step) is put back."""
        for path in sorted(self.path.parent.glob(f".{self.name}.old-*")):
            pid = path.name.rsplit("-", 1)[-1]
            if pid.isdigit() and not atomic.process_alive(int(pid)):
                if not self.path.exists():
                    os.replace(path, self.path)
                    say(f"put back {self.path}, which a killed run had moved aside")
                else:
                    _carry_attempts(path, self)
                    shutil.rmtree(path, ignore_errors=True)
        for path in self.path.parent.glob(f".{self.name}.partial-*"):
            pid = path.name.rsplit("-", 1)[-1]
            if pid.isdigit() and not atomic.process_alive(int(pid)):
                if self.path.is_dir():
                    _carry_attempts(path, self)
                shutil.rmtree(path, ignore_errors=True)


def _carry_attempts(old: Path, run: "RunFolder") -> None:
    """Move the attempts kept in ``old`` (an earlier run or a dead staging folder) into ``run``'s."""
    src = old / ATTEMPTS_DIR
    if not src.is_dir():
        return
    if not run.attempts_dir.exists():
        os.replace(src, run.attempts_dir)
        return
    for entry in sorted(src.iterdir()):
        if not (run.attempts_dir / entry.name).exists():
            os.replace(entry, run.attempts_dir / entry.name)
