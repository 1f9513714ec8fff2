"""Every policy family keeps the same contract (zoo/policies/__init__.py): a module zoo.policies.<family> with
``build_unit`` and ``fabricate_checkpoint``, and a light zoo.policies.<family>_options module whose
``<Family>Options`` dataclass types the recipe's ``unit.options``. Option keys are checked when a recipe loads,
with the errors every recipe key gets: an unknown key names the closest one, a wrong type names the type.

Parametrized over ``family_names()``, so a new family is held to this as soon as its options module exists
(the test session's toy family, tests/families, included).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any, Dict

import pytest

import zoo.policies
from zoo.core.errors import ExportError, RecipeError
from zoo.policies import FamilyOptions, family_names, load_family, options_class
from zoo.contract.recipes import load_recipe

FAMILIES = family_names()
SHIPPED = Path(zoo.policies.__file__).resolve().parent
ENTRY_POINTS = {"build_unit": ["checkpoint_dir", "recipe"], "fabricate_checkpoint": ["recipe", "work_dir"]}

# How the schema words each option type, and a value of the wrong type for it (hand-written, not zoo's table).
TYPE_WORDS = {int: "int", float: "float", str: "str", bool: "bool (true/false)",
              Dict[str, Any]: "a mapping to any value"}
WRONG_VALUE = {int: "abc", float: "abc", str: "[1,2]", bool: "maybe", Dict[str, Any]: "abc"}


def option_fields(family: str):
    return [(family, f.name) for f in dataclasses.fields(options_class(family))]


FIELDS = [case for family in FAMILIES for case in option_fields(family)]


def minimal_recipe(tmp_path: Path, family: str, options: str = "{}") -> str:
    path = tmp_path / "m.yaml"
    path.write_text(f"family: {family}\nsource: {{repo_id: org/model}}\n"
                    f"unit: {{methods: [forward], options: {options}}}\n")
    return str(path)


def wrong_type_case(family: str, field: str):
    """(a wrong value, the words the error must give for the field's type)."""
    tp = typing.get_type_hints(options_class(family))[field]
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union and type(None) in args:
        inner = next(a for a in args if a is not type(None))
        return WRONG_VALUE[inner], f"{TYPE_WORDS[inner]} or null"
    return WRONG_VALUE[tp], TYPE_WORDS[tp]


def test_the_shipped_families_are_found():
    assert {"llama", "lingbot_va", "fast_wam"} <= set(FAMILIES)
    assert options_class("lingbot_va").__name__ == "LingbotVaOptions"


def test_every_module_that_builds_units_is_a_family_and_every_family_builds_units():
    # One source of names: a family module without an options module (or the reverse) would drop out unseen.
    builders = {path.stem for path in SHIPPED.glob("*.py")
                if any(isinstance(node, ast.FunctionDef) and node.name == "build_unit"
                       for node in ast.parse(path.read_text()).body)}
    shipped = {name for name in FAMILIES if (SHIPPED / f"{name}_options.py").is_file()}
    assert builders == shipped


@pytest.mark.parametrize("family", FAMILIES)
def test_options_are_a_dataclass_with_defaults_for_every_key(family):
    cls = options_class(family)
    assert dataclasses.is_dataclass(cls) and issubclass(cls, FamilyOptions)
    assert dataclasses.fields(cls), "a family with no options still declares the (empty) dataclass"
    cls()  # every key has a default: a recipe without unit.options loads
    assert callable(cls.validate)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_module_has_the_entry_points(family):
    try:
        module = load_family(family)
    except ExportError as exc:  # lerobot (the policies extra) is not installed
        pytest.skip(str(exc).splitlines()[0])
    for name, params in ENTRY_POINTS.items():
        function = getattr(module, name, None)
        assert callable(function), f"zoo.policies.{family} has no {name}"
        assert list(inspect.signature(function).parameters) == params


@pytest.mark.parametrize("family", FAMILIES)
def test_a_minimal_recipe_gets_the_default_options_and_round_trips(family, tmp_path):
    recipe = load_recipe(minimal_recipe(tmp_path, family))
    assert recipe.unit.options == options_class(family)()
    saved = tmp_path / "resolved.yaml"  # what a run folder keeps, read back by zoo.lower
    saved.write_text(recipe.to_yaml())
    assert load_recipe(str(saved), check_name=False).unit.options == recipe.unit.options


@pytest.mark.parametrize("family, field", FIELDS)
def test_unknown_option_key_names_the_close_key(family, field, tmp_path):
    typo = f"{field}x"
    with pytest.raises(RecipeError) as err:
        load_recipe(minimal_recipe(tmp_path, family), [f"unit.options.{typo}=1"])
    assert f"bad override 'unit.options.{typo}=1'" in str(err.value)
    assert f"unit.options.{typo}" in err.value.message
    keys = ", ".join(name for _, name in option_fields(family))
    assert err.value.hint == f"did you mean unit.options.{field}? keys of unit.options: {keys}"


@pytest.mark.parametrize("family, field", FIELDS)
def test_unknown_option_key_in_a_file_names_the_close_key(family, field, tmp_path):
    path = minimal_recipe(tmp_path, family, options=f"{{{field}x: 1}}")
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert "does not fit the schema" in err.value.message and f"unit.options.{field}x" in err.value.message
    assert err.value.hint.startswith(f"did you mean unit.options.{field}?")


@pytest.mark.parametrize("family, field", FIELDS)
def test_option_of_the_wrong_type_names_the_type(family, field, tmp_path):
    value, words = wrong_type_case(family, field)
    with pytest.raises(RecipeError) as err:
        load_recipe(minimal_recipe(tmp_path, family), [f"unit.options.{field}={value}"])
    assert f"unit.options.{field} takes {words}, not {value!r}" in err.value.message


@pytest.mark.parametrize("family, field", FIELDS)
def test_option_of_the_wrong_type_in_a_file_names_the_key(family, field, tmp_path):
    value, _ = wrong_type_case(family, field)
    with pytest.raises(RecipeError) as err:
        load_recipe(minimal_recipe(tmp_path, family, options=f"{{{field}: {value}}}"))
    assert "does not fit the schema" in err.value.message and f"unit.options.{field}:" in err.value.message


def test_options_follow_a_family_override():
    # family= is an override like any other: unit.options are then typed by the new family's dataclass.
    with pytest.raises(RecipeError) as err:
        load_recipe("lingbot-va-tiny", ["family=fast_wam"])
    assert "unit.options.policy_config" in err.value.message and "FastWamOptions" in err.value.message
    assert err.value.hint.endswith("keys of unit.options: num_inference_steps, sigma_shift, fabricate_config, fabricate_stats")


@pytest.mark.parametrize("override, words", [
    ("unit.options.num_inference_steps=0", "unit.options.num_inference_steps=0"),
    ("unit.options.sigma_shift=-1.0", "unit.options.sigma_shift=-1.0"),
])
def test_option_values_are_checked_when_the_recipe_loads(override, words):
    # FastWamOptions.validate: ranges, checked by Recipe.validate before anything is pulled or built.
    with pytest.raises(RecipeError) as err:
        load_recipe("fast-wam", [override])
    assert err.value.message == f"recipe 'fast-wam': {words}"


def test_unknown_family_is_refused_with_the_families():
    with pytest.raises(ExportError, match="unknown policy family 'resnet'") as err:
        load_family("resnet")
    assert all(name in err.value.hint for name in FAMILIES)
    with pytest.raises(RecipeError, match="unknown policy family 'resnet'"):
        options_class("resnet")


def test_recipes_and_options_load_without_lerobot():
    # A fresh interpreter (tests/families is not on its path): the options modules import the standard
    # library only, and loading every shipped recipe imports no lerobot, transformers or diffusers.
    code = """
import sys
from zoo import policies
for name in policies.family_names():
    policies.options_class(name)
assert "torch" not in sys.modules, "an options module imported torch"
from zoo.contract.recipes import load_recipe, recipe_names
for name in recipe_names():
    load_recipe(name)
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"lerobot", "transformers", "diffusers"})
assert not heavy, heavy
print(",".join(policies.family_names()))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["fast_wam,lingbot_va,llama"]
