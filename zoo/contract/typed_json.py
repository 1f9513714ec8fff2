"""Versioned JSON files read into dataclasses, strictly: the run folder's contract files go through here.

``check_format`` refuses a file whose ``format`` this zoo does not read (or that has none) before anything else
is looked at; ``decode`` then builds the dataclass field by field from its type hints and names the exact key
that is missing, unexpected or of the wrong type. The standard library and zoo.core only.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import PurePath
from typing import Any, Dict, Type, TypeVar, Union

from zoo.core.errors import ContractError

T = TypeVar("T")

FORMAT_KEY = "format"
_NONE = type(None)


def reexport_hint(file: str) -> str:
    name = PurePath(file).name
    return (f"re-export the run with this zoo (`python -m zoo.export RECIPE` writes {name} anew), or read the "
            "run with the zoo release that wrote it")


def check_format(data: Any, file_name: str, known: int) -> None:
    """Refuse ``data`` unless it is a JSON object whose ``format`` is ``known``."""
    if not isinstance(data, dict):
        raise ContractError(f"{file_name} holds a JSON {type(data).__name__}, not an object",
                            reexport_hint(file_name))
    if FORMAT_KEY not in data:
        raise ContractError(f"{file_name} has no \"{FORMAT_KEY}\" field, so zoo cannot tell which layout it has "
                            f"(zoo releases before the format was recorded wrote none); this zoo reads format {known}",
                            reexport_hint(file_name))
    found = data[FORMAT_KEY]
    if not isinstance(found, int) or isinstance(found, bool):
        raise ContractError(f"{file_name} has \"{FORMAT_KEY}\": {found!r}, not a whole number; this zoo reads "
                            f"format {known}", reexport_hint(file_name))
    if found != known:
        raise ContractError(f"{file_name} has format {found}; this zoo reads format {known}",
                            reexport_hint(file_name))


def decode(cls: Type[T], data: Any, file: str, where: str = "") -> T:
    """``data`` (parsed JSON) as dataclass ``cls``; ``file`` and the key path ``where`` name the place in error
    messages."""
    if not isinstance(data, dict):
        raise _malformed(file, where, "an object", data)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # ClassVars are not fields
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ContractError(f"{_place(file, where)} has unexpected key(s) {', '.join(unknown)}", reexport_hint(file))
    missing = [name for name, f in fields.items() if name not in data
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ContractError(f"{_place(file, where)} is missing key(s) {', '.join(missing)}", reexport_hint(file))
    return cls(**{name: _value(hints[name], data[name], file, _key(where, name)) for name in fields if name in data})


def encode(value: Any) -> Dict[str, Any]:
    """A dataclass as JSON-ready data (nested dataclasses, lists and dicts included)."""
    return dataclasses.asdict(value)


def _value(hint: Any, value: Any, file: str, where: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if dataclasses.is_dataclass(hint):
        return decode(hint, value, file, where)
    if origin is Union:
        if value is None:
            if _NONE in args:
                return None
            raise _malformed(file, where, _words(hint), value)
        for option in (a for a in args if a is not _NONE):
            try:
                return _value(option, value, file, where)
            except ContractError:
                continue
        raise _malformed(file, where, _words(hint), value)
    if origin is list:
        if not isinstance(value, list):
            raise _malformed(file, where, "a list", value)
        return [_value(args[0], v, file, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _malformed(file, where, "an object", value)
        return {k: _value(args[1], v, file, _key(where, k)) for k, v in value.items()}
    return _scalar(hint, value, file, where)


def _scalar(hint: Any, value: Any, file: str, where: str) -> Any:
    # bool is a subclass of int in Python, but true is no count of anything in these files.
    if hint is bool and isinstance(value, bool):
        return value
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if hint is str and isinstance(value, str):
        return value
    raise _malformed(file, where, _words(hint), value)


def _words(hint: Any) -> str:
    names = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}
    if typing.get_origin(hint) is Union:
        # Sorted: typing caches equal unions, so the order of a hint's options depends on what was built first.
        return " or ".join(sorted("null" if a is _NONE else _words(a) for a in typing.get_args(hint)))
    if typing.get_origin(hint) is list:
        return "a list"
    return names.get(hint, getattr(hint, "__name__", str(hint)))


def _key(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _place(file: str, where: str) -> str:
    """``io_spec.json`` or ``io_spec.json, key methods.forward``: the file, then the path of keys inside it."""
    return f"{file}, key {where}" if where else file


def _malformed(file: str, where: str, wanted: str, value: Any) -> ContractError:
    shown = repr(value) if len(repr(value)) < 80 else repr(value)[:77] + "..."
    return ContractError(f"{_place(file, where)} should be {wanted}, not {shown}", reexport_hint(file))
