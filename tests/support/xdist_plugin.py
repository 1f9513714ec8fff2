"""Running in parallel (pytest-xdist; pyproject.toml's addopts ask for ``-n auto``). A pytest plugin
(tests/conftest.py registers it).

Whole modules go to a worker (their module-scoped fixtures are built once), the longest first: the session is as
long as its longest worker, and a long module started last would run alone at the end. Every other module follows
in collection order. The runs several modules read are built once for the session whichever worker asks first
(support/shared_runs.py), so modules that share them need not share a worker.
"""

from __future__ import annotations

import os

import pytest

# The longest modules on two cores, longest first (``--durations`` of a whole run says which they are).
LONGEST_FIRST = ("tests/test_faults.py", "tests/runner/test_lingbot_va_runner.py",
                 "tests/runner/test_fast_wam_runner.py", "tests/test_cli.py", "tests/test_lowering_workers.py")
MAX_WORKERS = 4  # 24 GiB of memory: each worker may hold a tiny LeRobot policy and a lowering at once


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core this process may run on, at most MAX_WORKERS."""
    return max(1, min(cores(), MAX_WORKERS))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from collections import OrderedDict

    from xdist.scheduler import LoadScopeScheduling

    rank = {module: i for i, module in enumerate(LONGEST_FIRST)}

    class LongestFirst(OrderedDict):
        """The work queue: the next unit handed out is the best-ranked one, else the first queued."""

        def popitem(self, last=True):
            scope = min(self, key=lambda s: rank.get(s, len(rank)))
            return scope, self.pop(scope)

    class ModuleScheduling(LoadScopeScheduling):
        def __init__(self, config, log=None):
            super().__init__(config, log)
            self.workqueue = LongestFirst()

        def _split_scope(self, nodeid):
            return nodeid.split("::", 1)[0]

    return ModuleScheduling(config, log)


def pytest_configure(config):
    """Under xdist, the cores shared out between the workers: torch's own thread pool (and a subprocess's, through
    OMP_NUM_THREADS) gets its share, so that workers do not spin on each other's cores."""
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if not os.environ.get("PYTEST_XDIST_WORKER") or count < 1:
        return
    import torch

    threads = max(1, cores() // count)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
