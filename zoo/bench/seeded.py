"""Export units at the recipes' real size with seeded random weights, built offline (no checkpoint download).

Speed and the lowering's cost do not depend on the weights' values, so the benchmarks build the families' units
with parameters on meta, filled with seeded values in the unit's dtype (``fast_init.seeded_weights``). The units
``parse_unit`` takes (``NAME[:ARG]``): benchmarks/README.md, "bench_real_size.py".
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import torch

from zoo import policies
from zoo.bench.candidates import Candidate, RunFn, artifact_candidate, module_runner
from zoo.contract.recipes import load_recipe
from zoo.core.errors import ZooError
from zoo.export import pull as hub
from zoo.export import tiny_hub
from zoo.export.hub_cache import hub_environment, put_in_cache
from zoo.policies import fast_init
from zoo.policies.base import ExportUnit


@dataclass(frozen=True)
class UnitKind:
    recipe: str
    tiny_recipe: str
    arg: str  # what NAME:ARG lists: "sizes" (sequence lengths) or "methods"
    default: Optional[List]  # default ARG values (None: every method of the recipe)


UNITS: Dict[str, UnitKind] = {
    "llama": UnitKind("llama-rope", "llama-rope-tiny", "sizes", [128, 512, 2048]),
    "lingbot_va": UnitKind("lingbot-va", "lingbot-va-tiny", "methods", None),
    "fast_wam": UnitKind("fast-wam", "fast-wam-tiny", "methods", ["action_step"]),
}


@dataclass
class UnitSpec:
    name: str
    kind: UnitKind
    sizes: List[int]
    methods: Optional[List[str]]


def parse_unit(text: str) -> UnitSpec:
    name, _, arg = text.partition(":")
    if name not in UNITS:
        raise ZooError(f"unknown unit {name!r}", f"units: {', '.join(UNITS)} (e.g. llama:128,512 fast_wam)")
    kind = UNITS[name]
    values = [v.strip() for v in arg.split(",") if v.strip()]
    if kind.arg == "sizes":
        try:
            sizes = [int(v) for v in values] or list(kind.default or [])
        except ValueError:
            raise ZooError(f"unit {text!r}: {name} takes sequence lengths", f"e.g. {name}:128,512,2048") from None
        return UnitSpec(name, kind, sizes, None)
    return UnitSpec(name, kind, [], values or (list(kind.default) if kind.default else None))


def spec_for_recipe(recipe) -> UnitSpec:
    """The unit kind whose seeded builder builds this recipe's family, with the recipe's methods."""
    for name, kind in UNITS.items():
        if recipe.name in (kind.recipe, kind.tiny_recipe) or recipe.family == name:
            return UnitSpec(name, kind, [], list(recipe.unit.methods))
    raise ZooError(f"no seeded builder for family {recipe.family!r}", f"families with one: {', '.join(UNITS)}")


# ------------------------------------------------------------------------------------------------------
# Building units with random weights


def placeholder_checkpoint(config, folder: Path) -> Path:
    """config.json as LeRobot writes it, and an empty (valid) model.safetensors: the family checks the file is
    there; ``fast_init.seeded_weights`` makes sure nothing reads it."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    save_file({}, str(folder / "model.safetensors"))
    return folder


def build_llama(recipe, work: Path) -> ExportUnit:
    with tiny_hub.fabricated_hub(recipe, cache_dir=work / "hub"):
        checkpoint = hub.pull(recipe)
        return policies.load_family("llama").build_unit(checkpoint.path, recipe)


def build_lingbot_va(recipe, work: Path) -> ExportUnit:
    lingbot_va = policies.load_family("lingbot_va")
    # The configuration a fabricated checkpoint of this recipe would carry (recipe policy_config, cameras).
    config = lingbot_va._fabricated_config(recipe, lingbot_va._validate_recipe(recipe))
    folder = placeholder_checkpoint(config, work / "checkpoint")
    with torch.random.fork_rng(devices=[]), fast_init.seeded_weights(recipe.source.seed):
        torch.manual_seed(recipe.source.seed)
        return lingbot_va.build_unit(folder, recipe)


def fast_wam_config(recipe):
    """The FastWAMConfig of the recipe's fabricate_config (empty: FastWAMConfig's real defaults), on the CPU in
    the unit's dtype, with no base model to download."""
    from lerobot.policies.fastwam.configuration_fastwam import FastWAMConfig

    fields = dict(recipe.unit.options.fabricate_config)
    for key in ("video_dit_config", "action_dit_config"):
        if key in fields:
            fields[key] = dict(fields[key])
    # base_model_id=None: otherwise default-sized dims point pretrained_path at lerobot/fastwam_base (12 GB).
    fields.update(base_model_id=None, torch_dtype=recipe.unit.dtype, device="cpu")
    return FastWAMConfig(**fields)


def depth_overrides(family: str, recipe, layers: int) -> List[str]:
    """Recipe overrides that keep a policy's real width at ``layers`` blocks per transformer. Several lowerings of
    one policy then take less time than one at full depth (a lever's before and after, side by side); what a block costs is the
    same, so per-block savings carry over, while the floor and every fixed per-call cost do not scale."""
    if layers < 1:
        raise ValueError(f"layers must be >= 1, not {layers}")
    if family == "lingbot_va":
        return [f"unit.options.policy_config.num_layers={layers}"]
    # Fast-WAM's two DiT configs are whole dicts: an override replaces one, so each is given in full.
    config = fast_wam_config(recipe)
    return [f"unit.options.fabricate_config.{key}={json.dumps({**dict(getattr(config, key)), 'num_layers': layers})}"
            for key in ("video_dit_config", "action_dit_config")]


