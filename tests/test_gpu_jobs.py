"""tools/gpu_jobs.sh: background jobs on a GPU box, started by one command and waited on by later ones."""

from __future__ import annotations

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "gpu_jobs.sh"


def jobs(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True, check=check,
                          timeout=120)


def test_jobs_run_after_their_dependencies_keep_exit_codes_and_limits(tmp_path):
    work = tmp_path / "work"
    marker = tmp_path / "a-finished"
    jobs("start", work, "a", "--", "bash", "-c", f"sleep 1; touch {marker}; echo from-a")
    # b must see a's file: it only starts once a has ended.
    jobs("start", work, "b", "--after", "a", "--nice", "--", "bash", "-c", f"test -f {marker} && echo saw-a; exit 3")
    jobs("start", work, "slow", "--limit", "1", "--", "sleep", "30")
    done = jobs("wait", work, "60")
    table = done.stdout
    assert "a                  exit 0" in table and "from-a" in table
    assert "b                  exit 3" in table and "saw-a" in table
    assert "slow               exit 124" in table  # cut by --limit, as timeout(1) reports it
    assert int((work / "jobs/b/started").read_text()) >= int((work / "jobs/a/ended").read_text())

    out = tmp_path / "out"
    collected = jobs("collect", work, out)
    assert "== b (exit 3)" in collected.stdout
    listing = subprocess.run(["tar", "tzf", str(out / "jobs.tar.gz")], capture_output=True, text=True).stdout
    assert "jobs/a/log" in listing and "jobs/b/rc" in listing


def test_wait_reports_pending_jobs_with_a_nonzero_exit_and_names_are_unique(tmp_path):
    work = tmp_path / "work"
    jobs("start", work, "long", "--", "sleep", "30")
    waited = jobs("wait", work, "1", check=False)
    assert waited.returncode == 1 and "long               running" in waited.stdout
    again = jobs("start", work, "long", "--", "true", check=False)
    assert again.returncode == 2 and "already exists" in again.stderr
    jobs("stop", work, "long")
    assert jobs("wait", work, "30").returncode == 0  # stopped: it has ended (with the signal's exit code)
