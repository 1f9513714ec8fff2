"""The fixtures every test module may ask for (tests/conftest.py registers this module as a plugin)."""

from __future__ import annotations

import logging
import os
import stat
import sys
from pathlib import Path

import pytest

import zoo.policies
from support import shared_runs
from support.environment import FIXTURES, TEST_RECIPES


@pytest.fixture(autouse=True)
def zoo_logging_as_a_fresh_process_has_it():
    """Each test starts with the "zoo" logger as a fresh process has it, whichever tests its worker ran before:
    a command's main (``zoo.core.progress.setup_logging``) takes it off the root logger, where ``caplog`` listens,
    for the rest of the process."""
    from zoo.core import progress

    logger = logging.getLogger("zoo")
    saved = (list(logger.handlers), logger.level, logger.propagate, progress.setup_logging.__dict__.copy())
    # As a fresh process has it, not as found: a session or module fixture set up before this one may already
    # have run a command's main in this process.
    logger.handlers[:] = []
    logger.setLevel(logging.NOTSET)
    logger.propagate = True
    progress.setup_logging.__dict__.pop("_done", None)
    yield
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])
    logger.propagate = saved[2]
    progress.setup_logging.__dict__.clear()
    progress.setup_logging.__dict__.update(saved[3])


@pytest.fixture
def toy_family():
    """The toy family module (tests/families/toy), loaded as the pipeline loads it (the test recipes say
    family: toy)."""
    return zoo.policies.load_family("toy")


@pytest.fixture
def test_recipe():
    """Load a recipe from tests/recipes by name, with overrides."""
    from zoo.contract.recipes import load_recipe

    def load(name: str, *overrides: str):
        return load_recipe(name, overrides, recipes_dir=TEST_RECIPES)

    return load


@pytest.fixture(scope="session")
def fake_zoo_runner(tmp_path_factory) -> Path:
    """A zoo_runner for CPU tests: tests/fixtures/fake_zoo_runner.py (the runner's command line and file format,
    running the run folder's exported programs eagerly), in an executable wrapper (the real runner is a binary:
    the session execs it directly)."""
    path = tmp_path_factory.mktemp("bin") / "zoo_runner"
    fake = FIXTURES / "fake_zoo_runner.py"
    path.write_text(f"#!/bin/sh\nPYTHONPATH='{os.pathsep.join(sys.path)}' exec {sys.executable} {fake} \"$@\"\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


# --------------------------------------------------------------------------------------------------------
# Shared by the whole session (every xdist worker): support/shared_runs.py


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory) -> Path:
    """The session's cache folder, shared by the xdist workers."""
    return shared_runs.session_root(tmp_path_factory) / shared_runs.CACHE


@pytest.fixture(scope="session")
def readme_clone(shared_cache) -> Path:
    """A folder laid out like a fresh clone after ``scripts/setup.sh`` (tests/test_readme.py)."""
    return shared_runs.clone(shared_cache)


@pytest.fixture(scope="session")
def tiny_runs(shared_cache):
    """``tiny_runs(NAME)``: the tiny recipe's run, exported once for the session (``SharedRun``; read only).
    llama-rope-tiny's is the README's main job, run as written in ``readme_clone``."""
    def get(name: str) -> shared_runs.SharedRun:
        if name == "llama-rope-tiny":
            pytest.importorskip("transformers")
        else:
            pytest.importorskip("lerobot")
        return shared_runs.tiny_run(shared_cache, name)

    return get
