"""Build a policy's large modules without random initialisation, then give them their weights.

Why and how: docs/ARCHITECTURE.md, "Building large policies fast".
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from zoo.core.errors import ExportError

META = torch.device("meta")
# Seeded fill: each tensor is cut into chunks of this many elements, each drawn from its own generator, so
# the values do not depend on how many threads fill them.
FILL_CHUNK = 1 << 22

_building = threading.local()  # .depth: how many module_classes constructors are running on this thread
# (seed, draw dtype or None) while seeded_weights is active
_seed: contextvars.ContextVar[Optional[Tuple[int, Optional[torch.dtype]]]] = contextvars.ContextVar(
    "zoo_fast_init_seed", default=None)
_MISSING = object()
_MARK = "_zoo_built_on_meta"  # set on the parameters made here (and on the _apply functions already wrapped)


# ----------------------------------------------------------------------------------------------------------
# construction


def _meta_parameter(param: nn.Parameter) -> nn.Parameter:
    """The same parameter on the meta device: class, requires_grad and instance attributes kept, marked."""
    meta = type(param)(param.data.to(META), requires_grad=param.requires_grad)
    meta.__dict__.update(param.__dict__)
    setattr(meta, _MARK, True)
    return meta


def _dtype_only(fn):
    """``Module._apply``'s per-tensor function, made to leave the parameters built on meta on meta.

    Constructors move what they build (Fast-WAM: ``WanVideoDiT(...).to(device=cpu, dtype=bf16)``); a meta
    tensor cannot be copied to a device, and need not be: the file's tensors are put in place later. Such
    a parameter takes only the dtype that ``fn`` gives (read off an empty tensor); every other tensor goes
    through ``fn`` unchanged.
    """
    if getattr(fn, _MARK, False):
        return fn

    def apply(t):
        if t.device.type == "meta" and getattr(t, _MARK, False):
            return t.to(dtype=fn(torch.empty(0, dtype=t.dtype)).dtype)
        return fn(t)

    setattr(apply, _MARK, True)
    return apply


@contextlib.contextmanager
def parameters_on_meta(module_classes: Sequence[type]) -> Iterator[None]:
    """While active, parameters registered during the construction of ``module_classes`` go to meta."""
    classes = list(dict.fromkeys(module_classes))
    bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
    if bad or not classes:
        raise TypeError(f"parameters_on_meta takes nn.Module classes, got {bad or classes!r}")
    register, module_apply = nn.Module.register_parameter, nn.Module._apply
    saved_inits = {cls: cls.__dict__.get("__init__", _MISSING) for cls in classes}

    def register_parameter(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        if param is not None and getattr(_building, "depth", 0) > 0 and param.device.type != "meta":
            param = _meta_parameter(param)
        register(module, name, param)

    def _apply(module: nn.Module, fn, *args, **kwargs):
        return module_apply(module, _dtype_only(fn), *args, **kwargs)

    def counted(init):
        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            _building.depth = getattr(_building, "depth", 0) + 1
            try:
                init(self, *args, **kwargs)
            finally:
                _building.depth -= 1

        return __init__

    try:
        for cls in classes:
            cls.__init__ = counted(cls.__init__)
        nn.Module.register_parameter = register_parameter
        nn.Module._apply = _apply
        yield
    finally:
        nn.Module.register_parameter, nn.Module._apply = register, module_apply
        for cls, init in saved_inits.items():
            if init is _MISSING:
                del cls.__init__
            else:
                cls.__init__ = init


@contextlib.contextmanager
def built_on_meta(policy_cls: type, module_classes: Sequence[type]) -> Iterator[None]:
    """``policy_cls.from_pretrained`` inside this block: ``module_classes``' parameters built on meta, then
    loaded by ``load_weights`` (or filled by ``fill_seeded`` inside ``seeded_weights``).

    Inside ``seeded_weights(seed)`` the policy's constructor also runs from ``torch.manual_seed(seed)`` in a
    forked RNG: the parameters outside ``module_classes`` (Fast-WAM's proprio encoder, ...), which no file
    overwrites then, are the same in every policy built in the block, whatever ran between the builds, and
    the caller's RNG is left as it was."""
    saved = policy_cls.__dict__.get("_load_as_safetensor", _MISSING)
    saved_init = policy_cls.__dict__.get("__init__", _MISSING)
    constructor = policy_cls.__init__

    @functools.wraps(constructor)
    def __init__(self, *args, **kwargs):
        seeded = _seed.get()
        if seeded is None:
            return constructor(self, *args, **kwargs)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seeded[0])
            return constructor(self, *args, **kwargs)

    def load(cls, model: nn.Module, model_file: str, map_location: str, strict: bool) -> nn.Module:
        seeded = _seed.get()
        if seeded is not None:
            seed, draw_dtype = seeded
            fill_seeded(model, seed, draw_dtype=draw_dtype)
        else:
            load_weights(model, model_file, strict=strict)
        return model

    policy_cls._load_as_safetensor = classmethod(load)
    policy_cls.__init__ = __init__
    try:
        with parameters_on_meta(module_classes):
            yield
    finally:
        if saved is _MISSING:
            del policy_cls._load_as_safetensor
        else:
            policy_cls._load_as_safetensor = saved
        if saved_init is _MISSING:
            del policy_cls.__init__
        else:
            policy_cls.__init__ = saved_init


