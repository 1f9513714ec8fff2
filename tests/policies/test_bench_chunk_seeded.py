"""benchmarks/bench_chunk.py's real-size weights path, run on a CPU at tiny size (``--tiny --seeded``).

At real size the chunk bench has no checkpoint to read: a placeholder checkpoint (config, processors, an
empty model.safetensors), seeded random weights for the unit and for LeRobot's policies, Hub stand-ins for
the VAE and text encoder. A tiny checkpoint skips all of that, so only a GPU run used to reach it, and the
H200's first real-size policy check failed there (LeRobot's Fast-WAM read the empty file). Here the same path
lowers to the eager backend's programs and runs zoo's policy check against LeRobot's own ``select_action``:
the reference is LeRobot's policy, so the check fails if the two sides hold different weights. With
``unit.quantize=int8-weight-only`` the reference is LeRobot's policy quantized the same way, and a program whose
one row is scaled wrong fails against it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lerobot")
pytestmark = pytest.mark.policies

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_chunk.py"


def bench_chunk(out: Path, policy: str, only: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--seeded", "--backend", "eager", "--device", "cpu",
                           "--policies", policy, "--only", only, "--out", str(out), *extra],
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


INT8 = ("--set", "unit.quantize=int8-weight-only")


@pytest.mark.e2e
def test_int8_weight_only_through_the_chunk_bench_is_checked_against_lerobot_quantized_the_same_way(tmp_path):
    lowered = bench_chunk(tmp_path, "fast_wam", "lower", *INT8)
    assert lowered.returncode == 0, lowered.stderr[-3000:]
    report = json.loads((tmp_path / "fast_wam" / "run" / "report.json").read_text())
    stages = [s["stage"] for s in report["stages"] if s["status"] == "done"]
    assert stages == ["build", "quantize", "export", "rewrite", "quantization_cost", "save"]  # zoo.export's order
    applied = report["quantization"]["applied"]
    assert applied["quantized"] == 54 and applied["weight_bytes"]["after"] < 0.5 * applied["weight_bytes"]["before"]
    (record,) = json.loads((tmp_path / "chunk_latency.json").read_text())["policies"]
    assert record["quantize"] == "int8-weight-only (per row)" and record["weight_bytes"] == applied["weight_bytes"]
    assert record["ptd_bytes"] is None  # the eager backend lowers nothing

    checked = bench_chunk(tmp_path, "fast_wam", "check", *INT8)
    assert checked.returncode == 0, checked.stderr[-3000:] + checked.stdout[-3000:]
    (record,) = json.loads((tmp_path / "policy_check.json").read_text())["policies"]
    check = record["policy_check"]
    assert check["status"] == "passed" and check["result"]["rule"] == "float32", check
    rows = check["result"]["rows"]
    assert len(rows) >= 3 and all(row["ok"] and row["rel_l2"] <= 1e-5 for row in rows), rows
    # Quantization itself moves LeRobot's actions a hundred times the tolerance: the runner passed against LeRobot's
    # policy quantized the same way, which an unquantized reference could not have given.
    cost = check["result"]["quantization_cost"]
    assert cost["passed"] and all(row["rel_l2"] > 1e-3 for row in cost["rows"]), cost["rows"]
    assert "not a task-success figure" in check["table"]

    # One output row of one action-expert layer dequantizes 1.5x too large: the check against LeRobot fails.
    program_file = tmp_path / "fast_wam" / "run" / "rewritten.action_step.pt2"
    program = torch.export.load(str(program_file))
    scale = sorted(k for k in program.state_dict if "blocks.action" in k and k.endswith("weight.original1"))[0]
    with torch.no_grad():
        program.state_dict[scale][0] *= 1.5
    torch.export.save(program, str(program_file))
    broken = bench_chunk(tmp_path, "fast_wam", "check", *INT8)
    assert broken.returncode == 1, broken.stderr[-3000:]
    (record,) = json.loads((tmp_path / "policy_check.json").read_text())["policies"]
    assert record["policy_check"]["status"] == "failed"
    assert any(not row["ok"] and row["rel_l2"] > 1e-5 for row in record["policy_check"]["result"]["rows"])


@pytest.mark.e2e
def test_a_bf16_int8_unit_is_judged_by_the_bf16_rule_against_lerobot_float32_quantized_the_same_way(tmp_path):
    # LingBot-VA: its LeRobot policy runs in bf16 on a CPU (Fast-WAM's needs CUDA autocast).
    options = ("--set", "unit.quantize=int8-weight-only", "unit.dtype=bfloat16")
    lowered = bench_chunk(tmp_path, "lingbot_va", "lower", *options)
    assert lowered.returncode == 0, lowered.stderr[-3000:]
    checked = bench_chunk(tmp_path, "lingbot_va", "check", *options)
    assert checked.returncode == 0, checked.stderr[-3000:] + checked.stdout[-3000:]
    (record,) = json.loads((tmp_path / "policy_check.json").read_text())["policies"]
    result = record["policy_check"]["result"]
    assert record["policy_check"]["status"] == "passed" and result["rule"] == "bf16", result["table"]
    # The runner is no further from LeRobot's float32 policy than LeRobot's own bf16 policy is (both quantized the
    # same way), and quantization alone (float32 both sides) moves the actions less than bf16 and quantization do.
    assert result["pooled"]["rel_l2"] <= 1.25 * result["pooled"]["reference_rel_l2"]
    rows = result["quantization_cost"]["rows"]
    assert all(0 < row["quantized_float32_rel_l2"] < row["rel_l2"] for row in rows), rows
