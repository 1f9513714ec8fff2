"""Recipe schema: the shipped recipes load; unknown keys, ill-typed values, bad values and unknown names are
refused with messages that name the key and what to do."""

from __future__ import annotations

from pathlib import Path

import pytest

from zoo.core.errors import RecipeError
from zoo.contract.recipes import RECIPES_DIR, expected_type, load_recipe, recipe_names

from support.environment import TEST_RECIPES


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


MINIMAL = """
family: llama
source: {repo_id: org/model}
unit: {methods: [forward]}
dynamic:
  seq: {min: 2, max: 64}
"""


@pytest.mark.parametrize("name", recipe_names())
def test_every_shipped_recipe_loads(name):
    recipe = load_recipe(name)
    assert recipe.name == name == (RECIPES_DIR / f"{name}.yaml").stem
    assert recipe.unit.methods


def test_shipped_tiny_recipes_are_fabricated():
    # The README's main command must work with no network: the tiny recipes fabricate their checkpoints.
    tiny = recipe_names(pattern="*-tiny")
    assert {"llama-rope-tiny", "lingbot-va-tiny", "fast-wam-tiny"} <= set(tiny)
    assert all(load_recipe(n).source.fabricate for n in tiny)


def test_defaults_and_name_from_file(tmp_path):
    recipe = load_recipe(str(write(tmp_path, "my-model.variant", MINIMAL)))
    assert recipe.name == "my-model.variant"  # timm-style arch.tag names come from the file name
    assert recipe.source.revision == "main"
    assert recipe.unit.dtype == "float32"
    assert recipe.verify.seeds == [0]
    assert recipe.verify.tolerance.float32 == 1e-5
    assert recipe.rotary_pairs == "float64"


def test_overrides_apply_with_types(tmp_path):
    path = write(tmp_path, "m", MINIMAL)
    recipe = load_recipe(str(path), ["unit.dtype=bfloat16", "verify.seeds=[3,4]", "dynamic.seq.max=20",
                                     "verify.tolerance.float32=2e-5", "source.revision=v1.0",
                                     "unit.options.fabricate_config.num_hidden_layers=3",
                                     "lowering.max_mm_configs=null"])
    assert recipe.unit.dtype == "bfloat16"
    assert recipe.verify.seeds == [3, 4]
    assert recipe.dynamic["seq"].max == 20
    assert recipe.verify.tolerance.float32 == 2e-5
    assert recipe.source.revision == "v1.0"
    assert recipe.unit.options.fabricate_config == {"num_hidden_layers": 3}  # llama's options (LlamaOptions)
    assert recipe.lowering.max_mm_configs is None


def test_unknown_override_key_names_the_close_key(tmp_path):
    path = write(tmp_path, "m", MINIMAL)
    with pytest.raises(RecipeError) as err:
        load_recipe(str(path), ["unit.dtyp=bfloat16"])
    assert "unit.dtyp" in str(err.value)
    assert "did you mean unit.dtype" in err.value.hint


def test_unknown_top_level_override_lists_keys(tmp_path):
    with pytest.raises(RecipeError) as err:
        load_recipe(str(write(tmp_path, "m", MINIMAL)), ["rewritez=[]"])
    assert "did you mean rewrites" in err.value.hint


@pytest.mark.parametrize("item, meant", [
    ("verfy.seeds=[1]", "did you mean verify? keys of a recipe:"),  # the unknown key is the first part
    ("dynamic.seq.mn=3", "did you mean dynamic.seq.min? keys of dynamic.seq: min, max"),  # under a mapping
    ("unit.options.fabricate_confg.x=1", "did you mean unit.options.fabricate_config?"),  # a family's option
])
def test_unknown_key_inside_a_path_names_the_close_key(tmp_path, item, meant):
    with pytest.raises(RecipeError) as err:
        load_recipe(str(write(tmp_path, "m", MINIMAL)), [item])
    assert err.value.hint.startswith(meant)


