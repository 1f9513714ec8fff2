"""The tiny recipes' runs, exported once per test session and shared by every test that only reads them.

Exporting a tiny recipe takes a minute or more on a CPU (LeRobot's policy check included); several test modules
read the same run. Each run is built into a cache folder under the session's pytest base folder, which the
pytest-xdist workers share (each worker's own base folder is a subfolder of it): the first worker to ask builds it
while holding a lock file (``fcntl``), a second one asking meanwhile waits for it and then reuses it. The build's
outcome (exit status, what it printed) is recorded beside it, so that a failed export fails every test that needs
it with its message, without being run again.

A test that changes a run works on a copy (``shutil.copytree``): copying takes milliseconds, an export minutes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, Optional, Sequence

from support.environment import REPO_ROOT

CACHE = "zoo-shared"  # the cache folder's name under the session's base folder
CLONE_ENTRIES = ("zoo", "recipes", "scripts", "pyproject.toml", "README.md")  # what a fresh clone has that we use
README_MAIN_JOB = ".venv/bin/python -m zoo.export llama-rope-tiny"  # the README's first command, after setup.sh


@dataclass(frozen=True)
class SharedRun:
    """A tiny recipe's run folder as ``python -m zoo.export NAME`` left it. Read only: copy it to change it."""

    name: str
    path: Path
    returncode: int
    stdout: str
    stderr: str

    @property
    def checkpoint(self) -> Path:
        """The checkpoint folder the run was exported from (in the cache's own Hub cache: it stays)."""
        return Path(json.loads((self.path / "source.json").read_text())["path"])

    def check_exported(self) -> None:
        """Fail the calling test with the export's own message unless it exited 0."""
        assert self.returncode == 0, f"python -m zoo.export {self.name} exited {self.returncode}\n{self.stderr[-3000:]}"

    def copy_to(self, folder: Path) -> Path:
        """A copy of the exported run in ``folder`` (for a test that writes into it), once the export succeeded."""
        self.check_exported()
        copy = folder / self.name
        shutil.copytree(self.path, copy)
        return copy


def session_root(tmp_path_factory) -> Path:
    """The folder shared by the whole session: under pytest-xdist each worker's base folder is
    ``<root>/popen-gw<N>`` (the controller's is the root); without xdist it is the base folder itself."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def locked(lock: Path) -> Iterator[None]:
    """An exclusive lock on ``lock`` (between processes; released when the holder ends, even killed)."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def built_once(cache: Path, key: str, build: Callable[[Path], Optional[Dict]]) -> Dict:
    """``cache/key``, built by ``build(folder)`` by the first process that asks; what ``build`` returned (a JSON
    record) is kept beside it, and later callers get that record back without building again."""
    folder, record = cache / key, cache / f"{key}.json"
    with locked(cache / f"{key}.lock"):
        if not record.exists():
            if folder.exists():  # a build that did not finish (its process was killed)
                shutil.rmtree(folder)
            result = build(folder) or {}
            record.write_text(json.dumps(result))
    return json.loads(record.read_text())


def clone(cache: Path) -> Path:
    """A folder laid out like a fresh clone after ``scripts/setup.sh``: the repository's files (linked) and
    ``.venv`` (the venv running these tests). Commands run in it exactly as the README writes them."""

    def build(folder: Path) -> None:
        folder.mkdir(parents=True)
        for name in CLONE_ENTRIES:
            (folder / name).symlink_to(REPO_ROOT / name)
        has_venv = (REPO_ROOT / ".venv" / "bin" / "activate").exists()
        (folder / ".venv").symlink_to(REPO_ROOT / ".venv" if has_venv else Path(sys.prefix))

    built_once(cache, "clone", build)
    return cache / "clone"


def hub_env(cache: Path, name: str) -> Dict[str, str]:
    """The environment of a shared export: its Hub caches in the shared cache (the worker's own sandbox is removed
    when that worker ends, and the runs' checkpoints must outlive it)."""
    hub = cache / f"{name}.hub"
    return dict(os.environ, HF_HUB_CACHE=str(hub / "hf-cache"), ZOO_TINY_HUB_CACHE=str(hub / "tiny-hub"))


def run_in_clone(clone_dir: Path, command: str, activate: bool, timeout: int = 900,
                 env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """Run a README command in ``clone_dir`` with bash (after ``source .venv/bin/activate`` when the README says
    the venv is active)."""
    script = ("source .venv/bin/activate && " if activate else "") + command
    # `zoo` is the clone's, whatever the venv has installed.
    env = dict(env if env is not None else os.environ, PYTHONPATH=str(clone_dir))
    return subprocess.run(["bash", "-c", script], cwd=clone_dir, capture_output=True, text=True, timeout=timeout,
                          env=env)


def readme_main_job(cache: Path) -> SharedRun:
    """The README's main job, run as written in the shared clone (it leaves ``runs/llama-rope-tiny`` there)."""
    folder = clone(cache)

    def build(_: Path) -> Dict:
        proc = run_in_clone(folder, README_MAIN_JOB, activate=False, env=hub_env(cache, "llama-rope-tiny"))
        return {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}

    record = built_once(cache, "readme-main-job", build)
    return SharedRun("llama-rope-tiny", folder / "runs" / "llama-rope-tiny", **record)


def tiny_run(cache: Path, name: str, overrides: Sequence[str] = (), label: str = "") -> SharedRun:
    """``python -m zoo.export NAME [OVERRIDES]`` (a tiny recipe), run once for the session into the shared cache;
    ``label`` names a run with overrides apart from the recipe's own."""
    if name == "llama-rope-tiny" and not overrides:  # the README's main job is this very command: one run
        return readme_main_job(cache)
    key = f"{name}.{label}" if label else name
    if overrides and not label:
        raise ValueError("a run with overrides needs a label of its own")

    def build(folder: Path) -> Dict:
        proc = subprocess.run([sys.executable, "-m", "zoo.export", name, *overrides, "--output-dir", str(folder)],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=1800, env=hub_env(cache, key))
        return {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}

    record = built_once(cache, key, build)
    return SharedRun(key, cache / key, **record)

