"""Policy families, found by convention: a family named NAME is a folder here.

    zoo/policies/NAME/options.py  ``NameOptions`` (``lingbot_va`` -> ``LingbotVaOptions``): the dataclass that types
        the recipe's ``unit.options``; standard library only, so recipes load without lerobot
    zoo/policies/NAME/unit.py     the export unit; it may import lerobot (the policies extra) at its top:
        build_unit(checkpoint_dir, recipe) -> ExportUnit
        fabricate_checkpoint(recipe, work_dir) -> {repo_id: folder}   seeded weights in the real file layout
        check_recipe(recipe)  (optional) refuse what the family cannot build, before anything is downloaded
        lerobot_policy(checkpoint_dir, recipe, device), embed_prompt(policy, task)  LeRobot's own side

The list of families is the list of folders with an ``options.py`` (``family_names``), read without importing
anything; nothing else names them.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, is_dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable, List, Type

from zoo.core.errors import ExportError, RecipeError

OPTIONS_MODULE = "options"  # zoo/policies/NAME/options.py: the light half
UNIT_MODULE = "unit"  # zoo/policies/NAME/unit.py: the export unit (may import lerobot)


@dataclass
class FamilyOptions:
    """Base of every family's options dataclass. Its fields are the option keys; the schema checks their names
    and types, ``validate`` what types cannot say."""

    def validate(self, fail: Callable[[str, str], None]) -> None:
        """Check ranges and allowed words; on a bad value call ``fail(what, hint)`` (it raises RecipeError).
        Called by ``Recipe.validate``; checks that need the policy's own config classes (lerobot) belong in
        the family module, at build time."""


def family_names() -> List[str]:
    """Every family, sorted: each sub-package here that has an ``options`` module (nothing is imported)."""
    return sorted(info.name for info in pkgutil.iter_modules(__path__)
                  if info.ispkg and (Path(info.module_finder.path) / info.name / f"{OPTIONS_MODULE}.py").is_file())


def options_class_name(name: str) -> str:
    """``lingbot_va`` -> ``LingbotVaOptions``."""
    return "".join(part.capitalize() for part in name.split("_")) + "Options"


def options_class(name: str) -> Type[FamilyOptions]:
    """The dataclass of family ``name``'s ``unit.options``, from its light options module (no lerobot)."""
    if name not in family_names():
        raise RecipeError(f"unknown policy family {name!r}", f"families: {', '.join(family_names())}")
    module = importlib.import_module(f"{__name__}.{name}.{OPTIONS_MODULE}")
    cls = getattr(module, options_class_name(name), None)
    if not (isinstance(cls, type) and is_dataclass(cls) and issubclass(cls, FamilyOptions)):
        # A family written against the convention wrongly: a bug in zoo, so no ZooError (it keeps its traceback).
        raise TypeError(f"{module.__name__} must define the dataclass {options_class_name(name)}(FamilyOptions)")
    return cls


def load_family(name: str) -> ModuleType:
    """The family module ``zoo.policies.<name>``, imported now (it may import lerobot)."""
    if name not in family_names():
        raise ExportError(f"unknown policy family {name!r}", f"families: {', '.join(family_names())}")
    try:
        return importlib.import_module(f"{__name__}.{name}.{UNIT_MODULE}")
    except ImportError as exc:
        raise ExportError(
            f"policy family {name!r} cannot be imported: {exc}",
            "building export units needs the policies extra: pip install 'zoo[policies]' (Python >= 3.12); "
            "lowering and verifying a saved run (`python -m zoo lower RUN_DIR`) does not",
        ) from exc


def check_recipe(recipe) -> None:
    """Refuse a recipe its family cannot build (``unit.methods=[nope]``) before anything is fabricated,
    downloaded or written: the family's own ``check_recipe`` where it has one. The family module is imported
    now, so a missing policies extra is refused here too."""
    check = getattr(load_family(recipe.family), "check_recipe", None)
    if check is not None:
        check(recipe)
