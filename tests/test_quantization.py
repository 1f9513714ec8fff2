"""Weight-only quantization (``unit.quantize``, zoo.contract.quantization, zoo.export.quantize) on the CPU: the
recipe's words and refusals, the int8 weights against a hand-worked bound, a program with one wrongly scaled row
caught by the CPU check, and a cost over the recipe's bound refused by the export."""

from __future__ import annotations

import contextlib

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


@contextlib.contextmanager
def quantized_unit(recipe, folder: Path):
    """The recipe's unit built and quantized by the pipeline's own steps, inside its source environment: (run,
    report, checkpoint, unit, the unquantized baselines)."""
    run = RunFolder(folder / "run")
    run.path.mkdir(parents=True)
    report = RunReport(run.path, recipe.to_dict())
    with pipeline.source_environment(recipe, report):
        checkpoint = pipeline.pull_step(recipe, run, report)
        unit = pipeline.build_step(checkpoint, recipe, run, report)
        yield run, report, checkpoint, unit, pipeline.quantize_step(unit, recipe, report)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """The tiny Llama unit quantized int8 weight-only, its unquantized copies, exported and rewritten."""
    recipe = load_recipe(RECIPE, ["unit.quantize=int8-weight-only"])
    with quantized_unit(recipe, tmp_path_factory.mktemp("quantized")) as (run, report, _, unit, baselines):
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


def test_the_policy_check_runs_for_a_quantized_unit():
    from zoo.export.policy_check import NEEDS_LEROBOT, why_skipped

    recipe = load_recipe("fast-wam-tiny", ["unit.quantize=int8-weight-only"])
    assert why_skipped(recipe, "cpu") in (None, NEEDS_LEROBOT)
    assert why_skipped(recipe, "gpu") in (None, NEEDS_LEROBOT)


# --------------------------------------------------------------------------------------------------------
# A bf16 unit quantized: the references verification and the policy check judge it against


@pytest.fixture(scope="module")
def bf16_quantized(tmp_path_factory):
    """Fast-WAM's tiny unit in bf16, quantized int8 weight-only in groups of 32 (torchao's per-group path, which
    dequantizes in the dtype it quantized from) but for its proprio encoder, and LeRobot's own policy of the same
    checkpoint in float32 (the bf16 rule's reference) with a copy of its weights as loaded."""
    pytest.importorskip("lerobot")
    from zoo import policies

    recipe = load_recipe("fast-wam-tiny", ["unit.dtype=bfloat16", "unit.quantize=int8-weight-only",
                                           "unit.quantize.group_size=32", "unit.quantize.exclude=[proprio_encoder]"])
    with quantized_unit(recipe, tmp_path_factory.mktemp("bf16-quantized")) as (run, report, checkpoint, unit, _):
        policy, _, _ = policies.load_family("fast_wam").lerobot_policy(checkpoint.path, load_recipe("fast-wam-tiny"))
    loaded = {name: m.weight.detach().clone() for name, m in policy.named_modules() if isinstance(m, torch.nn.Linear)}
    return recipe, report, run, unit, policy, loaded


def _int8_layers(root: torch.nn.Module):
    """{name: (linear, int8 values, scale, zero point)} of each layer of ``root`` quantized by zoo."""
    from torch.nn.utils import parametrize

    return {name: (m, m.parametrizations.weight.original0, m.parametrizations.weight.original1,
                   m.parametrizations.weight.original2)
            for name, m in root.named_modules() if parametrize.is_parametrized(m, "weight")}


