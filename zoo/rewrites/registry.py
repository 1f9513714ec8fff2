"""The table of zoo's rewrites: each pass registers its entry point, by name, with ``@rewrite(NAME)``.

A registration also says which of the pass's keyword arguments come from the recipe
(``@rewrite(NAME, complex128_as="rotary_pairs")``), so that the pipeline runs every rewrite the same way,
without knowing any of them by name. A name is registered once: a second registration is refused, naming both
(re-importing a pass module with ``importlib.reload`` is one too: the package would keep the old function).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Dict, Tuple

from zoo.rewrites.result import RewriteResult

Rewrite = Callable[..., RewriteResult]


class RegistrationError(ValueError):
    """A rewrite registered twice under one name, or registered with arguments it cannot take: a bug in zoo
    (or in code that registers its own rewrites), so it keeps its traceback."""


@dataclass(frozen=True)
class Registration:
    name: str
    function: Rewrite
    recipe_args: Tuple[Tuple[str, str], ...]  # (keyword argument of the function, recipe field it takes)

    @property
    def origin(self) -> str:
        return f"{self.function.__module__}.{self.function.__qualname__}"

    def bound(self, recipe: Any) -> Callable[[Any], RewriteResult]:
        """The rewrite as a function of the program alone, with the recipe's values for its arguments."""
        return functools.partial(self.function, **{arg: getattr(recipe, field) for arg, field in self.recipe_args})


_REGISTRY: Dict[str, Registration] = {}


def rewrite(name: str, **recipe_args: str) -> Callable[[Rewrite], Rewrite]:
    """Register the decorated function as the rewrite ``name``; ``recipe_args`` maps its keyword arguments to
    the recipe fields that set them. The function is returned as it is."""

    def register(function: Rewrite) -> Rewrite:
        registration = Registration(name, function, tuple(sorted(recipe_args.items())))
        _check_signature(registration)
        existing = _REGISTRY.get(name)
        if existing is not None:
            raise RegistrationError(
                f"rewrite {name!r} is registered twice: by {existing.origin} and by {registration.origin}; "
                "give one of them another name"
            )
        _REGISTRY[name] = registration
        return function

    return register


def _check_signature(registration: Registration) -> None:
    """A rewrite is called as ``function(program)``, the recipe's arguments by keyword, so every parameter after
    the program needs a default and every recipe argument must be one of them."""
    params = list(inspect.signature(registration.function).parameters.values())
    where = f"rewrite {registration.name!r} ({registration.origin})"
    if not params:
        raise RegistrationError(f"{where} takes no program argument")
    optional = {p.name for p in params[1:] if p.default is not inspect.Parameter.empty}
    required = [p.name for p in params[1:] if p.default is inspect.Parameter.empty
                and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if required:
        raise RegistrationError(f"{where}: parameters {required} have no default; a rewrite must run on the "
                                "program alone")
    unknown = [arg for arg, _ in registration.recipe_args if arg not in optional]
    if unknown:
        raise RegistrationError(f"{where} has no keyword parameter(s) {unknown} for the recipe to set")


def registered() -> Dict[str, Registration]:
    """Every registration by name, in the order the modules registered them."""
    return dict(_REGISTRY)


def registration(name: str) -> Registration:
    if name not in _REGISTRY:
        raise KeyError(f"unknown rewrite {name!r}; known: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


__all__ = ["RegistrationError", "Registration", "rewrite", "registered", "registration"]
