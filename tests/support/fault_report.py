"""The fault-injection table (tests/test_faults.py) at the end of the session, and as JSON lines where
ZOO_FAULT_TABLE names a file (scripts/fault_table.py). A pytest plugin (tests/conftest.py registers it)."""

from __future__ import annotations

import os
from pathlib import Path

FAULT_ROWS = []  # (case index, row) of each fault case, as the reports bring them (from the workers under xdist)


def pytest_runtest_logreport(report):
    if report.when == "call":
        FAULT_ROWS.extend(value for name, value in report.user_properties if name == "fault_row")


def pytest_terminal_summary(terminalreporter):
    if not FAULT_ROWS or hasattr(terminalreporter.config, "workerinput"):
        return
    from support import faults

    rows = [row for _, row in sorted(FAULT_ROWS, key=lambda item: item[0])]
    terminalreporter.write_sep("=", f"fault injection: {len(rows)} cases")
    terminalreporter.write_line(faults.markdown_table(rows))
    if os.environ.get("ZOO_FAULT_TABLE"):
        faults.write_table_rows(Path(os.environ["ZOO_FAULT_TABLE"]), rows)
