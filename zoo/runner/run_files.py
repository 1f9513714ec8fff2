"""TEMPORARY adapter: the run-folder files the runner reads, by name.

zoo is moving every run-folder file name into one owner (``zoo.run_folder.RunFolder``, being written in
parallel). Until it lands, the runner reads the few files it needs through this class only, so switching is
a change of this one module. Nothing else in ``zoo.runner`` knows a file name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

from .errors import RunnerError

HOST_SETTINGS = "host_settings.json"
IO_SPEC = "io_spec.json"
RECIPE = "recipe.yaml"
PROCESSORS_DIR = "processors"
PTE = "model.pte"
PTD = "aoti_cuda_blob.ptd"
SO_DIR = "so"


class RunFiles:
    """Read-only view of a run folder (or a published folder downloaded from the Hub)."""

    def __init__(self, path: Path):
        self.path = Path(path).expanduser()
        if not self.path.is_dir():
            raise RunnerError(f"{self.path} is not a folder", "give a run folder written by `python -m zoo.export` "
                                                               "or a Hub repo id of a published zoo artifact")
        self.host_settings = self._json(HOST_SETTINGS)
        self.io_spec = self._json(IO_SPEC)

    def _json(self, name: str) -> Dict[str, Any]:
        path = self.path / name
        if not path.is_file():
            raise RunnerError(f"{path} is missing, so {self.path} is not a complete zoo run folder",
                              "export the recipe again (`python -m zoo.export RECIPE`)")
        try:
            return json.loads(path.read_text())
        except ValueError as exc:
            raise RunnerError(f"{path} is not valid JSON: {exc}", "export the recipe again") from None

    @property
    def policy_type(self) -> str:
        kind = self.host_settings.get("policy_type")
        if not kind:
            raise RunnerError(f"{self.path / HOST_SETTINGS} names no policy_type",
                              "the run was written by an older zoo: export the recipe again")
        return str(kind)

    @property
    def unit_dtype(self) -> str:
        return str(self.io_spec.get("dtype") or self.host_settings.get("dtype"))

    def methods(self) -> List[str]:
        return list(self.io_spec.get("methods", {}))

    def method_io(self, method: str) -> Dict[str, Any]:
        methods = self.io_spec.get("methods", {})
        if method not in methods:
            raise RunnerError(f"the run in {self.path} has no method {method!r} (it has {', '.join(methods) or 'none'})",
                              "export the recipe with that method in unit.methods")
        return methods[method]

    def program(self, method: str) -> Path:
        """The rewritten program of ``method``: what gets lowered, run eagerly by the eager backend."""
        path = self.path / f"rewritten.{method}.pt2"
        if not path.is_file():
            raise RunnerError(f"{path} is missing: the eager backend runs the rewritten programs",
                              "use a run folder from `python -m zoo.export`, or backend='artifact' for a published "
                              "artifact")
        return path

    @property
    def pte(self) -> Path:
        return self.path / PTE

    @property
    def ptd(self) -> Optional[Path]:
        path = self.path / PTD
        return path if path.is_file() else None

    def io_order(self, method: str) -> Dict[str, Any]:
        path = self.path / SO_DIR / f"{method}.io.json"
        if not path.is_file():
            raise RunnerError(f"{path} is missing: the compiled .so's input order of {method!r} is unknown",
                              "lower the run (`python -m zoo.lower RUN_DIR`); it writes so/<method>.io.json")
        return json.loads(path.read_text())

    @property
    def processors_dir(self) -> Path:
        return self.path / PROCESSORS_DIR
