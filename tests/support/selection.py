"""Which tests a run takes: the ``e2e`` tests (the whole fault matrix, whole-pipeline repeats; the marker is
declared in pyproject.toml) are left out of a run that names no marker expression, so that ``pytest -q`` stays a
few minutes on two cores. ``pytest -m e2e`` runs them alone, ``pytest -m "e2e or not e2e"`` runs everything, and a
test named by its node id on the command line runs whatever its markers. A pytest plugin (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path


def _named(config) -> set:
    """The node ids the command line names (``path::name``), relative to the rootdir as pytest writes them."""
    named = set()
    for arg in config.args:
        path, sep, rest = str(arg).partition("::")
        if not sep:
            continue
        try:
            rel = (Path(config.invocation_params.dir) / path).resolve().relative_to(config.rootpath)
        except ValueError:
            continue
        named.add(f"{rel.as_posix()}::{rest}")
    return named


def pytest_collection_modifyitems(config, items):
    if config.option.markexpr:  # a marker expression given: it alone decides
        return
    named = _named(config)
    kept, left_out = [], []
    for item in items:
        (left_out if item.get_closest_marker("e2e") and item.nodeid not in named else kept).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept
