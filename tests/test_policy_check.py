"""zoo.export.policy_check's choice of where the check runs: a bf16 unit's CPU check is skipped with the reason, and
the run's report and model card say so (no lerobot needed: nothing is built)."""

from __future__ import annotations

from zoo.contract.host_settings import NoHostSettings
from zoo.contract.io_spec import IoSpec
from zoo.export.publish.model_card import render_card
from zoo.export.policy_check import policy_check_step, why_skipped
from zoo.contract.recipes import load_recipe
from zoo.core.report import RunReport

BF16_REASON = ("the CPU policy check runs for float32 units only (bfloat16 here): LeRobot's bf16 policies need the "
               "GPU (Fast-WAM's float32 regions use CUDA autocast) and bf16 episodes on the CPU take minutes; the "
               "GPU policy check covers bfloat16 units")


def test_a_bf16_unit_skips_the_cpu_check_with_the_reason_and_keeps_the_gpu_one():
    for name in ("lingbot-va-tiny", "fast-wam-tiny"):
        bf16 = load_recipe(name, ["unit.dtype=bfloat16"])
        assert why_skipped(bf16, "cpu") == BF16_REASON
        assert why_skipped(bf16, "gpu") != BF16_REASON  # None, or "needs lerobot" where it is missing
        assert why_skipped(load_recipe(name), "cpu") != BF16_REASON


def test_the_report_and_the_model_card_record_the_bf16_cpu_skip(tmp_path):
    recipe = load_recipe("lingbot-va-tiny", ["unit.dtype=bfloat16"])
    report = RunReport(tmp_path, recipe.to_dict())
    assert policy_check_step(None, recipe, report, where="cpu") is None  # the run folder is never read
    assert report.stages == [{"stage": "policy_check", "status": "skipped", "seconds": None, "detail": BF16_REASON}]
    assert report.get("policy_check") == {"cpu": {"status": "skipped", "reason": BF16_REASON}}
    assert BF16_REASON in report.markdown()
    manifest = {"recipe": recipe.to_dict(), "policy_check": report.get("policy_check"), "files": {}}
    card = render_card(manifest, IoSpec(dtype="bfloat16", methods={}), NoHostSettings(), "my-lab/lingbot-va-tiny")
    assert ("- On the CPU, during export: the eager runner (the rewritten programs) against LeRobot's policy in "
            f"eager PyTorch. Skipped: {BF16_REASON}.") in card
