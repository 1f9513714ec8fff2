"""The recipe's ``unit.quantize``: weight-only quantization of the export unit's linear layers before
``torch.export`` (docs/quantization.md).

    unit:
      quantize:
        scheme: int8-weight-only        # none | int8-weight-only | int4-weight-only
        group_size: null                # int8: null = one scale per output row; int4: 32, 64, 128 or 256
        exclude: ["*norm*", "*time_embedding*"]   # fnmatch patterns over module names, kept in unit.dtype
        bound: {rel_l2: 0.05}           # what quantization may cost against the unquantized unit (optional)

``unit.quantize: int8-weight-only`` (a plain word, in the file or as an override) is short for
``unit.quantize.scheme: int8-weight-only``. Kept apart from ``recipes.py`` so the schema of one option is read
in one place; standard library only, as every schema module.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence

NONE = "none"
INT8 = "int8-weight-only"
INT4 = "int4-weight-only"
SCHEMES = (NONE, INT8, INT4)
# torchao's Int4WeightOnlyConfig documents these group sizes (the tinygemm kernel's).
INT4_GROUP_SIZES = (32, 64, 128, 256)
INT4_DEFAULT_GROUP = 128

# Why int4 weight-only cannot be built by the export line at torch 2.11 / torchao 0.18, as measured on the CPU
# (docs/quantization.md has the probe). The one int4 format ExecuTorch's CUDA backend runs is torchao's
# tile_packed_to_4d (tinygemm), which packs with aten::_convert_weight_to_int4pack and multiplies with
# aten::_weight_int4pack_mm; neither op has a CPU kernel, and the export line checks every program on the CPU.
INT4_BLOCKED = (
    "int4-weight-only is blocked in the CPU export line: the only int4 layout ExecuTorch 1.2's CUDA backend runs "
    "(torchao's tile_packed_to_4d, its one allowed fallback kernel aten::_weight_int4pack_mm) is packed by "
    "aten::_convert_weight_to_int4pack, and neither op has a CPU kernel at torch {torch} ('Could not run ... "
    "with arguments from the CPU backend'); torchao's other int4 layouts need mslk (CUDA) or an XPU/NPU. "
    "The CPU check could not run the program either")
INT4_WHAT_TO_DO = ("use unit.quantize.scheme=int8-weight-only on this line; int4 needs the unit packed and "
                   "checked on an sm_80+ NVIDIA GPU (docs/quantization.md, 'What needs a GPU')")


@dataclass
class QuantizeBound:
    """What quantization may cost: the quantized unit (eager) against the unquantized one, per output, and the
    policy check's actions against LeRobot's unquantized policy. None: measured and reported, not bounded."""

    rel_l2: Optional[float] = None  # relative L2 of each output (and each action chunk)
    min_cosine: Optional[float] = None


@dataclass
class Quantize:
    scheme: str = NONE
    group_size: Optional[int] = None
    # fnmatch patterns over each method module's qualified module names (``blocks.0.attn.q``); a linear
    # layer whose name matches any keeps its weights in unit.dtype. Each pattern must match a module.
    exclude: List[str] = field(default_factory=list)
    bound: QuantizeBound = field(default_factory=QuantizeBound)

    @property
    def enabled(self) -> bool:
        return self.scheme != NONE

    def words(self) -> str:
        """The scheme as the report and the card name it: ``int8-weight-only (per row)``."""
        if not self.enabled:
            return NONE
        if self.scheme == INT4:
            return f"{INT4} (group {self.group_size or INT4_DEFAULT_GROUP})"
        return f"{INT8} ({'per row' if self.group_size is None else f'group {self.group_size}'})"


def validate_quantize(quantize: Quantize, dtype: str, fail: Callable[[str, str], None]) -> None:
    """Allowed words and ranges of ``unit.quantize``; ``fail(what, hint)`` raises the RecipeError."""
    if quantize.scheme not in SCHEMES:
        fail(f"unit.quantize.scheme={quantize.scheme!r} is not a quantization scheme",
             f"use one of: {', '.join(SCHEMES)}")
    group = quantize.group_size
    if quantize.scheme == INT4 and group is not None and group not in INT4_GROUP_SIZES:
        fail(f"unit.quantize.group_size={group} for {INT4}",
             f"use one of {', '.join(map(str, INT4_GROUP_SIZES))} (torchao's tinygemm layout), or null for "
             f"{INT4_DEFAULT_GROUP}")
    if quantize.scheme == INT8 and group is not None and group < 1:
        fail(f"unit.quantize.group_size={group} for {INT8}", "use null (one scale per output row) or a size >= 1")
    if quantize.scheme == NONE and (group is not None or quantize.exclude):
        fail("unit.quantize sets group_size or exclude but its scheme is none",
             f"set unit.quantize.scheme to one of {', '.join(SCHEMES[1:])}, or drop the other keys")
    if quantize.scheme == INT4 and dtype != "bfloat16":
        fail(f"unit.quantize.scheme={INT4} with unit.dtype={dtype}",
             "torchao's tinygemm int4 layout takes bf16 weights only: set unit.dtype=bfloat16")
    for pattern in quantize.exclude:
        if not str(pattern).strip():
            fail("unit.quantize.exclude has an empty pattern", "give fnmatch patterns such as '*norm*'")
    bound = quantize.bound
    if bound.rel_l2 is not None and not bound.rel_l2 > 0:
        fail(f"unit.quantize.bound.rel_l2={bound.rel_l2} is not positive", "a bound is > 0, or null for none")
    if bound.min_cosine is not None and not -1.0 <= bound.min_cosine <= 1.0:
        fail(f"unit.quantize.bound.min_cosine={bound.min_cosine}", "a cosine lies in [-1, 1]")


def expand_shorthand(loaded: Any) -> Any:
    """A recipe file's ``unit.quantize: WORD`` as ``unit.quantize: {scheme: WORD}`` (omegaconf DictConfig)."""
    unit = loaded.get("unit") if hasattr(loaded, "get") else None
    value = unit.get("quantize") if hasattr(unit, "get") else None
    if isinstance(value, str):
        unit.quantize = {"scheme": value}
    return loaded


def expand_override(item: str) -> str:
    """The override ``unit.quantize=WORD`` as ``unit.quantize.scheme=WORD``; any other override as given."""
    key, eq, value = item.partition("=")
    if eq and key.strip() == "unit.quantize" and value.strip() and not value.strip().startswith("{"):
        return f"unit.quantize.scheme={value.strip()}"
    return item


def scheme_of(recipe_dict: Any) -> Optional[dict]:
    """The ``unit.quantize`` mapping of a resolved recipe as a dict (a report's or manifest's), or None when the
    recipe does not quantize; readers of saved runs use it and need no Recipe."""
    quantize = ((recipe_dict or {}).get("unit") or {}).get("quantize") or {}
    return quantize if isinstance(quantize, dict) and quantize.get("scheme", NONE) != NONE else None


def matching(patterns: Sequence[str], name: str) -> Optional[str]:
    """The first exclusion pattern ``name`` matches, or None."""
    return next((p for p in patterns if fnmatch.fnmatchcase(name, p)), None)
