"""Shared test set-up: the hooks and fixtures live in tests/support (registered here as plugins); what they are:

- support/environment.py: no network, the user's caches untouched (a sandbox per session), the toy family
  (tests/families/toy) found as ``zoo.policies.toy``; imported first, before anything imports huggingface_hub;
- support/fixtures.py: the fixtures (the toy family, test recipes, a fake zoo_runner, the tiny recipes' runs
  exported once per session and shared by the xdist workers, the README's fresh clone);
- support/xdist_plugin.py: the workers, and which modules they take first;
- support/selection.py: the ``e2e`` tests left out unless asked for (``pytest -m e2e``);
- support/fault_report.py: the fault-injection table at the end of the session.
"""

from __future__ import annotations

from support import environment  # first: it sets the variables huggingface_hub reads at import

pytest_plugins = ["support.fixtures", "support.xdist_plugin", "support.selection", "support.fault_report"]


def pytest_sessionfinish(session, exitstatus):
    environment.remove_sandbox()
