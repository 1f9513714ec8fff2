#!/usr/bin/env python3
"""Print the fault-injection table: stage x fault -> exit code, message, earlier run intact.

It runs the very cases CI runs (``tests/test_faults.py``, through pytest, so nothing here can drift from them)
and prints one Markdown table, one row per case:

    python tools/fault_table.py [-k PATTERN] [--out TABLE.md]

``-k`` selects cases like pytest's (``-k export`` for the export command's). The exit status is pytest's: 0
when every case behaved as documented.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from zoo.core.report import markdown_table

ROOT = Path(__file__).resolve().parent.parent  # the checkout whose tests/test_faults.py runs

HEADER = ["command", "stage", "fault", "exit", "failed at", "message", "earlier run intact"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", default=None, help="pytest -k expression selecting cases")
    parser.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="zoo-faults-") as tmp:
        rows_file = Path(tmp) / "rows.jsonl"
        # Every case: the default run takes one per command and kind of fault, the rest are marked e2e.
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_faults.py", "-m",
               "e2e or not e2e", "-k", f"test_fault and ({args.k})" if args.k else "test_fault"]
        env = dict(os.environ, ZOO_FAULT_TABLE=str(rows_file), PYTHONPATH=str(ROOT))
        print(f"[fault_table] {' '.join(cmd)}", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        rows = [json.loads(line) for line in rows_file.read_text().splitlines()] if rows_file.exists() else []
    if proc.returncode != 0:
        print(proc.stdout[-4000:], file=sys.stderr)
    table = markdown_table([HEADER] + rows)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
