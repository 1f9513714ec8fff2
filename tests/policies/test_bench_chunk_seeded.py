"""benchmarks/bench_chunk.py's real-size weights path, run on a CPU at tiny size (``--tiny --seeded``).

At real size the chunk bench has no checkpoint to read: a placeholder checkpoint (config, processors, an
empty model.safetensors), seeded random weights for the unit and for LeRobot's policies, Hub stand-ins for
the VAE and text encoder. A tiny checkpoint skips all of that, so only a GPU run used to reach it, and the
H200's first real-size policy check failed there (LeRobot's Fast-WAM read the empty file). Here the same path
lowers to the eager backend's programs and runs zoo's policy check against LeRobot's own ``select_action``:
the reference is LeRobot's policy, so the check fails if the two sides hold different weights.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lerobot")
pytestmark = pytest.mark.policies

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_chunk.py"


def bench_chunk(out: Path, policy: str, only: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--seeded", "--backend", "eager", "--device", "cpu",
                           "--policies", policy, "--only", only, "--out", str(out)],
                          capture_output=True, text=True, timeout=900)


# Fast-WAM takes the same path as LingBot-VA (zoo.bench.chunk.policy_source); its case runs with -m e2e, to keep
# the default run short.
@pytest.mark.parametrize("policy", [pytest.param("fast_wam", marks=pytest.mark.e2e), "lingbot_va"])
def test_the_real_size_weights_path_passes_the_policy_check_on_a_cpu(tmp_path, policy):
    lowered = bench_chunk(tmp_path, policy, "lower")
    assert lowered.returncode == 0, lowered.stderr[-3000:]
    checked = bench_chunk(tmp_path, policy, "check")
    assert checked.returncode == 0, checked.stderr[-3000:] + checked.stdout[-3000:]
    results = json.loads((tmp_path / "policy_check.json").read_text())
    assert results["settings"]["seeded"] is True
    (record,) = results["policies"]
    check = record["policy_check"]
    assert check["status"] == "passed", check
    # The float32 rule over the recipe's episode: at least 3 chunks, each within 1e-5 of LeRobot's actions.
    rows = check["result"]["rows"]
    assert check["result"]["rule"] == "float32" and len(rows) >= 3
    assert all(row["ok"] and row["rel_l2"] <= 1e-5 for row in rows), rows
    # The placeholder's weights file is empty: the weights came from the seeded fill, not from a file.
    assert (tmp_path / policy / "checkpoint" / "model.safetensors").stat().st_size < 1024


def test_an_artifact_that_failed_verification_is_not_timed(tmp_path):
    # The H200's first real-size LingBot-VA bench timed an artifact whose vae_encode_first had failed verification
    # (its actions were NaN from the second chunk on) and recorded the latency for the model card.
    run = tmp_path / "lingbot_va" / "run"
    run.mkdir(parents=True)
    (run / "model.pte").write_bytes(b"not a program")
    (run / "report.json").write_text(json.dumps({"status": None, "failed_stage": "verify"}))
    timed = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--backend", "artifact", "--device", "cpu",
                            "--policies", "lingbot_va", "--only", "bench", "--out", str(tmp_path)],
                           capture_output=True, text=True, timeout=900)
    assert timed.returncode == 1, timed.stderr[-3000:]
    (record,) = json.loads((tmp_path / "chunk_latency.json").read_text())["policies"]
    assert record["status"] == "failed" and "has not passed verification" in record["error"], record
    assert record["candidates"] == {}  # nothing was timed
    assert "has not passed verification" in timed.stdout
