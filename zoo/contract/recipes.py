"""Recipes: one YAML file per published artifact, read with omegaconf into a typed schema.

The schema is a tree of dataclasses. omegaconf's structured mode rejects keys the schema does not have and
values of the wrong type; ``Recipe.validate`` then checks what types cannot (allowed words, ranges).
Overrides use omegaconf dotted keys: ``unit.dtype=bfloat16 verify.seeds=[0,1,2]``.

``unit.options`` is typed by the recipe's family: its options dataclass (``zoo/policies/<family>_options.py``,
see ``zoo.policies``) is merged into the schema before the file, so option keys get the same checks, errors
and did-you-mean as every other key.

A recipe's name is its file name without ``.yaml``. Names follow timm's ``arch.tag`` style: ``llama-rope``,
``lingbot-va.libero-long`` (a variant of lingbot-va pinned to another Hub id), ``llama-rope-tiny``.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from zoo import policies
from zoo.core.errors import RecipeError
from zoo.core.progress import warn
from zoo.contract.gpu_targets import GPUS
from zoo.contract.quantization import Quantize, expand_override, expand_shorthand, validate_quantize
from zoo.contract.releases import GEMM_CHOICES

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"

DTYPES = ("float32", "bfloat16", "float64")
PAIR_DTYPES = ("float32", "float64")
# What verification runs the shipped artifact on: torch's AOTI runner over each method's .so, and ExecuTorch's
# own C++ runtime (zoo_runner) over model.pte + aoti_cuda_blob.ptd; "both" names the two.
VERIFY_RUNTIMES = ("aoti", "executorch")
VERIFY_RUNTIME_WORDS = VERIFY_RUNTIMES + ("both",)

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class Source:
    repo_id: str = MISSING  # Hugging Face Hub id, e.g. "lerobot/lingbot_va_libero_long"
    revision: str = "main"  # branch, tag or commit; pin a commit for reproducible artifacts
    local_dir: Optional[str] = None  # a local checkpoint folder used instead of the Hub
    # Files to download (fnmatch patterns, huggingface_hub's allow_patterns); empty: the whole repo.
    allow_patterns: List[str] = field(default_factory=list)
    # Tiny recipes: zoo fabricates seeded random weights in the checkpoint's real file layout into the
    # local Hub cache, then pulls them through the same code path as a real checkpoint.
    fabricate: bool = False
    seed: int = 0
    # The dtype fabricated policy weights are stored in (real checkpoints ship bfloat16); unset keeps the
    # family's own. The unit still computes in unit.dtype: loading casts, as it does for a real checkpoint.
    fabricate_dtype: Optional[str] = None


@dataclass
class Unit:
    methods: List[str] = MISSING  # the export unit's methods, e.g. [video_step, action_step]
    dtype: str = "float32"  # compute dtype of the unit
    # Family-specific knobs (policy config, fabricated sizes, steps, ...). Loading types them with the family's
    # options dataclass (zoo.policies.options_class); a Recipe built in code may hold a plain mapping.
    options: Any = field(default_factory=dict)
    # Weight-only quantization of the unit's linear layers before torch.export (zoo.contract.quantization).
    quantize: Quantize = field(default_factory=Quantize)


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
    # Who computes the GEMMs: "triton" (ExecuTorch's CUDA backend: Triton templates only, as its runtime has no GEMM
    # shim), "cublas" (every GEMM through cuBLAS) or "autotune" (per GEMM, whichever Inductor times faster on the
    # lowering GPU). The last two need zoo's runtime build (runtime.json "features": cublas-gemm; docs/runtime.md).
    gemm: str = "triton"
    # Methods lowered at once, each in its own worker process (None: one per method, as the machine's cores and
    # memory allow; 1: one after another in the zoo process, for debugging). ZOO_LOWERING_WORKERS overrides it.
    workers: Optional[int] = None
    # The GPU the artifact is for, by name (zoo.contract.gpu_targets.GPUS: a100, l4, orin, ...); None: the GPU lowering
    # runs on. `python -m zoo lower RUN_DIR --target NAME` sets it; zoo.export.lower.target says what can work.
    target: Optional[str] = None


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
    # Runtimes to verify on (VERIFY_RUNTIME_WORDS). Unset: both, the ExecuTorch runtime where a zoo_runner is
    # found ($ZOO_ET_RUNNER), else noted as not run. Set (here or with --runtime): each one named must run.
    runtimes: Optional[List[str]] = None


@dataclass
class PolicyCheckTolerance:
    float32: float = 1e-5  # relative L2 per action chunk: float32 runner (CPU, eager) vs LeRobot float32
    gpu_float32: float = 1e-4  # float32 artifact runner on the GPU vs LeRobot float32 eager on the GPU
    # bf16 units (zoo's bf16 rule, per chunk, against LeRobot's float32 episode): the runner may be this many
    # times as far from it as LeRobot's own bf16 episode is, with at least this cosine.
    bf16_factor: float = 1.25
    bf16_min_cosine: float = 0.99


@dataclass
class PolicyCheck:
    """The policy check: the runner (zoo.runner) against LeRobot's own select_action, built from the same
    checkpoint, over a seeded synthetic observation sequence (policy families with an action loop only)."""

    cpu: bool = True  # during export: the eager runner on the CPU (real-size recipes turn it off)
    gpu: bool = True  # after verification on a GPU: the artifact runner, against LeRobot eager on the GPU
    chunks: int = 3  # action chunks the observation sequence covers (one more action starts a fourth)
    seed: int = 0  # torch.manual_seed before each episode, and the seed of the synthetic observations
    # Episodes of seeds seed, seed + 1, ...: the bf16 rule is judged over all their actions at once.
    episodes: int = 1
    task: str = "pick up the bowl and put it on the plate"  # the task text every observation carries
    tolerance: PolicyCheckTolerance = field(default_factory=PolicyCheckTolerance)


@dataclass
class Publish:
    repo_id: Optional[str] = None
    private: bool = False
    license: Optional[str] = None  # defaults to the source checkpoint's license


@dataclass
class Recipe:
    name: str = MISSING  # defaults to the YAML file's name; if given, it must equal it
    description: str = ""
    family: str = MISSING  # a module in zoo/policies/ (zoo.policies.family_names())
    source: Source = field(default_factory=Source)
    unit: Unit = field(default_factory=Unit)
    # Example input sizes the family reads (e.g. seq_len, frames, text_len); family-specific. A size named
    # like a dynamic dim is the size torch.export traces with: it must lie strictly inside that dim's range.
    inputs: Dict[str, Any] = field(default_factory=dict)
    dynamic: Dict[str, DynamicDim] = field(default_factory=dict)
    rewrites: List[str] = field(default_factory=list)
    # Real dtype that complex128 values become (complex64 always becomes float32). float64 is faithful to
    # complex128 eager but needs a runtime with float64; float32 loads on released ExecuTorch runtimes.
    rotary_pairs: str = "float64"
    lowering: Lowering = field(default_factory=Lowering)
    verify: Verify = field(default_factory=Verify)
    policy_check: PolicyCheck = field(default_factory=PolicyCheck)
    publish: Publish = field(default_factory=Publish)

    def validate(self) -> "Recipe":
        from zoo import rewrites

        def need(ok: bool, key: str, value: Any, allowed: Sequence[str]) -> None:
            if not ok:
                raise RecipeError(
                    f"recipe {self.name!r}: {key}={value!r} is not allowed",
                    f"use one of: {', '.join(map(str, allowed))}",
                )

        def fail(what: str, hint: str) -> None:
            raise RecipeError(f"recipe {self.name!r}: {what}", hint)

        self._validate_family(need, fail)
        self._validate_lowering_words(need)
        for name in self.rewrites:
            need(name in rewrites.names(), "rewrites", name, rewrites.names())
        if len(set(self.rewrites)) != len(self.rewrites):
            fail(f"rewrites lists a rewrite twice: {list(self.rewrites)}", "name each rewrite once")
        self._validate_source(fail)
        self._validate_methods(fail)
        self._validate_dynamic(fail)
        self._validate_verify(need, fail)
        self._validate_policy_check(fail)
        need(self.lowering.gemm in GEMM_CHOICES, "lowering.gemm", self.lowering.gemm, GEMM_CHOICES)
        if self.lowering.max_mm_configs is not None and self.lowering.max_mm_configs < 1:
            fail(f"lowering.max_mm_configs={self.lowering.max_mm_configs}", "use null (no cap) or a count >= 1")
        if self.lowering.workers is not None and self.lowering.workers < 1:
            fail(f"lowering.workers={self.lowering.workers}", "use null (as the machine allows) or a count >= 1")
        return self

    def _validate_family(self, need, fail) -> None:
        families = policies.family_names()
        need(self.family in families, "family", self.family, families)
        options = self.unit.options
        if isinstance(options, policies.FamilyOptions):
            if not isinstance(options, policies.options_class(self.family)):
                fail(f"unit.options are {type(options).__name__}, not family {self.family}'s options",
                     f"give unit.options of {policies.options_class_name(self.family)}")
            options.validate(fail)
        need(self.unit.dtype in DTYPES, "unit.dtype", self.unit.dtype, DTYPES)
        need(self.rotary_pairs in PAIR_DTYPES, "rotary_pairs", self.rotary_pairs, PAIR_DTYPES)
        validate_quantize(self.unit.quantize, self.unit.dtype, fail)

    def _validate_lowering_words(self, need) -> None:
        """The lowering's named choices, normalised to the words the code compares against."""
        # YAML 1.1 reads an unquoted ON/OFF (also on the command line: triton_kernel_mode=ON) as a boolean,
        # which omegaconf then stores as "True"/"False": take those to mean what was typed.
        self.lowering.triton_kernel_mode = {"true": "ON", "false": "OFF", "on": "ON", "off": "OFF"}.get(
            str(self.lowering.triton_kernel_mode).lower(), self.lowering.triton_kernel_mode)
        need(self.lowering.triton_kernel_mode in ("ON", "OFF"), "lowering.triton_kernel_mode",
             self.lowering.triton_kernel_mode, ("ON", "OFF"))
        need(self.lowering.kv_pool in ("buffer", "io"), "lowering.kv_pool", self.lowering.kv_pool, ("buffer", "io"))
        if self.lowering.target is not None:
            need(str(self.lowering.target).lower() in GPUS, "lowering.target", self.lowering.target, list(GPUS))
            self.lowering.target = str(self.lowering.target).lower()

    def _validate_methods(self, fail) -> None:
        if not self.unit.methods:
            fail("unit.methods is empty", "name at least one method")
        for method in self.unit.methods:
            if not _IDENTIFIER.match(method):
                fail(f"unit.methods has {method!r}, which is not an identifier",
                     "method names become ExecuTorch method and file names: use letters, digits and _")
        if len(set(self.unit.methods)) != len(self.unit.methods):
            fail(f"unit.methods lists a method twice: {list(self.unit.methods)}", "name each method once")

    def _validate_verify(self, need, fail) -> None:
        if not self.verify.seeds:
            fail("verify.seeds is empty", "give at least one seed")
        tol = self.verify.tolerance
        for key in ("float32", "float64", "bf16_factor"):
            if not getattr(tol, key) > 0:
                fail(f"verify.tolerance.{key}={getattr(tol, key)} is not positive", "tolerances are > 0")
        if self.verify.runtimes is not None:
            if not self.verify.runtimes:
                fail("verify.runtimes is empty", f"name one or more of {', '.join(VERIFY_RUNTIME_WORDS)}, or leave it unset")
            for name in self.verify.runtimes:
                need(name in VERIFY_RUNTIME_WORDS, "verify.runtimes", name, VERIFY_RUNTIME_WORDS)
        if not -1.0 <= tol.bf16_min_cosine <= 1.0:
            fail(f"verify.tolerance.bf16_min_cosine={tol.bf16_min_cosine}", "a cosine lies in [-1, 1]")

    def _validate_policy_check(self, fail) -> None:
        check = self.policy_check
        if check.chunks < 1:
            fail(f"policy_check.chunks={check.chunks}",
                 "give a whole number >= 1 (the default, 3, carries the KV feedback across chunks)")
        for key in ("float32", "gpu_float32", "bf16_factor"):
            if not getattr(check.tolerance, key) > 0:
                fail(f"policy_check.tolerance.{key}={getattr(check.tolerance, key)} is not positive",
                     "tolerances are > 0")
        if not -1.0 <= check.tolerance.bf16_min_cosine <= 1.0:
            fail(f"policy_check.tolerance.bf16_min_cosine={check.tolerance.bf16_min_cosine}", "a cosine lies in [-1, 1]")

    def _validate_source(self, fail) -> None:
        src = self.source
        if src.fabricate_dtype not in (None, "float32", "bfloat16", "float16"):
            fail(f"source.fabricate_dtype={src.fabricate_dtype!r}", "use bfloat16, float16, float32 or null")
        if src.local_dir is not None:
            if not str(src.local_dir).strip():
                fail("source.local_dir is empty", "give a checkpoint folder, or null to pull from the Hub")
            return  # the repo id only labels a local checkpoint
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(src.repo_id)
        except HFValidationError as exc:
            fail(f"source.repo_id={src.repo_id!r} is not a Hub repo id ({_first_line(exc)})",
                 "use 'org/name' as on huggingface.co, or set source.local_dir to a checkpoint folder")
        if not src.revision.strip():
            fail("source.revision is empty", "use a branch, tag or 40-hex commit (default: main)")

    def _validate_dynamic(self, fail) -> None:
        for dim, rng in self.dynamic.items():
            if not _IDENTIFIER.match(dim):
                fail(f"dynamic dim {dim!r} is not an identifier", "torch.export.Dim names are identifiers")
            if not (1 <= rng.min and rng.min + 2 <= rng.max):
                # torch.export needs an example size strictly inside the range; a range without one is a
                # static size and belongs in `inputs`.
                fail(f"dynamic.{dim} has min={rng.min} max={rng.max}",
                     "set 1 <= min and max >= min + 2, or make a fixed size a static input size")
            if dim in self.inputs:
                size = self.inputs[dim]
                if isinstance(size, bool) or not isinstance(size, int) or not rng.min < size < rng.max:
                    fail(f"inputs.{dim}={size!r} is the size torch.export traces dynamic dim {dim!r} with, "
                         f"and must lie strictly inside [{rng.min}, {rng.max}]",
                         "a size on a bound (or outside) makes torch.export specialise or reject it; pick one "
                         "in between, or leave it out and zoo picks one")
            for size in self.verify.sizes.get(dim, []):
                if not rng.min <= size <= rng.max:
                    fail(f"verify.sizes.{dim} has {size}, outside [{rng.min}, {rng.max}]",
                         "verify only at sizes the artifact accepts")
        for dim in self.verify.sizes:
            if dim not in self.dynamic:
                fail(f"verify.sizes.{dim} names no dynamic dim", f"dynamic dims: {', '.join(self.dynamic) or 'none'}")

    def to_dict(self) -> Dict[str, Any]:
        return OmegaConf.to_container(OmegaConf.structured(self), resolve=True)  # type: ignore[return-value]

    def to_yaml(self) -> str:
        return OmegaConf.to_yaml(OmegaConf.structured(self))

    def summary(self) -> Dict[str, str]:
        """One row of `python -m zoo list`: where the weights come from and what gets exported."""
        src = self.source
        hub = src.repo_id if src.revision == "main" else f"{src.repo_id}@{src.revision}"
        notes = []
        if src.fabricate:
            notes.append("fabricated weights, offline")
        if src.local_dir:
            notes.append(f"local checkpoint {src.local_dir}")
        if self.dynamic:
            notes.append("dynamic " + ", ".join(f"{d} {r.min}..{r.max}" for d, r in self.dynamic.items()))
        if self.description:  # its first sentence, whole: `zoo list` wraps it
            notes.append(" ".join(self.description.split()).split(": ")[0].split(". ")[0])
        return {"name": self.name, "family": self.family, "hub": hub, "methods": ", ".join(self.unit.methods),
                "dtype": self.unit.dtype, "notes": "; ".join(notes)}