@contextlib.contextmanager
def seeded_weights(seed: int, draw_dtype: Optional[torch.dtype] = None) -> Iterator[None]:
    """Inside ``built_on_meta``, fill the weights with seeded values instead of reading the checkpoint
    (``fill_seeded``; ``draw_dtype``: the dtype the values are drawn in, None: each tensor's own)."""
    if draw_dtype is not None and not (isinstance(draw_dtype, torch.dtype) and draw_dtype.is_floating_point):
        raise TypeError(f"seeded_weights draws in a floating torch.dtype, got {draw_dtype!r}")
    token = _seed.set((int(seed), draw_dtype))
    try:
        yield
    finally:
        _seed.reset(token)


# ----------------------------------------------------------------------------------------------------------
# weights


def meta_tensors(module: nn.Module) -> List[str]:
    """Names of the parameters and buffers of ``module`` still on the meta device."""
    named = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))
    return [name for name, t in named if t.device.type == "meta"]


def _check_materialised(module: nn.Module) -> None:
    left = meta_tensors(module)
    if left:
        shown = ", ".join(left[:8]) + (f" and {len(left) - 8} more" if len(left) > 8 else "")
        raise ExportError(f"{type(module).__name__} has {len(left)} tensor(s) with no values after loading: {shown}",
                          "a module built on meta gets every value from its checkpoint; these names are not "
                          "in it (load with strict=True to see why)")