@pytest.mark.parametrize("item, words", [
    ("verify.seeds=abc", "verify.seeds takes a list of int, not 'abc'"),
    ("verify.seeds=3", "verify.seeds takes a list of int"),
    ("lowering.max_mm_configs=many", "lowering.max_mm_configs takes int or null"),
    ("source.fabricate=maybe", "source.fabricate takes bool"),
    ("dynamic.seq.min=two", "dynamic.seq.min takes int"),
])
def test_ill_typed_override_says_the_type(tmp_path, item, words):
    with pytest.raises(RecipeError) as err:
        load_recipe(str(write(tmp_path, "m", MINIMAL)), [item])
    assert words in str(err.value)


def test_override_without_equals(tmp_path):
    with pytest.raises(RecipeError, match="expected KEY=VALUE"):
        load_recipe(str(write(tmp_path, "m", MINIMAL)), ["unit.dtype"])


@pytest.mark.parametrize("item, words", [
    ("unit.dtype=float16", "unit.dtype='float16' is not allowed"),
    ("rotary_pairs=complex64", "rotary_pairs='complex64' is not allowed"),
    ("lowering.kv_pool=shared", "lowering.kv_pool='shared' is not allowed"),
    ("rewrites=[no_such_rewrite]", "rewrites='no_such_rewrite' is not allowed"),
    ("family=resnet", "family='resnet' is not allowed"),
    ("unit.methods=[]", "unit.methods is empty"),
    ("unit.methods=[a,a]", "lists a method twice"),
    ("unit.methods=[bad-name]", "not an identifier"),
    ("verify.seeds=[]", "verify.seeds is empty"),
    ("verify.tolerance.float32=0", "is not positive"),
    ("source.repo_id=not a repo", "is not a Hub repo id"),
    ("source.fabricate_dtype=int8", "source.fabricate_dtype='int8'"),
])
def test_bad_values_are_refused(tmp_path, item, words):
    with pytest.raises(RecipeError) as err:
        load_recipe(str(write(tmp_path, "m", MINIMAL)), [item])
    assert words in str(err.value)


def test_bad_value_hint_lists_allowed(tmp_path):
    with pytest.raises(RecipeError) as err:
        load_recipe(str(write(tmp_path, "m", MINIMAL)), ["unit.dtype=float16"])
    assert err.value.hint == "use one of: float32, bfloat16, float64"


@pytest.mark.parametrize("items, words", [
    (["dynamic.seq.max=3"], "dynamic.seq has min=2 max=3"),  # no size strictly inside
    (["inputs.seq=2"], "inputs.seq=2"),  # the example size on a bound
    (["inputs.seq=64"], "strictly inside [2, 64]"),
    (["verify.sizes.seq=[100]"], "verify.sizes.seq has 100, outside [2, 64]"),
    (["verify.sizes.len=[4]"], "verify.sizes.len names no dynamic dim"),
])
def test_dynamic_ranges_are_checked(tmp_path, items, words):
    with pytest.raises(RecipeError) as err:
        load_recipe(str(write(tmp_path, "m", MINIMAL)), items)
    assert words in str(err.value)


def test_example_size_inside_range_is_accepted(tmp_path):
    recipe = load_recipe(str(write(tmp_path, "m", MINIMAL)), ["inputs.seq=10"])
    assert recipe.inputs == {"seq": 10}