def recipe_names(recipes_dir: Path = RECIPES_DIR, pattern: Optional[str] = None) -> List[str]:
    """Recipe names (YAML file names), optionally filtered by an fnmatch pattern such as ``lingbot*``."""
    names = sorted(p.stem for p in Path(recipes_dir).glob("*.yaml"))
    return [n for n in names if pattern is None or fnmatch.fnmatch(n, pattern)]


def recipe_path(name_or_path: str, recipes_dir: Path = RECIPES_DIR) -> Path:
    """The YAML file of a recipe name, or the path itself; an unknown name raises, listing close names."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    path = Path(recipes_dir) / f"{name_or_path}.yaml"
    if path.is_file():
        return path
    known = recipe_names(recipes_dir)
    close = difflib.get_close_matches(name_or_path, known, n=3, cutoff=0.4)
    close += [n for n in known if name_or_path and name_or_path in n and n not in close][:3]
    hint = f"did you mean: {', '.join(close)}?" if close else f"known recipes: {', '.join(known) or 'none'}"
    raise RecipeError(f"unknown recipe {name_or_path!r}", hint + " (`python -m zoo list` shows them all)")


def load_recipe(name_or_path: str, overrides: Sequence[str] = (), recipes_dir: Path = RECIPES_DIR,
                check_name: bool = True) -> Recipe:
    """Read a recipe by name (``recipes/<name>.yaml``) or path, apply dotted overrides, validate.

    ``check_name=False`` reads a resolved recipe saved under another file name (a run folder's recipe.yaml)."""
    path = recipe_path(name_or_path, recipes_dir)
    try:
        loaded = OmegaConf.load(path)
    except OmegaConfBaseException as exc:
        raise _misfit(path, exc, None) from None
    except Exception as exc:  # a YAML syntax error: the parser's message names line and column
        raise RecipeError(f"recipe file {path} is not valid YAML: {_first_line(exc)}",
                          "fix the file's syntax") from None
    loaded = expand_shorthand(loaded)
    overrides = [expand_override(item) for item in overrides]
    options = _options_of(_family_named(loaded, overrides))
    try:
        merged = OmegaConf.merge(recipe_schema(options), loaded)
    except OmegaConfBaseException as exc:
        raise _misfit(path, exc, options) from None
    if OmegaConf.is_missing(merged, "name"):
        merged.name = path.stem
    elif check_name and merged.name != path.stem:
        # A recipe copied under a new file name keeps working: its name is the file name.
        warn(f"recipe file {path} says name: {merged.name}; its name is its file name, {path.stem} "
             f"(remove the name: key or set it to {path.stem})")
        merged.name = path.stem
    for item in overrides:
        merged = _apply_override(merged, item, options)
    try:
        recipe: Recipe = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        raise RecipeError(f"recipe {path.stem!r} is incomplete: {_describe(exc)}",
                          "set the missing key in the YAML file or as an override (KEY=VALUE)") from None
    if recipe.source.local_dir:
        recipe.source.local_dir = str(Path(recipe.source.local_dir).expanduser())
    return recipe.validate()


def _misfit(path: Path, exc: OmegaConfBaseException, options: Optional[type]) -> RecipeError:
    """A recipe file whose keys or values the schema refuses; an unknown key gets the close key names."""
    hint = (_keys_hint(getattr(exc, "full_key", None) or "", options) if isinstance(exc, ConfigKeyError)
            else "fix the key or value named above")
    return RecipeError(f"recipe file {path} does not fit the schema: {_describe(exc)}", hint)


def recipe_schema(options: Optional[type] = None) -> DictConfig:
    """The structured config a recipe file is merged into; ``unit.options`` typed by ``options`` if given."""
    schema = OmegaConf.structured(Recipe)
    if options is not None:
        schema.unit.options = OmegaConf.structured(options)
    return schema


def _family_named(loaded: Any, overrides: Sequence[str]) -> Optional[str]:
    """The family a recipe will have once its overrides are applied: the last ``family=`` override, else the
    file's ``family``. None if neither names one (the schema then reports what is missing or wrong)."""
    try:
        family = loaded.get("family") if isinstance(loaded, DictConfig) else None
    except OmegaConfBaseException:
        family = None  # e.g. family: ??? (missing): to_object reports it
    for item in overrides:
        if item.partition("=")[0].strip() == "family":
            try:
                family = OmegaConf.from_dotlist([item]).get("family")
            except OmegaConfBaseException:
                pass  # a malformed override: _apply_override reports it
    return family if isinstance(family, str) else None


def _options_of(family: Optional[str]) -> Optional[type]:
    """A known family's options dataclass; None for no or an unknown family (``validate`` names the error)."""
    return policies.options_class(family) if family in policies.family_names() else None


def _apply_override(cfg, item: str, options: Optional[type] = None):
    """Merge one ``dotted.key=value`` into the structured config; the schema rejects unknown keys and types."""
    key, eq, value = item.partition("=")
    if not eq or not key.strip():
        raise RecipeError(f"bad override {item!r}: expected KEY=VALUE", "for example: unit.dtype=bfloat16")
    try:
        return OmegaConf.merge(cfg, OmegaConf.from_dotlist([item]))
    except ConfigKeyError as exc:
        # full_key is the first key the schema lacks (verfy in verfy.seeds=...): the one to suggest for.
        unknown = getattr(exc, "full_key", None) or key
        raise RecipeError(f"bad override {item!r}: {_describe(exc)}", _keys_hint(unknown, options)) from None
    except OmegaConfBaseException as exc:
        expected = _expected_type(key, options)
        what = f"{key} takes {expected}, not {value!r}" if expected else _describe(exc)
        raise RecipeError(f"bad override {item!r}: {what}",
                          "use a value of the key's type, e.g. verify.seeds=[0,1], lowering.max_mm_configs=4, "
                          "source.fabricate=true") from None


def expected_type(dotted: str, family: Optional[str] = None) -> Optional[str]:
    """The schema's type of a dotted key, in words ('a list of int'), or None if the key is not in the schema.
    ``unit.options.*`` keys are the family's options (any value if no family is given)."""
    return _expected_type(dotted, _options_of(family))


def _expected_type(dotted: str, options: Optional[type]) -> Optional[str]:
    tp = _schema_type(dotted, options)
    return None if tp is _NOT_IN_SCHEMA else _type_words(tp)


_NOT_IN_SCHEMA = object()


def _schema_type(dotted: str, options: Optional[type]) -> Any:
    """The type the schema gives a dotted key ('' is the recipe), ``unit.options`` being ``options``."""
    tp: Any = Recipe
    for part in [p for p in dotted.split(".") if p]:
        args = typing.get_args(tp)
        if typing.get_origin(tp) is typing.Union and type(None) in args:  # Optional[X]: the keys of X
            tp = next(a for a in args if a is not type(None))
        if dataclasses.is_dataclass(tp):
            hints = typing.get_type_hints(tp)
            if part not in hints:
                return _NOT_IN_SCHEMA
            tp = options if tp is Unit and part == "options" and options is not None else hints[part]
        elif typing.get_origin(tp) in (dict, Dict):
            tp = typing.get_args(tp)[1]
        elif tp is not Any:  # under an untyped value (unit.options of no family) every key is any value
            return _NOT_IN_SCHEMA
    return tp


def _type_words(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return f"{_type_words(inner[0])} or null"
    if origin in (list, List):
        return f"a list of {_type_words(args[0])}"
    if origin in (dict, Dict):
        return f"a mapping to {_type_words(args[1])}"
    if dataclasses.is_dataclass(tp):
        return f"a mapping with keys {', '.join(f.name for f in dataclasses.fields(tp))}"
    return {int: "int", float: "float", str: "str", bool: "bool (true/false)"}.get(tp, "any value")


def _keys_hint(dotted: str, options: Optional[type] = None) -> str:
    """Name the keys that exist where an unknown one was given, with the closest first."""
    parent, _, leaf = dotted.rpartition(".")
    tp = _schema_type(parent, options)
    if not dataclasses.is_dataclass(tp):
        return "use a key of the recipe schema (see zoo/recipes.py)"
    keys = [f.name for f in dataclasses.fields(tp)]
    close = difflib.get_close_matches(leaf, keys, n=1)
    prefix = f"{parent}." if parent else ""
    guess = f"did you mean {prefix}{close[0]}? " if close else ""
    return f"{guess}keys of {parent or 'a recipe'}: {', '.join(keys)}"


def _describe(exc: BaseException) -> str:
    """omegaconf's message without its 'full_key/object_type' trailer, with the full key named."""
    msg = _first_line(exc)
    full_key = getattr(exc, "full_key", None)
    if full_key and full_key not in msg:
        msg = f"{full_key}: {msg}"
    return msg


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
