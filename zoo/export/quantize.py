"""The quantize stage: the recipe's ``unit.quantize`` applied to the export unit's linear layers, in place,
before ``torch.export`` (docs/quantization.md).

torchao's ``quantize_`` replaces each chosen ``nn.Linear`` weight by a tensor subclass (``Int8Tensor``); its
``unwrap_tensor_subclass`` then turns the subclass into plain parameters behind a parametrization, as
ExecuTorch's own export stage does, so the program ``torch.export`` returns holds plain int8 weights and float32
scales and every later stage (rewrites, CPU check, preflight, lowering, loading a saved .pt2) sees ordinary ATen
ops and tensors, with no torchao needed to read it back. At torch 2.11 / torchao 0.18 int8 weight-only traces
to ``mm(x, to(w_int8, dtype)) * scale`` (per row) or ``torchao.dequantize_affine`` + ``mm`` (per group): no
``_weight_int8pack_mm`` and no fallback kernel.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

import torch

from zoo.contract import quantization as q
from zoo.core.errors import ExportError, QuantizationBlocked, RecipeError
from zoo.core.numerics import held_bytes
from zoo.export.trace import dequantize_in_float32, float32_copy
from zoo.policies.base import ExportUnit


def refuse_blocked(recipe) -> None:
    """Refuse a scheme this line cannot build, before anything is fabricated or downloaded."""
    if recipe.unit.quantize.scheme == q.INT4:
        raise QuantizationBlocked(q.INT4_BLOCKED.format(torch=torch.__version__.split("+")[0]), q.INT4_WHAT_TO_DO)


@dataclass
class Baselines:
    """The unit before quantization, to measure what quantization costs: its float32 copy and, for a bf16
    unit, an unquantized copy in bf16 too (eager bf16's own distance from float32 puts the cost in scale)."""

    float32: ExportUnit
    low: Optional[ExportUnit] = None


def unquantized_copies(unit: ExportUnit, recipe) -> Baselines:
    """Copies of ``unit`` made before it is quantized (shared submodules stay shared within each copy)."""
    low = _deep_copy(unit) if recipe.unit.dtype != "float32" else None
    return Baselines(float32=float32_copy(unit), low=low)


def _deep_copy(unit: ExportUnit) -> ExportUnit:
    modules = copy.deepcopy({name: m.module for name, m in unit.methods.items()})
    methods = {name: dataclasses.replace(m, module=modules[name]) for name, m in unit.methods.items()}
    return dataclasses.replace(unit, methods=methods, reference=None, policy=None)


def torchao_config(quantize: q.Quantize):
    """torchao's config for the scheme. ``set_inductor_config=False``: torchao would otherwise change Inductor's
    global settings in this process, and the lowering sets its own (zoo.export.lower.compile_settings)."""
    from torchao.quantization import Int8WeightOnlyConfig
    from torchao.quantization.granularity import PerGroup, PerRow

    if quantize.scheme != q.INT8:
        raise ValueError(f"no torchao config is built for {quantize.scheme!r} on this line")
    granularity = PerRow() if quantize.group_size is None else PerGroup(quantize.group_size)
    return Int8WeightOnlyConfig(granularity=granularity, set_inductor_config=False)


def linear_plan(unit: ExportUnit, quantize: q.Quantize) -> Tuple[Dict[int, str], List[Dict[str, str]]]:
    """Which linear layers get quantized: ``{id(module): name}``, and the layers left as they are with why.

    A module shared by several methods is named once, by its first method (``video_step:blocks.0.ffn.0``);
    patterns match the name within the method. A weight also used elsewhere (tied embeddings) is left alone:
    replacing it would untie it and store it twice."""
    owners = _parameter_owners(unit)
    chosen: Dict[int, str] = {}
    kept: List[Dict[str, str]] = []
    seen, used_patterns = set(), set()
    for method, spec in unit.methods.items():
        for name, module in spec.module.named_modules():
            if not isinstance(module, torch.nn.Linear) or id(module) in seen:
                continue
            seen.add(id(module))
            label = f"{method}:{name}"
            pattern = q.matching(quantize.exclude, name)
            why = None
            if pattern is not None:
                used_patterns.add(pattern)
                why = f"excluded by {pattern!r}"
            elif owners.get(id(module.weight), 1) > 1:
                why = "weight shared with another module (tied)"
            elif quantize.group_size and module.in_features % quantize.group_size:
                why = f"in_features {module.in_features} is not a multiple of group_size {quantize.group_size}"
            if why is None:
                chosen[id(module)] = label
            else:
                kept.append({"module": label, "why": why})
    unused = [p for p in quantize.exclude if p not in used_patterns]
    if unused:
        names = sorted({n for s in unit.methods.values() for n, m in s.module.named_modules()
                        if isinstance(m, torch.nn.Linear)})
        raise RecipeError(f"unit.quantize.exclude pattern(s) {unused} match no linear layer of the unit",
                          f"patterns are fnmatch over module names within a method, such as: {', '.join(names[:6])}")
    return chosen, kept


def _parameter_owners(unit: ExportUnit) -> Dict[int, int]:
    """How many distinct modules hold each parameter tensor directly (by identity)."""
    owners: Dict[int, set] = {}
    for spec in unit.methods.values():
        for module in spec.module.modules():
            for p in module.parameters(recurse=False):
                owners.setdefault(id(p), set()).add(id(module))
    return {k: len(v) for k, v in owners.items()}


def quantize_unit(unit: ExportUnit, recipe) -> Dict[str, Any]:
    """Quantize ``unit``'s chosen linear layers in place; return the report's ``quantization`` section."""
    quantize = recipe.unit.quantize
    refuse_blocked(recipe)
    before = weight_bytes(unit)
    chosen, kept = linear_plan(unit, quantize)
    named = policy_layers(unit, chosen)  # before quantizing: the dtype each weight is quantized from
    holder = torch.nn.ModuleDict({f"m_{name}": spec.module for name, spec in unit.methods.items()})
    quantize_modules(holder, set(chosen), quantize)
    record = {"scheme": quantize.scheme, "words": quantize.words(), "group_size": quantize.group_size,
              "torchao": _torchao_version(), "quantized": len(chosen), "kept": kept,
              "weight_bytes": {"before": before, "after": weight_bytes(unit)}}
    return {**record, **named}


def quantize_modules(root: torch.nn.Module, chosen: Set[int], quantize: q.Quantize) -> None:
    """torchao's ``quantize_`` over the modules of ``root`` whose ``id`` is in ``chosen``, then its tensor subclass
    unwrapped into plain parameters. The one place both the unit and LeRobot's policy (the policy check's
    reference) are quantized, so the two cannot be quantized differently."""
    from torchao.quantization import quantize_
    from torchao.utils import unwrap_tensor_subclass

    pending = set(chosen)

    def once(module: torch.nn.Module, fqn: str) -> bool:  # a shared module is reached once per path to it
        if id(module) in pending:
            pending.discard(id(module))
            return True
        return False

    with torch.no_grad():
        quantize_(root, torchao_config(quantize), filter_fn=once)
        unwrap_tensor_subclass(root)


def policy_layers(unit: ExportUnit, chosen: Dict[int, str]) -> Dict[str, Any]:
    """The chosen layers as the LeRobot policy the unit was cut from (``unit.policy``) names them, each with the
    dtype its weight is quantized from: ``{"policy_layers": {name: dtype}}``, what ``quantize_policy`` needs to
    quantize LeRobot's own policy the same way; a chosen layer the policy does not hold is listed under
    ``outside_policy``. Empty for a unit cut from no LeRobot policy (it has no policy check)."""
    if unit.policy is None:
        return {}
    names = {id(module): name for name, module in unit.policy.named_modules()}
    modules = {id(m): m for spec in unit.methods.values() for m in spec.module.modules()}
    layers = {names[i]: str(modules[i].weight.dtype).replace("torch.", "") for i in chosen if i in names}
    outside = sorted(label for i, label in chosen.items() if i not in names)
    return {"policy_layers": dict(sorted(layers.items())), **({"outside_policy": outside} if outside else {})}


def quantize_policy(policy: torch.nn.Module, applied: Mapping[str, Any], quantize: q.Quantize) -> int:
    """LeRobot's ``policy`` quantized in place as the unit was (``applied``: the run report's
    ``quantization.applied``): the layers it names in ``policy_layers``, each weight first cast to the dtype the
    unit quantized it from, so that torchao computes the unit's own int8 values and scales. A float32 policy (the
    bf16 rule's reference) then holds a bf16 unit's int8 weights, dequantized in float32. The cast is exact: the
    policy and the unit hold the same values, rounded through the unit's dtype. A layer cast down from float32
    dequantizes in float32 again, as the unit's float32 copy does. Returns how many layers."""
    outside = applied.get("outside_policy")
    if outside:
        raise ExportError(f"LeRobot's policy cannot be quantized as the unit was: the unit quantized layers it does "
                          f"not hold ({', '.join(outside[:4])})",
                          "leave those layers out of quantization (unit.quantize.exclude) to check the policy")
    layers = applied.get("policy_layers")
    if not layers:
        raise ExportError("LeRobot's policy cannot be quantized as the unit was: the run does not say which of its "
                          "layers the unit quantized", "export the run again (its quantize stage records them)")
    modules = dict(policy.named_modules())
    missing = [name for name in layers if not isinstance(modules.get(name), torch.nn.Linear)]
    if missing:
        raise ExportError(f"LeRobot's policy has no linear layer {', '.join(missing[:4])}, which the unit quantized",
                          "the run was exported from another checkpoint or zoo version: export it again")
    widened = [modules[name] for name, dtype in layers.items() if modules[name].weight.dtype == torch.float32
               and getattr(torch, dtype) != torch.float32]
    with torch.no_grad():
        for name, dtype in layers.items():
            linear = modules[name]
            linear.weight = torch.nn.Parameter(linear.weight.detach().to(getattr(torch, dtype)), requires_grad=False)
    quantize_modules(policy, {id(modules[name]) for name in layers}, quantize)
    for linear in widened:
        dequantize_in_float32(linear)
    return len(layers)


def weight_bytes(unit: ExportUnit) -> int:
    """Bytes of every parameter and buffer of the unit, each tensor once (int8 weights, scales and zero points
    after quantization): what the unit's weights take in memory, and about what the program stores."""
    return held_bytes(spec.module for spec in unit.methods.values())


def _torchao_version() -> str:
    import torchao

    return torchao.__version__
