"""Policy families, found by convention: a family named NAME is two modules in this package.

    zoo/policies/NAME.py          the family itself; it may import lerobot (the policies extra) at its top
        build_unit(checkpoint_dir: Path, recipe: Recipe) -> ExportUnit
        fabricate_checkpoint(recipe: Recipe, work_dir: Path) -> Dict[str, Path]
            seeded random weights in the checkpoint's real file layout; {repo_id: folder} for the recipe's repo
            and every auxiliary repo the policy loads by Hub id (VAE, text encoder, tokenizer)
        check_recipe(recipe: Recipe) (optional)
            raise RecipeError for what the family cannot build (methods, dtype, sizes); the pipeline calls it
            before anything is fabricated, downloaded or written (``check_recipe`` below)
    zoo/policies/NAME_options.py  the class NameOptions (``lingbot_va`` -> ``LingbotVaOptions``): a dataclass
        subclassing ``FamilyOptions`` whose fields are the recipe's ``unit.options`` keys, with types and defaults

The options live apart from the family because the recipe layer needs them whenever a recipe is loaded: they
type ``unit.options`` in the recipe schema, so an unknown option key or a value of the wrong type is refused
with the same error and did-you-mean as any recipe key. That includes ``python -m zoo list`` and
``python -m zoo.lower RUN_DIR`` on a machine without lerobot: an options module imports only the standard
library. The family module keeps lerobot at its top, so ``load_family`` can turn a missing extra into one clear
error when a unit is about to be built.

The list of families is the list of ``*_options`` modules here (``family_names``), read from the package
folder without importing anything; nothing else names them.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, is_dataclass
from types import ModuleType
from typing import Callable, List, Type

from ..errors import ExportError, RecipeError

OPTIONS_SUFFIX = "_options"


@dataclass
class FamilyOptions:
    """Base of every family's options dataclass. Its fields are the option keys; the schema checks their names
    and types, ``validate`` what types cannot say."""

    def validate(self, fail: Callable[[str, str], None]) -> None:
        """Check ranges and allowed words; on a bad value call ``fail(what, hint)`` (it raises RecipeError).
        Called by ``Recipe.validate``; checks that need the policy's own config classes (lerobot) belong in
        the family module, at build time."""


def family_names() -> List[str]:
    """Every family, sorted: the NAME of each NAME_options module in this package (none is imported)."""
    return sorted(info.name[: -len(OPTIONS_SUFFIX)] for info in pkgutil.iter_modules(__path__)
                  if not info.ispkg and info.name.endswith(OPTIONS_SUFFIX) and len(info.name) > len(OPTIONS_SUFFIX))


def options_class_name(name: str) -> str:
    """``lingbot_va`` -> ``LingbotVaOptions``."""
    return "".join(part.capitalize() for part in name.split("_")) + "Options"


def options_class(name: str) -> Type[FamilyOptions]:
    """The dataclass of family ``name``'s ``unit.options``, from its light options module (no lerobot)."""
    if name not in family_names():
        raise RecipeError(f"unknown policy family {name!r}", f"families: {', '.join(family_names())}")
    module = importlib.import_module(f"{__name__}.{name}{OPTIONS_SUFFIX}")
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
        return importlib.import_module(f"{__name__}.{name}")
    except ImportError as exc:
        raise ExportError(
            f"policy family {name!r} cannot be imported: {exc}",
            "building export units needs the policies extra: pip install 'zoo[policies]' (Python >= 3.12); "
            "lowering and verifying a saved run (`python -m zoo.lower RUN_DIR`) does not",
        ) from exc


def check_recipe(recipe) -> None:
    """Refuse a recipe its family cannot build (``unit.methods=[nope]``) before anything is fabricated,
    downloaded or written: the family's own ``check_recipe`` where it has one. The family module is imported
    now, so a missing policies extra is refused here too."""
    check = getattr(load_family(recipe.family), "check_recipe", None)
    if check is not None:
        check(recipe)