def _tied_groups(targets: Dict[str, torch.Tensor]) -> List[List[str]]:
    """state_dict names that share one tensor object (tied weights), in state_dict order."""
    groups: Dict[int, List[str]] = {}
    for name, t in targets.items():
        groups.setdefault(id(t), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def load_weights(module: nn.Module, path: Union[str, Path], *, strict: bool = True) -> None:
    """Put the tensors of the safetensors file ``path`` into ``module`` by assignment.

    Each tensor is cast to the dtype its parameter or buffer has in ``module`` (a tensor already in that
    dtype is used as read, no copy) and keeps its ``requires_grad``; tied names get one shared parameter.
    Missing or unexpected names and mis-shaped tensors raise ``RuntimeError`` (``strict``), in
    ``load_state_dict``'s wording; a meta tensor left afterwards raises ``ExportError``.
    """
    from safetensors.torch import load_file

    state = load_file(str(path), device="cpu")
    targets = module.state_dict(keep_vars=True)
    for names in _tied_groups(targets):  # safetensors stores one name of each tied group
        present = [n for n in names if n in state]
        for n in names:
            if present and n not in state:
                state[n] = state[present[0]]
    missing = [n for n in targets if n not in state]
    unexpected = [n for n in state if n not in targets]
    mismatched = [f"{n}: checkpoint {tuple(state[n].shape)}, module {tuple(targets[n].shape)}"
                  for n in state if n in targets and tuple(state[n].shape) != tuple(targets[n].shape)]
    if mismatched or (strict and (missing or unexpected)):
        parts = [f"Error(s) in loading state_dict for {type(module).__name__}:"]
        if missing:
            parts.append("Missing key(s) in state_dict: " + ", ".join(f'"{n}"' for n in missing))
        if unexpected:
            parts.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{n}"' for n in unexpected))
        if mismatched:
            parts.append("shape mismatch for " + "; ".join(mismatched))
        raise RuntimeError("\n\t".join(parts))
    made: Dict[int, torch.Tensor] = {}  # one new tensor per target object: keeps ties tied
    assigned: Dict[str, torch.Tensor] = {}
    for name, target in targets.items():
        if name not in state:
            continue
        if id(target) not in made:
            value = state[name].to(target.dtype)
            if isinstance(target, nn.Parameter):
                value = nn.Parameter(value, requires_grad=target.requires_grad)
            made[id(target)] = value
        assigned[name] = made[id(target)]
    module.load_state_dict(assigned, strict=False, assign=True)
    _check_materialised(module)


def _fill_range(name: str, shape: Sequence[int]) -> Tuple[float, float]:
    """Uniform bounds of a tensor's seeded values: variance 1/fan_in for matrices (so activations keep their
    scale through a random stack), 1 +- 0.17 for norm scales, +- 0.17 for other vectors; none all 0 or 1."""
    if len(shape) >= 2:
        bound = math.sqrt(3.0 / max(1, math.prod(shape[1:])))
        return -bound, bound
    spread = 0.1 * math.sqrt(3.0)
    if "norm" in name or name.endswith(("gamma", "scale")):
        return 1.0 - spread, 1.0 + spread
    return -spread, spread


def fill_seeded(module: nn.Module, seed: int, *, threads: Optional[int] = None,
                draw_dtype: Optional[torch.dtype] = None) -> None:
    """Give every meta parameter and buffer of ``module`` storage on the CPU, in its own dtype, filled with
    seeded uniform values (``_fill_range``), drawn in that dtype (no float32 draft).

    With ``draw_dtype`` the values are drawn in ``draw_dtype`` instead, from the same generators, and cast to
    the tensor's dtype (exact when the tensor's dtype is wider): a module built in float32 and filled with
    ``draw_dtype=torch.bfloat16`` holds the bf16 build's values exactly, and a tensor already in
    ``draw_dtype`` is drawn as without it. The module's other floating parameters (built by their
    constructors) are rounded through ``draw_dtype`` in place, as a checkpoint saved in ``draw_dtype`` would
    give them: then every parameter of a float32 build is its bf16 build's value upcast.

    The values depend only on ``seed``, the tensor's position among the meta tensors (state_dict order) and
    its shape: each chunk of ``FILL_CHUNK`` elements has its own generator, seeded from (seed, tensor,
    chunk), and the chunks are drawn on ``threads`` threads (default: torch's intra-op thread count), which
    changes the time, not the values. Tied names get one tensor. A non-floating meta tensor raises.
    """
    targets = module.state_dict(keep_vars=True)
    made: Dict[int, torch.Tensor] = {}
    jobs = []
    assigned: Dict[str, torch.Tensor] = {}
    for name, target in targets.items():
        if target.device.type != "meta":
            if (draw_dtype is not None and isinstance(target, nn.Parameter) and target.dtype.is_floating_point
                    and target.dtype != draw_dtype):
                with torch.no_grad():
                    target.copy_(target.to(draw_dtype))
            continue
        if id(target) not in made:
            if not target.dtype.is_floating_point:
                raise ExportError(f"{name} is a {target.dtype} tensor with no values",
                                  "seeded weights are for floating parameters; build this module normally")
            value = torch.empty(target.shape, dtype=target.dtype)
            index = len(made)
            low, high = _fill_range(name, tuple(target.shape))
            flat = value.view(-1)
            for j, start in enumerate(range(0, flat.numel(), FILL_CHUNK)):
                jobs.append((flat[start:start + FILL_CHUNK], low, high, (seed, index, j), draw_dtype))
            if isinstance(target, nn.Parameter):
                value = nn.Parameter(value, requires_grad=target.requires_grad)
            made[id(target)] = value
        assigned[name] = made[id(target)]
    workers = max(1, threads or torch.get_num_threads())
    with ThreadPoolExecutor(workers) as pool:  # uniform_ releases the GIL: the chunks fill in parallel
        list(pool.map(lambda job: _fill_chunk(*job), jobs))
    module.load_state_dict(assigned, strict=False, assign=True)
    _check_materialised(module)


def _fill_chunk(chunk: torch.Tensor, low: float, high: float, key: Tuple[int, int, int],
                draw_dtype: Optional[torch.dtype] = None) -> None:
    seed, index, j = key
    # One 63-bit seed per (seed, tensor, chunk); distinct keys give distinct generator streams.
    mixed = (seed * 1_000_003 + index) * 1_000_033 + j
    generator = torch.Generator().manual_seed(mixed % (1 << 63))
    if draw_dtype is None or draw_dtype == chunk.dtype:
        chunk.uniform_(low, high, generator=generator)
    else:  # the same stream drawn in draw_dtype (one chunk-sized scratch tensor), then cast into place
        chunk.copy_(torch.empty(chunk.shape, dtype=draw_dtype).uniform_(low, high, generator=generator))


def same_structure(a: nn.Module, b: nn.Module) -> List[str]:
    """What differs between two modules' state_dicts in names, shapes, dtypes and requires_grad (empty: none)."""
    sa, sb = a.state_dict(keep_vars=True), b.state_dict(keep_vars=True)
    out = [f"only in first: {n}" for n in sa if n not in sb] + [f"only in second: {n}" for n in sb if n not in sa]
    for n in sa:
        if n in sb:
            x, y = sa[n], sb[n]
            if (tuple(x.shape), x.dtype, x.requires_grad) != (tuple(y.shape), y.dtype, y.requires_grad):
                out.append(f"{n}: {tuple(x.shape)} {x.dtype} rg={x.requires_grad} vs "
                           f"{tuple(y.shape)} {y.dtype} rg={y.requires_grad}")
    return out


def plain_tensor_attributes(module: nn.Module) -> Dict[str, torch.Tensor]:
    """Tensors held as plain attributes of ``module``'s submodules (not parameters or buffers): rope and
    frequency tables that constructors compute and no checkpoint stores. ``name.attr`` -> tensor."""
    out: Dict[str, torch.Tensor] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for attr, value in vars(sub).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                out[f"{prefix}.{attr}" if prefix else attr] = value
    return out