def write_seeded_processors(family: str, config, folder: Path, seed: int) -> None:
    """The policy's processor files with seeded statistics, as a checkpoint carries them."""
    g = torch.Generator().manual_seed(seed)
    if family == "lingbot_va":
        from lerobot.policies.lingbot_va import make_lingbot_va_pre_post_processors as make

        n = len(config.used_action_channel_ids)
        q01 = -1.0 - torch.rand(n, generator=g)
        stats = {"action": {"q01": q01, "q99": q01 + 0.5 + 2.0 * torch.rand(n, generator=g)}}
    else:
        from lerobot.policies.fastwam.processor_fastwam import make_fastwam_pre_post_processors as make

        stats = {"action": {"mean": 0.1 * torch.randn(config.action_dim, generator=g),
                            "std": 0.5 + torch.rand(config.action_dim, generator=g)},
                 "observation.state": {"mean": 0.1 * torch.randn(config.proprio_dim, generator=g),
                                       "std": 0.5 + torch.rand(config.proprio_dim, generator=g)}}
    pre, post = make(config, dataset_stats=stats)
    pre.save_pretrained(folder)
    post.save_pretrained(folder)


def build_fast_wam(recipe, work: Path) -> ExportUnit:
    fast_wam = policies.load_family("fast_wam")
    config = fast_wam_config(recipe)
    folder = placeholder_checkpoint(config, work / "checkpoint")
    write_seeded_processors("fast_wam", config, folder, recipe.source.seed)
    # The policy constructor loads the Wan2.2 VAE and the UMT5 tokenizer by Hub id (the unit uses neither):
    # the family's tiny fabrication writes stand-ins under those ids, served here from a private cache.
    tiny_recipe = load_recipe(UNITS["fast_wam"].tiny_recipe)
    repos = fast_wam.fabricate_checkpoint(tiny_recipe, work / "standins")
    cache = work / "hub"
    for repo_id, repo_dir in repos.items():
        if repo_id != tiny_recipe.source.repo_id:
            put_in_cache(repo_id, repo_dir, cache)
    with hub_environment(cache, offline=True), torch.random.fork_rng(devices=[]), \
            fast_init.seeded_weights(recipe.source.seed):
        torch.manual_seed(recipe.source.seed)
        return fast_wam.build_unit(folder, recipe)


def unit_recipe(spec: UnitSpec, tiny: bool):
    name = spec.kind.tiny_recipe if tiny else spec.kind.recipe
    recipe = load_recipe(name)
    if spec.name == "llama":
        recipe.source.fabricate = True
    if spec.name == "fast_wam":
        # The split layout (the tiny recipe unrolls the whole chunk instead): action_step is the action unit.
        recipe.unit.methods = ["prefill", "action_step"]
    if spec.name == "lingbot_va":
        # The DiT steps: the recipe's streaming VAE methods would load the real VAE by Hub id, which a random-
        # weight benchmark box does not have.
        recipe.unit.methods = ["video_step", "action_step"]
    return recipe.validate()


def build_unit(spec: UnitSpec, recipe, work: Path) -> ExportUnit:
    if spec.name == "llama":
        return build_llama(recipe, work)
    if spec.name == "lingbot_va":
        return build_lingbot_va(recipe, work)
    return build_fast_wam(recipe, work)


def selected_methods(unit: ExportUnit, methods: List[str]) -> ExportUnit:
    """The unit with only ``methods``, in that order."""
    unknown = [m for m in methods if m not in unit.methods]
    if unknown:
        raise ZooError(f"unit of {unit.family}: no method(s) {unknown}", f"methods: {', '.join(unit.methods)}")
    return dataclasses.replace(unit, methods={m: unit.methods[m] for m in methods})


# ------------------------------------------------------------------------------------------------------
# What is timed on a unit still in memory


def unit_candidates(unit: ExportUnit, method: str, unit_dir: Path, device: str, with_compile: bool,
                    dynamic: Optional[bool]) -> List[Candidate]:
    """Eager (the unit's own module), the artifact in ``unit_dir`` and torch.compile of the module."""
    module = unit.methods[method].module

    def eager() -> RunFn:
        module.to(device)
        return module_runner(module)

    def compiled() -> RunFn:
        module.to(device)
        torch._dynamo.reset()
        return module_runner(torch.compile(module, dynamic=dynamic))

    def back_to_cpu() -> None:
        torch._dynamo.reset()  # compiled graphs hold the device weights until dynamo forgets them
        module.to("cpu")

    cands = [Candidate("eager", eager, back_to_cpu, what=f"the unit's own modules ({unit.family}), eager"),
             artifact_candidate(unit_dir, method, device)]
    if with_compile:
        cands.append(Candidate("compile", compiled, back_to_cpu,
                               what=f"torch.compile(unit module, mode=default, dynamic={dynamic})"))
    else:
        cands.append(Candidate("compile", lambda: None, skipped="--no-compile"))
    return cands