def _per_weight(values: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """A scale or zero point per row ([out, 1]) or per group ([out, in / group]) spread to each weight."""
    return values.double().repeat_interleave(q.shape[1] // values.shape[1], dim=1)


def _dequantized(q, scale, zero) -> torch.Tensor:
    """The weight by hand, in float64: the int8 values, less the zero point, times the scale of their group."""
    return (q.double() - _per_weight(zero, q)) * _per_weight(scale, q)


def _dequantized_linear(x: torch.Tensor, q, scale, zero, bias) -> torch.Tensor:
    return x.double() @ _dequantized(q, scale, zero).T + (bias.detach().double() if bias is not None else 0.0)


def test_lerobots_policy_is_quantized_as_the_unit_layer_for_layer(bf16_quantized):
    """The policy check's reference: LeRobot's float32 policy holds, in every linear layer but the excluded one,
    int8 values within half a step of its own weights rounded to bf16 (the weights the bf16 unit quantized),
    the very int8 values and scales of the unit, and computes that layer in float32."""
    recipe, report, _, unit, policy, loaded = bf16_quantized
    count = quantizing.quantize_policy(policy, report.get("quantization")["applied"], recipe.unit.quantize)
    layers = _int8_layers(policy)
    # Every linear layer but the excluded one and those whose input width is not a whole number of groups.
    expected = {name for name, w in loaded.items() if name != "model.proprio_encoder" and w.shape[1] % 32 == 0}
    assert set(layers) == expected and count == len(layers) == 52
    assert isinstance(policy.model.proprio_encoder.weight, torch.nn.Parameter)  # excluded: left as it was
    unit_layers = {name: v for m in unit.methods.values() for name, v in _int8_layers(m.module).items()}
    for name, (linear, q, scale, zero) in layers.items():
        weight = loaded[name]
        # Fast-WAM's unit holds its time embedding layers in float32; the rest is bf16.
        source = weight if "time_" in name else weight.to(torch.bfloat16)
        step = _per_weight(scale, q)
        assert float(((_dequantized(q, scale, zero) - source.double()).abs() - step / 2).max()) \
            <= 1e-6 * float(weight.abs().max())
        _, unit_q, unit_scale, _ = unit_layers[name.removeprefix("model.")]
        assert torch.equal(q, unit_q) and torch.equal(scale, unit_scale.float())
        x = torch.randn(3, linear.in_features, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            got = linear(x)
        want = _dequantized_linear(x, q, scale, zero, linear.bias)
        assert got.dtype == torch.float32 and float((got.double() - want).norm() / want.norm()) < 1e-6


def test_verification_judges_a_quantized_bf16_unit_against_its_own_int8_weights_in_float32(bf16_quantized,
                                                                                           monkeypatch):
    """verify_unit_step's references for a quantized bf16 unit: eager is the quantized unit itself, and the bf16
    rule's float32 reference holds the unit's int8 values and scales and computes each layer in float32."""
    from zoo.export import stages

    recipe, report, run, unit, _, _ = bf16_quantized
    seen = {}
    monkeypatch.setattr(stages, "verify_step", lambda *args, **kwargs: seen.update(kwargs))
    stages.verify_unit_step(run, recipe, report, unit, device="cpu")
    references = seen["references"]
    assert references["exported"]["action_step"] is unit.methods["action_step"].module
    wide = _int8_layers(references["reference_fp32"]["action_step"])
    own = _int8_layers(unit.methods["action_step"].module)
    assert set(wide) == set(own) and len(wide) == 52
    for name, (linear, q, scale, zero) in wide.items():
        assert torch.equal(q, own[name][1]) and torch.equal(scale, own[name][2])
        x = torch.randn(2, linear.in_features, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            got = linear(x)
        want = _dequantized_linear(x, q, scale, zero, linear.bias)
        assert got.dtype == torch.float32 and float((got.double() - want).norm() / want.norm()) < 1e-6


def test_what_quantization_costs_the_actions_is_reported_and_fails_only_past_the_bound():
    from zoo.export.quant_cost import policy_cost
    from zoo.runner.check import ChunkRow, PolicyCheckResult

    generator = torch.Generator().manual_seed(0)
    unquantized = {0: [torch.randn(7, generator=generator) for _ in range(5)]}
    # Chunk 1 (3 actions) moved by 0.1 %, chunk 2 (2 actions) by 1 %: relative L2 1e-3 and 1e-2 exactly.
    quantized = {0: [a * (1 + 1e-3) if i < 3 else a * (1 - 1e-2) for i, a in enumerate(unquantized[0])]}
    recipe = load_recipe("fast-wam-tiny", ["unit.quantize=int8-weight-only"])
    cost = policy_cost(quantized, unquantized, {0: [3, 2]}, recipe)
    assert [r["rel_l2"] for r in cost["rows"]] == pytest.approx([1e-3, 1e-2], rel=1e-4)  # float32 actions
    assert cost["passed"] and "not a task-success figure" in cost["table"] and "reported only" in cost["table"]
    bounded = load_recipe("fast-wam-tiny", ["unit.quantize=int8-weight-only", "unit.quantize.bound.rel_l2=5e-3"])
    cost = policy_cost(quantized, unquantized, {0: [3, 2]}, bounded)
    assert [r["ok"] for r in cost["rows"]] == [True, False] and not cost["passed"]
    runner_matches = ChunkRow(1, 5, [5, 7], 0.0, 0.0, 1.0, 1e-5, True)
    result = PolicyCheckResult([runner_matches], "eager", "cpu", 0, "float32", quantization_cost=cost)
    assert not result.ok and "unit.quantize.bound" in result.verdict() and "> bound 0.005" in result.table()
