"""``torch.export`` each method of an export unit, with the recipe's dynamic dims.

Export runs on the CPU under ``torch.no_grad()`` (so LeRobot's grad-mode regions do not become
``wrap_with_set_grad_enabled`` sub-graphs) and non-strict (the policies' Python is traced, not bytecode-
analysed). The example sizes lie strictly inside each dynamic range: torch.export specialises 0 and 1, and a
size on a bound can let a guard pin the dim to that bound.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Dict, Optional

import torch
from torch.export import ExportedProgram

from zoo.core.errors import ExportError, first_line
from zoo.policies.base import ExportUnit, MethodSpec

log = logging.getLogger("zoo.export.trace")

HALF = (torch.bfloat16, torch.float16)


def example_sizes(recipe) -> Dict[str, int]:
    """Sizes to trace with: the recipe's integer ``inputs``, plus one inside each dynamic range not given there.

    Picked sizes differ from each other, because torch.export gives inputs of equal size one symbol
    ("duck sizing") and two dims that merely happen to match would be tied together.
    """
    sizes = {k: int(v) for k, v in recipe.inputs.items() if isinstance(v, int) and not isinstance(v, bool)}
    for dim, rng in recipe.dynamic.items():
        if dim in sizes:
            continue
        taken = set(sizes.values())
        size = rng.min + 1
        while size in taken and size + 1 < rng.max:
            size += 1
        sizes[dim] = size
    return sizes


def export_dims(recipe) -> Dict[str, torch.export.Dim]:
    return {name: torch.export.Dim(name, min=int(r.min), max=int(r.max)) for name, r in recipe.dynamic.items()}


def export_method(method: MethodSpec, recipe, sizes: Optional[Dict[str, int]] = None) -> ExportedProgram:
    """``torch.export.export`` one method at the example sizes with the recipe's dynamic dims."""
    sizes = dict(sizes or example_sizes(recipe))
    unknown = sorted({d for s in method.inputs for d in s.shape if isinstance(d, str)} - set(sizes))
    if unknown:
        raise ExportError(f"method {method.name!r}: input sizes {unknown} are neither recipe inputs nor dynamic dims",
                          "add them to the recipe's `inputs` (static) or `dynamic` (with min and max)")
    args = method.example_inputs(sizes)
    dynamic_shapes = method.dynamic_shapes(export_dims(recipe))
    try:
        with torch.no_grad():
            return torch.export.export(method.module, args, dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as exc:
        log.debug("torch.export of %s failed", method.name, exc_info=True)
        raise ExportError(f"torch.export of method {method.name!r} failed at sizes {sizes}: "
                          f"{type(exc).__name__}: {first_line(exc)}",
                          "rerun with --verbose for the traceback; a data-dependent guard usually means the "
                          "family must make a size static (recipe inputs) or a dynamic range narrower") from exc


def export_unit(unit: ExportUnit, recipe) -> Dict[str, ExportedProgram]:
    """Export every method the recipe names, in the recipe's order."""
    check_methods(unit, recipe)
    sizes = example_sizes(recipe)
    return {name: export_method(unit.methods[name], recipe, sizes) for name in recipe.unit.methods}


def check_methods(unit: ExportUnit, recipe) -> None:
    if list(unit.methods) != list(recipe.unit.methods):
        raise ExportError(f"family {recipe.family!r} built methods {list(unit.methods)} but the recipe names "
                          f"{list(recipe.unit.methods)}", "set unit.methods to the methods the family provides")


def float32_copy(unit: ExportUnit) -> ExportUnit:
    """The same unit in float32, to judge a bf16 unit against.

    The methods' modules are deep-copied together, so submodules and buffers they share stay shared, and
    only half-precision tensors are widened: float64 tables a policy keeps on purpose stay float64. A quantized
    unit's copy keeps its int8 weights and scales and dequantizes them in float32 (``dequantize_in_float32``).
    """
    modules = copy.deepcopy({name: m.module for name, m in unit.methods.items()})
    holder = torch.nn.ModuleDict({f"m_{name}": mod for name, mod in modules.items()})
    # One _apply over the holder visits a shared submodule once (Module.float() would also narrow float64).
    holder._apply(lambda t: t.float() if t.dtype in HALF else t)
    dequantize_in_float32(holder)
    methods = {}
    for name, m in unit.methods.items():
        inputs = [dataclasses.replace(s, dtype="float32") if s.torch_dtype() in HALF else s for s in m.inputs]
        methods[name] = dataclasses.replace(m, module=holder[f"m_{name}"], inputs=inputs)
    return dataclasses.replace(unit, methods=methods, reference=None, policy=None)


def dequantize_in_float32(root: torch.nn.Module) -> None:
    """Every weight of ``root`` quantized by zoo.export.quantize dequantized in float32 from now on.

    Such a weight is rebuilt at each call, from its int8 values, scales and zero points, by the parametrization
    torchao's ``unwrap_tensor_subclass`` left; its metadata keeps the dtype the weight was quantized from, and
    torchao's per-group path dequantizes in that dtype (measured: a bf16 layer's float32 copy 1.3e-3 from float32
    dequantization, 9e-8 once widened). ``_apply`` widens the scales but not that metadata."""
    for module in root.modules():
        for parametrizations in getattr(module, "parametrizations", {}).values():
            for rebuild in parametrizations:
                stack = getattr(rebuild, "rebuild_stack", None)
                if stack:
                    rebuild.rebuild_stack = [(kind, {**meta, "dtype": torch.float32}
                                              if meta.get("dtype") in HALF else meta, inner)
                                             for kind, meta, inner in stack]
