"""Recipes: one YAML file per published artifact, read with omegaconf into a typed schema.

The schema is a tree of dataclasses. omegaconf's structured mode rejects keys the schema does not have and
values of the wrong type; ``Recipe.validate`` then checks what types cannot (allowed words, ranges).
Overrides use omegaconf dotted keys: ``unit.dtype=bfloat16 verify.seeds=[0,1,2]``.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .errors import RecipeError

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"

DTYPES = ("float32", "bfloat16", "float64")
PAIR_DTYPES = ("float32", "float64")
FAMILIES = ("llama", "lingbot_va", "fast_wam")


@dataclass
class Source:
    repo_id: str = MISSING  # Hugging Face Hub id, e.g. "lerobot/lingbot_va_libero_long"
    revision: str = "main"  # branch, tag or commit; pin a commit for reproducible artifacts
    local_dir: Optional[str] = None  # a local checkpoint folder used instead of the Hub
    # Tiny recipes: zoo fabricates seeded random weights in the checkpoint's real file layout into the
    # local Hub cache, then pulls them through the same code path as a real checkpoint.
    fabricate: bool = False
    seed: int = 0


@dataclass
class Unit:
    methods: List[str] = MISSING  # the export unit's methods, e.g. [video_step, action_step]
    dtype: str = "float32"  # compute dtype of the unit
    # Family-specific knobs (layer count, static grid sizes, KV pool size, ...). Each family validates its own.
    options: Dict[str, Any] = field(default_factory=dict)


@dataclass
class DynamicDim:
    min: int = MISSING
    max: int = MISSING


@dataclass
class Lowering:
    # The default Triton SDPA of executorch 1.2.0 takes only bf16: fp32 units need "OFF".
    triton_kernel_mode: str = "ON"
    # Cap on Triton GEMM configs tried per matmul during max-autotune (None: Inductor's default search).
    max_mm_configs: Optional[int] = None
    # LingBot-VA's KV pool: "buffer" (mutable buffer inside each method's .so) or "io" (passed in and out).
    kv_pool: str = "buffer"
    runtime: str = "1.2"  # the ExecuTorch CUDA runtime release the kernel preflight checks against


@dataclass
class Tolerance:
    float32: float = 1e-5  # relative L2 against eager
    float64: float = 1e-10
    bf16_factor: float = 1.25  # bf16 artifact error vs float32 may be this many times eager bf16's own
    bf16_min_cosine: float = 0.999


@dataclass
class Verify:
    seeds: List[int] = field(default_factory=lambda: [0])
    # dynamic dim name -> sizes to verify at (the bounds are always added)
    sizes: Dict[str, List[int]] = field(default_factory=dict)
    tolerance: Tolerance = field(default_factory=Tolerance)


@dataclass
class Publish:
    repo_id: Optional[str] = None
    private: bool = False
    license: Optional[str] = None  # defaults to the source checkpoint's license


@dataclass
class Recipe:
    name: str = MISSING
    description: str = ""
    family: str = MISSING  # module in zoo/policies/
    source: Source = field(default_factory=Source)
    unit: Unit = field(default_factory=Unit)
    # Example input sizes the family reads (e.g. seq_len, frames, text_len); family-specific.
    inputs: Dict[str, Any] = field(default_factory=dict)
    dynamic: Dict[str, DynamicDim] = field(default_factory=dict)
    rewrites: List[str] = field(default_factory=list)
    # Real dtype that complex128 values become (complex64 always becomes float32). float64 is faithful to
    # complex128 eager but needs a runtime with float64; float32 loads on released ExecuTorch runtimes.
    rotary_pairs: str = "float64"
    lowering: Lowering = field(default_factory=Lowering)
    verify: Verify = field(default_factory=Verify)
    publish: Publish = field(default_factory=Publish)

    def validate(self) -> "Recipe":
        from . import rewrites

        def need(ok: bool, key: str, value: Any, allowed: Sequence[str]) -> None:
            if not ok:
                raise RecipeError(
                    f"recipe {self.name!r}: {key}={value!r} is not allowed",
                    f"use one of: {', '.join(map(str, allowed))}",
                )

        need(self.family in FAMILIES, "family", self.family, FAMILIES)
        need(self.unit.dtype in DTYPES, "unit.dtype", self.unit.dtype, DTYPES)
        need(self.rotary_pairs in PAIR_DTYPES, "rotary_pairs", self.rotary_pairs, PAIR_DTYPES)
        need(self.lowering.triton_kernel_mode in ("ON", "OFF"), "lowering.triton_kernel_mode",
             self.lowering.triton_kernel_mode, ("ON", "OFF"))
        need(self.lowering.kv_pool in ("buffer", "io"), "lowering.kv_pool", self.lowering.kv_pool, ("buffer", "io"))
        for name in self.rewrites:
            need(name in rewrites.names(), "rewrites", name, rewrites.names())
        if not self.unit.methods:
            raise RecipeError(f"recipe {self.name!r}: unit.methods is empty", "name at least one method")
        for dim, rng in self.dynamic.items():
            if not (1 <= rng.min <= rng.max):
                raise RecipeError(f"recipe {self.name!r}: dynamic.{dim} has min={rng.min} max={rng.max}",
                                  "set 1 <= min <= max")
            for size in self.verify.sizes.get(dim, []):
                if not rng.min <= size <= rng.max:
                    raise RecipeError(f"recipe {self.name!r}: verify.sizes.{dim} has {size}, outside "
                                      f"[{rng.min}, {rng.max}]", "verify only at sizes the artifact accepts")
        for dim in self.verify.sizes:
            if dim not in self.dynamic:
                raise RecipeError(f"recipe {self.name!r}: verify.sizes.{dim} names no dynamic dim",
                                  f"dynamic dims: {', '.join(self.dynamic) or 'none'}")
        if not self.verify.seeds:
            raise RecipeError(f"recipe {self.name!r}: verify.seeds is empty", "give at least one seed")
        return self

    def to_dict(self) -> Dict[str, Any]:
        return OmegaConf.to_container(OmegaConf.structured(self), resolve=True)  # type: ignore[return-value]


def recipe_names(recipes_dir: Path = RECIPES_DIR) -> List[str]:
    return sorted(p.stem for p in recipes_dir.glob("*.yaml"))


def load_recipe(name_or_path: str, overrides: Sequence[str] = (), recipes_dir: Path = RECIPES_DIR) -> Recipe:
    """Read a recipe by name (``recipes/<name>.yaml``) or path, apply dotted overrides, validate."""
    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") and path.exists()):
        path = recipes_dir / f"{name_or_path}.yaml"
    if not path.exists():
        known = recipe_names(recipes_dir)
        close = difflib.get_close_matches(name_or_path, known, n=3, cutoff=0.4)
        hint = f"did you mean: {', '.join(close)}?" if close else f"known recipes: {', '.join(known)}"
        raise RecipeError(f"unknown recipe {name_or_path!r}", hint + " (`python -m zoo list` shows them all)")

    schema = OmegaConf.structured(Recipe)
    try:
        merged = OmegaConf.merge(schema, OmegaConf.load(path))
    except OmegaConfBaseException as exc:
        raise RecipeError(f"recipe file {path} does not fit the schema: {_first_line(exc)}",
                          "fix the key or value named above") from None
    for item in overrides:
        merged = _apply_override(merged, item)
    try:
        recipe: Recipe = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        raise RecipeError(f"recipe {path.stem!r} is incomplete: {_first_line(exc)}",
                          "set the missing key in the YAML file or as an override") from None
    return recipe.validate()


def _apply_override(cfg, item: str):
    """Merge one ``dotted.key=value`` into the structured config; the schema rejects unknown keys and types."""
    key, eq, _ = item.partition("=")
    if not eq or not key:
        raise RecipeError(f"bad override {item!r}: expected KEY=VALUE", "for example: unit.dtype=bfloat16")
    try:
        return OmegaConf.merge(cfg, OmegaConf.from_dotlist([item]))
    except OmegaConfBaseException as exc:
        raise RecipeError(f"bad override {item!r}: {_first_line(exc)}",
                          "use a dotted key of the schema with a value of its type, "
                          "e.g. verify.seeds=[0,1] or lowering.max_mm_configs=4") from None


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0]