def test_unknown_key_in_file(tmp_path):
    path = write(tmp_path, "m", MINIMAL + "verfy: {seeds: [1]}\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(str(path))
    assert "verfy" in str(err.value) and str(path) in str(err.value)


def test_ill_typed_value_in_file(tmp_path):
    path = write(tmp_path, "m", MINIMAL.replace("min: 2", "min: two"))
    with pytest.raises(RecipeError) as err:
        load_recipe(str(path))
    assert "dynamic.seq.min" in str(err.value)


def test_missing_required_key(tmp_path):
    path = write(tmp_path, "m", MINIMAL.replace("family: llama\n", ""))
    with pytest.raises(RecipeError) as err:
        load_recipe(str(path))
    assert "incomplete" in str(err.value) and "family" in str(err.value)


def test_a_name_that_does_not_match_the_file_is_a_warning(tmp_path, capsys):
    # A recipe copied under a new file name works; its name is the file name, and the stale name:
    # key is pointed out (it used to be refused).
    path = write(tmp_path, "m", "name: other\n" + MINIMAL)
    assert load_recipe(str(path)).name == "m"
    err = capsys.readouterr().err
    assert "warning:" in err and "says name: other" in err and "set it to m" in err


def test_local_dir_replaces_repo_id_check(tmp_path):
    recipe = load_recipe(str(write(tmp_path, "m", MINIMAL)), ["source.repo_id=just-a-label!",
                                                               f"source.local_dir={tmp_path}"])
    assert recipe.source.local_dir == str(tmp_path)


def test_unknown_recipe_lists_close_names():
    with pytest.raises(RecipeError) as err:
        load_recipe("toy-rop", recipes_dir=TEST_RECIPES)
    assert "unknown recipe 'toy-rop'" in str(err.value)
    assert "did you mean: toy-rope" in err.value.hint


def test_unknown_recipe_without_close_names_lists_all():
    with pytest.raises(RecipeError) as err:
        load_recipe("zzzzzz", recipes_dir=TEST_RECIPES)
    assert "known recipes: toy-pool, toy-rope" in err.value.hint


def test_recipe_names_pattern():
    assert recipe_names(TEST_RECIPES) == ["toy-pool", "toy-rope"]
    assert recipe_names(TEST_RECIPES, pattern="*rope") == ["toy-rope"]
    assert recipe_names(TEST_RECIPES, pattern="nothing*") == []


def test_expected_type_words():
    assert expected_type("verify.seeds") == "a list of int"
    assert expected_type("dynamic.seq.max") == "int"
    assert expected_type("source.local_dir") == "str or null"
    assert expected_type("verify.sizes") == "a mapping to a list of int"
    assert expected_type("unit.options.anything") == "any value"  # no family: options are not typed yet
    assert expected_type("unit.nope") is None
    # With a family, unit.options.* are its options dataclass's fields.
    assert expected_type("unit.options.num_inference_steps", "fast_wam") == "int or null"
    assert expected_type("unit.options.fabricate_config.anything", "llama") == "any value"
    assert expected_type("unit.options.anything", "fast_wam") is None


def test_summary_row(test_recipe):
    row = test_recipe("toy-rope").summary()
    assert row == {"name": "toy-rope", "family": "toy", "hub": "zoo-test/toy-rope", "methods": "forward",
                   "dtype": "float32",
                   "notes": "fabricated weights, offline; dynamic seq 2..24; Toy complex-rotary attention"}
    pinned = test_recipe("toy-pool", "source.revision=v2").summary()
    assert pinned["hub"] == "zoo-test/toy-pool@v2" and pinned["methods"] == "write, read"


def test_resolved_recipe_round_trips(tmp_path, test_recipe):
    recipe = test_recipe("toy-rope", "verify.seeds=[7]")
    path = tmp_path / "toy-rope.yaml"
    path.write_text(recipe.to_yaml())
    again = load_recipe(str(path))
    assert again.to_dict() == recipe.to_dict()


def test_variant_names_load_by_name(tmp_path):
    # timm-style arch.tag: a variant is its own file, named family-variant.tag, pinned to its own Hub id.
    write(tmp_path, "lingbot-va.libero-long", MINIMAL.replace("org/model", "lerobot/lingbot_va_libero_long"))
    write(tmp_path, "lingbot-va.robotwin", MINIMAL.replace("org/model", "lerobot/lingbot_va_robotwin"))
    recipe = load_recipe("lingbot-va.libero-long", recipes_dir=tmp_path)
    assert recipe.name == "lingbot-va.libero-long"
    assert recipe.source.repo_id == "lerobot/lingbot_va_libero_long"
    assert recipe_names(tmp_path, pattern="lingbot-va.*") == ["lingbot-va.libero-long", "lingbot-va.robotwin"]
    with pytest.raises(RecipeError) as err:
        load_recipe("lingbot-va.libero", recipes_dir=tmp_path)
    assert "lingbot-va.libero-long" in err.value.hint


@pytest.mark.parametrize("typed, meant", [("ON", "ON"), ("OFF", "OFF"), ("on", "ON"), ("'OFF'", "OFF")])
def test_triton_kernel_mode_override_means_what_was_typed(typed, meant):
    # YAML 1.1 turns an unquoted ON/OFF into a boolean; the recipe keeps the word the user typed.
    assert load_recipe("llama-rope-tiny", [f"lowering.triton_kernel_mode={typed}"]).lowering.triton_kernel_mode == meant
