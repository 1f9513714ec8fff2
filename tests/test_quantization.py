"""Weight-only quantization (``unit.quantize``, zoo.contract.quantization, zoo.export.quantize) on the CPU: the
recipe's words and refusals, the int8 weights against a hand-worked bound, a program with one wrongly scaled row
caught by the CPU check, and a cost over the recipe's bound refused by the export."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from zoo.contract.recipes import load_recipe
from zoo.contract.run_folder import RunFolder
from zoo.core.errors import QuantizationBlocked, RecipeError, ZooError
from zoo.core.report import RunReport
from zoo.export import pipeline
from zoo.export import quantize as quantizing

pytest.importorskip("torchao")
pytest.importorskip("transformers")

RECIPE = "llama-rope-tiny"


@pytest.mark.parametrize("override, words", [
    ("unit.quantize=int3", "unit.quantize.scheme='int3' is not a quantization scheme"),
    ("unit.quantize=int4-weight-only", "unit.quantize.scheme=int4-weight-only with unit.dtype=float32"),
    ("unit.quantize.group_size=7", "sets group_size or exclude but its scheme is none"),
])
def test_bad_quantize_words_are_refused_with_the_allowed_ones(override, words):
    with pytest.raises(RecipeError) as err:
        load_recipe(RECIPE, [override])
    assert words in err.value.message


def test_the_shorthand_is_the_scheme():
    recipe = load_recipe(RECIPE, ["unit.quantize=int8-weight-only"])
    assert recipe.unit.quantize.scheme == "int8-weight-only" and recipe.unit.quantize.enabled


def test_int4_is_refused_with_the_measured_reason_before_anything_runs():
    recipe = load_recipe(RECIPE, ["unit.quantize=int4-weight-only", "unit.dtype=bfloat16"])
    with pytest.raises(QuantizationBlocked) as err:
        quantizing.refuse_blocked(recipe)
    assert "_convert_weight_to_int4pack" in err.value.message and "int8-weight-only" in err.value.hint


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """The tiny Llama unit quantized int8 weight-only, its unquantized copies, exported and rewritten."""
    recipe = load_recipe(RECIPE, ["unit.quantize=int8-weight-only"])
    run = RunFolder(tmp_path_factory.mktemp("quantized") / "run")
    run.path.mkdir(parents=True)
    report = RunReport(run.path, recipe.to_dict())
    with pipeline.source_environment(recipe, report):
        checkpoint = pipeline.pull_step(recipe, run, report)
        unit = pipeline.build_step(checkpoint, recipe, run, report)
        baselines = pipeline.quantize_step(unit, recipe, report)
        programs, reference = pipeline.export_step(unit, recipe, run, report, save=False)
        rewritten = pipeline.rewrite_step(programs, recipe, report)
    return recipe, report, unit, baselines, rewritten, reference


def _int8_weights(program):
    """{prefix: (int8 values, scale, zero point)} of each quantized linear in an exported program's parameters."""
    state = program.state_dict
    out = {}
    for name, value in state.items():
        if name.endswith("parametrizations.weight.original0") and value.dtype == torch.int8:
            prefix = name[: -len("original0")]
            out[prefix] = (value, state[prefix + "original1"], state[prefix + "original2"])
    return out


def test_int8_weights_are_within_half_a_step_of_the_unquantized_ones(quantized):
    """Round to nearest: each weight is at most half its row's step from its int8 value times the step."""
    _, _, _, baselines, rewritten, _ = quantized
    weights = _int8_weights(rewritten["forward"])
    assert len(weights) == 14
    originals = dict(baselines.float32.methods["forward"].module.named_parameters())
    for prefix, (q, scale, zero) in weights.items():
        dequant = (q.double() - zero.double()) * scale.double()
        key = prefix[: -len("parametrizations.weight.")] + "weight"
        w = originals[key].detach().double()
        assert float(((dequant - w).abs() - scale.double() / 2).max()) <= 1e-6 * float(w.abs().max())
        assert int(q.abs().amax()) >= 120  # the rows' range is used, not a sliver of it


def test_a_wrongly_scaled_row_in_the_program_is_caught_by_the_cpu_check(quantized):
    recipe, report, unit, _, rewritten, reference = quantized
    pipeline.cpu_check_step(unit, rewritten, recipe, report, reference)  # the program as quantized passes
    # A copy: the exported program holds the unit's own parameter tensors, which the reference must keep.
    broken = copy.deepcopy(rewritten["forward"])
    prefix = next(iter(_int8_weights(broken)))
    with torch.no_grad():
        broken.state_dict[prefix + "original1"][0] *= 1.5  # one output row of one layer dequantizes 1.5x too large
    with pytest.raises(ZooError, match="tolerance|within"):
        pipeline.cpu_check_step(unit, {"forward": broken}, recipe, report, reference)


def test_a_cost_over_the_recipes_bound_fails_the_export(tmp_path):
    done = subprocess.run([sys.executable, "-m", "zoo.export", RECIPE, "unit.quantize=int8-weight-only",
                           "unit.quantize.bound.rel_l2=1e-4", "--output-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 3, done.stderr[-2000:]
    assert "quantization costs more than the recipe allows" in done.stderr
    assert "> bound 0.0001" in done.stderr


def test_the_policy_check_of_a_quantized_unit_says_why_it_does_not_run():
    from zoo.export.policy_check import why_skipped

    recipe = load_recipe("fast-wam-tiny", ["unit.quantize=int8-weight-only"])
    assert "quantized the same way" in why_skipped(recipe, "cpu")
    assert why_skipped(load_recipe("fast-wam-tiny"), "cpu") is None or "lerobot" in why_skipped(
        load_recipe("fast-wam-tiny"), "cpu").lower()
