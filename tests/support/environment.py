"""The environment every test session and every process it starts runs in, set up on import (tests/conftest.py
imports this before anything else, so before huggingface_hub reads its variables at import).

No network and never the user's caches: HF_HUB_OFFLINE=1, and HF_HUB_CACHE, zoo's tiny-checkpoint cache and
the lowering workers' memory ledger point into a throw-away sandbox folder (subprocesses inherit them). The toy family (tests/families/toy) is put on
zoo.policies' search path, so that ``family: toy`` recipes load as ``zoo.policies.toy`` like a shipped family.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
REPO_ROOT = TESTS.parent
TEST_RECIPES = TESTS / "recipes"  # recipes of the toy family, loaded by path or with recipes_dir=
TEST_FAMILIES = TESTS / "families"
FIXTURES = TESTS / "fixtures"  # fakes and probes the tests and their subprocesses import by name

# A subprocess that imports this module (the fault-injection children, support/faults.py) shares the session's
# sandbox. Under pytest-xdist each worker is a session of its own with its own sandbox (its caches are written by
# its tests only), not the controller's it inherits.
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
OWN_SANDBOX = "ZOO_TEST_SANDBOX" not in os.environ or os.environ.get("ZOO_TEST_SANDBOX_WORKER") != WORKER
SANDBOX = Path(tempfile.mkdtemp(prefix="zoo-tests-") if OWN_SANDBOX else os.environ["ZOO_TEST_SANDBOX"])
os.environ["ZOO_TEST_SANDBOX"] = str(SANDBOX)
os.environ["ZOO_TEST_SANDBOX_WORKER"] = WORKER
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_CACHE"] = str(SANDBOX / "hf-cache")
os.environ["ZOO_TINY_HUB_CACHE"] = str(SANDBOX / "tiny-hub")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# The lowering workers' memory claims (zoo.export.lower.admission): the session's own, so that a test lowering
# neither waits for a real lowering on this machine nor for another session's tests.
os.environ["ZOO_LOWERING_LEDGER_DIR"] = str(SANDBOX / "lowering-ledger")

import zoo.policies  # noqa: E402  (after the variables: it may import huggingface_hub)

if str(TEST_FAMILIES) not in zoo.policies.__path__:
    zoo.policies.__path__.append(str(TEST_FAMILIES))
# The fakes and probes (portable_lowering, aoti_cpu_probe, ...) import by name, here as in the worker processes
# the lowering tests start with PYTHONPATH=tests/fixtures.
if str(FIXTURES) not in sys.path:
    sys.path.append(str(FIXTURES))


def remove_sandbox() -> None:
    """At the end of the session that made it (a child sharing it leaves it alone)."""
    if OWN_SANDBOX:
        shutil.rmtree(SANDBOX, ignore_errors=True)
