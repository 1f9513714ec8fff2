"""What ``benchmarks/bench_chunk.py`` puts together: observation -> actions for one whole action chunk.

Real-size policies with seeded random weights and Hub stand-ins, the candidates' timing (the runner candidates of
``zoo.bench.chunk_runners``, LeRobot eager, LeRobot torch.compile), their ratios, zoo's policy check of the run and
what is recorded for model cards; the tables and files are ``zoo.bench.chunk_tables``. What is measured and why:
benchmarks/README.md and docs/benchmarks.md, "Chunk latency".
"""

from __future__ import annotations

import contextlib
import gc
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import torch

from zoo import policies
from zoo.bench.candidates import error_line
from zoo.bench.chunk_runners import RUNNER_LABELS, chunk_floor_of, make_runner, sync, time_runner
from zoo.bench.measuring import Stats
from zoo.bench.roofline import ProgramCosts, Rates
from zoo.bench.seeded import fast_wam_config, placeholder_checkpoint, write_seeded_processors
from zoo.contract import chunk_latency
from zoo.contract.run_folder import RunFolder
from zoo.export.hub_cache import hub_environment, put_in_cache
from zoo.export.policy_check import check_run, checkpoint_in_reach
from zoo.policies import fast_init
from zoo.policies.tiny_wan import real_size_wan22_vae
from zoo.runner.backends import ARTIFACT_BACKENDS
from zoo.runner.check import ProcessedPolicy
from zoo.runner.loading import RUNNERS
from zoo.runner.observations import synthetic_observations

POLICIES = {"lingbot_va": ("lingbot-va", "lingbot-va-tiny"), "fast_wam": ("fast-wam", "fast-wam-tiny")}
# Where each family's DiT blocks are, for the torch.compile candidate.
COMPILED_BLOCKS = {"lingbot_va": "transformer.blocks", "fast_wam": "model.mot.layers"}
# Chunk-latency targets, each a ratio of two chunk medians (floor: the runner's chunk floor, zoo.bench.roofline).
TARGETS = {"runner/eager": 0.5, "runner/compile": 1.0, "runner/pytorch": 0.7, "executorch/runner": 1.05,
           "runner/floor": 2.0, "graphs/pytorch": 0.7, "graphs/floor": 2.0}
# Ratios a run reports without a target: what a lever buys, measured side by side (before / after).
LEVERS = {"graphs/runner": "each method replayed as a CUDA graph on torch's AOTI runner (--cuda-graphs)"}
JSON_NAME, MD_NAME = "chunk_latency.json", "chunk_latency.md"
# --only check writes its own files, so that it does not overwrite an earlier --only bench's timing.
CHECK_JSON_NAME, CHECK_MD_NAME = "policy_check.json", "policy_check.md"


def say(message: str) -> None:
    print(f"[bench-chunk {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------------
# Real-size policies with seeded random weights


@contextlib.contextmanager
def seeded_policy_weights(seed: int, draw_dtype: torch.dtype) -> Iterator[None]:
    """The one place a real-size policy gets its weights: the families' large modules built on meta and filled
    with values seeded by ``seed`` (``fast_init.seeded_weights``, zoo.bench.seeded's way), the rest by LeRobot's
    constructors from ``torch.manual_seed(seed)`` (each policy built in the block); no file read. Every value is
    drawn in (or rounded through) ``draw_dtype``, the unit's dtype: a policy built in another dtype (the bf16
    rule's float32 reference) holds the same weights. For a bf16 unit that is how its bf16 tensors were drawn
    before ``draw_dtype`` existed (tests/policies/test_fast_init_lerobot.py)."""
    with torch.random.fork_rng(devices=[]), fast_init.seeded_weights(seed, draw_dtype=draw_dtype):
        torch.manual_seed(seed)
        yield


def standin_repos(family: str, config, cache: Path, seed: int, real_vae: bool = True) -> None:
    """The repos the policy loads by Hub id, put into ``cache``: the families' own fabrication of them at this
    configuration's text width, with the real-size Wan2.2 VAE in place of the tiny one (``real_vae``; a tiny
    recipe's ``--seeded`` check keeps the tiny one)."""
    fam = policies.load_family(family)
    work = cache.parent / "standins"
    # LeRobot casts the VAE to the policy's dtype when loading.
    vae = real_size_wan22_vae().to(torch.bfloat16) if real_vae else None
    if family == "lingbot_va":
        folder = work / "frozen"
        fam._save_frozen_repo(config, seed, folder)
        if vae is not None:
            vae.save_pretrained(folder / "vae")
        put_in_cache(config.wan_pretrained_path, folder, cache)
        return
    text_dim = int(config.video_dit_config["text_dim"])
    generator = torch.Generator().manual_seed(seed)
    tokenizer_dir, wan_dir = work / "tokenizer", work / "wan"
    vocab = fam._write_tokenizer(tokenizer_dir, text_dim)
    fam._write_wan_components(wan_dir, text_dim, vocab, generator)
    if vae is not None:
        vae.save_pretrained(wan_dir / "vae")
    put_in_cache(fam.WAN22_DIFFUSERS_MODEL_ID, wan_dir, cache)
    put_in_cache(config.tokenizer_model_id, tokenizer_dir, cache)


def real_config(family: str, recipe):
    """The LeRobot config a checkpoint of this recipe carries (its policy_config / fabricate_config)."""
    fam = policies.load_family(family)
    if family == "lingbot_va":
        return fam._fabricated_config(recipe, fam._validate_recipe(recipe))
    return fast_wam_config(recipe)


def write_processors(family: str, config, folder: Path, seed: int) -> None:
    """The policy's processor files with seeded statistics (seed + 1: the weights take the seed itself)."""
    write_seeded_processors(family, config, folder, seed + 1)


def fabricated_checkpoint(settings: Mapping[str, Any]) -> bool:
    """Whether a run's policies load zoo's fabricated tiny checkpoint (``--tiny`` without ``--seeded``); every
    other run builds them with seeded weights from a placeholder checkpoint."""
    return bool(settings["tiny"]) and not settings["seeded"]


@contextlib.contextmanager
def policy_source(family: str, recipe, work: Path, settings: Mapping[str, Any]) -> Iterator[Tuple[Path, Callable]]:
    """(checkpoint folder, weights context) with the policy's Hub repos in reach for the block: zoo's fabricated
    checkpoint (``fabricated_checkpoint``), else a placeholder checkpoint, seeded random weights and stand-ins
    (real-size ones for a real recipe; a tiny recipe with ``--seeded`` checks that path on a CPU)."""
    tiny = bool(settings["tiny"])
    if fabricated_checkpoint(settings):
        with checkpoint_in_reach(recipe) as checkpoint:
            yield checkpoint, contextlib.nullcontext
        return
    config = real_config(family, recipe)
    checkpoint = work / "checkpoint"
    if not (checkpoint / "config.json").is_file():
        placeholder_checkpoint(config, checkpoint)
        write_processors(family, config, checkpoint, recipe.source.seed)
    cache = work / "hub"
    if not cache.is_dir():
        say(f"{family}: writing the Hub stand-ins ({'tiny' if tiny else 'real-size'} Wan2.2 VAE) into {cache}")
        standin_repos(family, config, cache, recipe.source.seed, real_vae=not tiny)
    draw_dtype = getattr(torch, recipe.unit.dtype)
    with hub_environment(cache, offline=True):
        yield checkpoint, lambda: seeded_policy_weights(recipe.source.seed, draw_dtype)




# ------------------------------------------------------------------------------------------------------
# Timing


def time_episodes(policy: Any, observations: List[dict], chunk_starts: List[int], episodes: int, seed: int,
                  device: str) -> Dict[str, Any]:
    """One untimed episode, then ``episodes`` timed ones: per select_action call, synchronised wall time."""
    chunk_ms: List[float] = []
    steady_ms = 0.0
    steady_actions = 0
    actions: List[torch.Tensor] = []
    first = chunk_starts[1]  # chunks 2..N: from the second chunk's first call to the end of the last full chunk
    last = chunk_starts[-1]
    for episode in range(episodes + 1):
        torch.manual_seed(seed)
        policy.reset()
        actions = []
        for step, obs in enumerate(observations):
            batch = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in obs.items()}
            sync(device)
            start = time.perf_counter()
            action = policy.select_action(batch)
            sync(device)
            ms = (time.perf_counter() - start) * 1e3
            actions.append(action.detach().to("cpu", torch.float32))
            if episode == 0 or not first <= step < last:
                continue
            steady_ms += ms
            steady_actions += 1
            if step in chunk_starts:
                chunk_ms.append(ms)
    stats = Stats.from_samples(chunk_ms)
    return {"chunk_ms": stats.as_dict(), "samples": len(chunk_ms),
            "actions_per_second": steady_actions / (steady_ms / 1e3) if steady_ms else None,
            "actions": torch.stack(actions)}


def chunk_starts_of(runner, observations: List[dict], seed: int) -> List[int]:
    """The steps whose select_action predicts a chunk (where the runner's chunk count goes up)."""
    torch.manual_seed(seed)
    runner.reset()
    starts, seen = [], 0
    for step, obs in enumerate(observations):
        runner.select_action(dict(obs))
        if runner.chunks_predicted != seen:
            starts.append(step)
            seen = runner.chunks_predicted
    return starts


class WithContext:
    """A preprocessor, then the precomputed prompt context added to its output."""

    def __init__(self, preprocessor: Callable, context: Dict[str, torch.Tensor]):
        self.preprocessor, self.context = preprocessor, context

    def __call__(self, batch: dict) -> dict:
        out = self.preprocessor(batch)
        return {**out, **{k: v.to(_device_of(out)) for k, v in self.context.items()}}


def _device_of(batch: dict) -> torch.device:
    return next((v.device for v in batch.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))


def compile_blocks(policy: Any, family: str) -> int:
    """``nn.Module.compile`` each DiT block in place; returns how many."""
    blocks = policy
    for part in COMPILED_BLOCKS[family].split("."):
        blocks = getattr(blocks, part)
    for block in blocks:
        block.compile()
    return len(blocks)


def refuse_unverified(run: RunFolder, backend: str, checked: bool = False) -> None:
    """Raise unless the artifact a runner would time passed verification, or (``checked``) zoo's policy check in
    the same output folder on one of its runtimes: the whole policy through the artifact against LeRobot."""
    if backend in ARTIFACT_BACKENDS and run.status() != "verified" and not checked:
        # A latency is worth quoting only for an artifact that computes what the policy does.
        raise RuntimeError(f"the artifact in {run.path} has not passed verification (report status "
                           f"{run.status()!r}) nor zoo's policy check in this output folder: nothing is timed on "
                           "it; lower and verify it first (--only lower), or run --only check")


def checked_here(out: Path, family: str) -> bool:
    """Whether ``--only check`` in ``out`` passed for this policy on one of the artifact's runtimes (both run the
    same compiled kernels)."""
    path = out / CHECK_JSON_NAME
    if not path.is_file():
        return False
    results = json.loads(path.read_text())
    return results.get("settings", {}).get("backend") in ARTIFACT_BACKENDS and any(
        r.get("policy") == family and (r.get("policy_check") or {}).get("status") == "passed"
        for r in results.get("policies", []))


def time_candidates(family: str, recipe, run: RunFolder, checkpoint: Path, weights: Callable, args,
                    record: Dict[str, Any], persist: Callable[[], None] = lambda: None) -> None:
    """The runner candidates (the runner on ``--backend``, then ``--executorch`` and ``--cuda-graphs``), LeRobot
    eager and (unless ``--no-compile``) LeRobot torch.compile, then ``--pytorch``, driven through the same seeded
    observations; their timings, their roofline and their distance from LeRobot eager go into ``record``, and
    ``persist()`` writes it after each, so a run cut short keeps what it measured."""
    settings = run.read_host_settings()
    steps = RUNNERS[settings.policy_type].episode_steps(settings, args.chunks)
    observations = synthetic_observations(settings, steps, args.seed, recipe.policy_check.task)
    fam = policies.load_family(family)
    with weights():
        policy, pre, post = fam.lerobot_policy(checkpoint, recipe, device=args.device)
    embedding = fam.embed_prompt(policy, recipe.policy_check.task)
    if family == "fast_wam":
        for obs in observations:  # the context goes in past the preprocessors, on both sides
            del obs["task"]
        pre = WithContext(pre, fast_wam_context(embedding))
    costs = ProgramCosts(run) if args.roofline else None
    rates: Optional[Rates] = getattr(args, "rates", None)
    timed: Dict[str, Dict[str, Any]] = {}
    starts: List[int] = []
    early, late = runner_candidates(args)
    for candidate in early:
        time_candidate(candidate, family, run, embedding, observations, starts, args, costs, rates, timed, record)
        persist()
    # LeRobot before the compiled PyTorch steps: Inductor's compile at real size is the longest stage of a run.
    lerobot = time_lerobot(family, ProcessedPolicy(policy, pre, post), policy, observations, starts, args, record)
    timed.update(lerobot)
    keep_timings(lerobot, record)
    persist()
    for candidate in late:
        time_candidate(candidate, family, run, embedding, observations, starts, args, costs, rates, timed, record)
    if costs is not None:
        costs.close()
    judge(timed, record)


def runner_candidates(args) -> Tuple[List[str], List[str]]:
    """The runner candidates timed before LeRobot, and those after it."""
    early = (["runner"] + (["executorch"] if args.executorch else [])
             + (["graphs"] if args.cuda_graphs else []))
    return early, (["pytorch"] if args.pytorch else [])


def time_candidate(candidate: str, family: str, run: RunFolder, embedding, observations: List[dict],
                   starts: List[int], args, costs: Optional[ProgramCosts], rates: Optional[Rates],
                   timed: Dict[str, Dict[str, Any]], record: Dict[str, Any]) -> None:
    """One runner candidate loaded, timed and closed; a candidate other than ``runner`` that fails is a result
    of its own (the others stand). The first one sets ``starts``, the chunk boundaries every candidate times."""
    say(f"{family}: {candidate} ({RUNNER_LABELS[candidate]})")
    try:
        runner = make_runner(candidate, run, args.backend, args.device)
    except Exception as exc:
        if candidate == "runner":
            raise
        record["candidates"][candidate] = {"error": error_line(exc)}
        return
    try:
        runner.prompts[embedding.task] = embedding
        if family == "fast_wam":
            runner.preprocessor = WithContext(runner.preprocessor, fast_wam_context(embedding))
        if not starts:
            starts.extend(chunk_starts_of(runner, observations, args.seed))
            record["actions_per_chunk"] = starts[2] - starts[1]
            record["chunk_starts"] = list(starts)
        timed[candidate] = time_runner(candidate, runner, observations, starts, args, costs, rates, time_episodes)
        keep_timings({candidate: timed[candidate]}, record)
    except Exception as exc:
        if candidate == "runner":
            raise
        record["candidates"][candidate] = {"error": error_line(exc), "traceback": traceback.format_exc(limit=8)}
    finally:
        runner.close()
        del runner  # its GPU memory back before the next candidate
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def keep_timings(timed: Dict[str, Dict[str, Any]], record: Dict[str, Any]) -> None:
    """The candidates' timings into ``record`` as they are measured (their actions stay out of the JSON)."""
    for name, t in timed.items():
        record["candidates"][name] = {k: v for k, v in t.items() if k != "actions"}


def fast_wam_context(embedding) -> Dict[str, torch.Tensor]:
    """Fast-WAM's prompt context, added past the preprocessor on both sides (LeRobot's pipeline drops extra keys):
    UMT5 out of the timed work, and the task text out of the batch (LeRobot takes one or the other)."""
    return {"context": embedding.tensors["context"], "context_mask": embedding.tensors["context_mask"]}


def time_lerobot(family: str, reference: ProcessedPolicy, policy: Any, observations: List[dict],
                 starts: List[int], args, record: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """LeRobot's policy eager, then with its DiT blocks compiled (a compile failure is recorded as that
    candidate's result; the other numbers stand)."""
    timed: Dict[str, Dict[str, Any]] = {}
    say(f"{family}: LeRobot eager")
    timed["eager"] = time_episodes(reference, observations, starts, args.episodes, args.seed, args.device)
    if not args.no_compile:
        say(f"{family}: LeRobot torch.compile")
        try:
            record["compiled_blocks"] = compile_blocks(policy, family)
            timed["compile"] = time_episodes(reference, observations, starts, args.episodes, args.seed,
                                             args.device)
        except Exception as exc:  # a compile failure is a result of its own; the other numbers stand
            record["candidates"]["compile"] = {"error": error_line(exc)}
    return timed


def judge(timed: Dict[str, Dict[str, Any]], record: Dict[str, Any]) -> None:
    """The candidates' numbers, their ratios and each runner candidate's distance from LeRobot eager into
    ``record``."""
    # Every candidate's timing is in the record already (keep_timings, as each was measured).
    # How far each runner's actions are from LeRobot eager's on the timed episode (same seed and weights).
    reference = timed["eager"]["actions"]
    for name in RUNNER_LABELS:
        if name in timed:
            diff = timed[name]["actions"] - reference
            record["candidates"][name]["vs_eager_rel_l2"] = float(diff.norm() / reference.norm())
    record["runner_vs_eager_rel_l2"] = record["candidates"]["runner"]["vs_eager_rel_l2"]
    record["ratios"] = ratios(record["candidates"])
    record["status"] = "done"
    nonfinite = int((~torch.isfinite(timed["runner"]["actions"])).sum())
    if nonfinite:  # the JSON keeps the timings; the table shows the error; nothing is recorded for a card
        record["status"], record["error"] = "failed", (f"the runner's actions hold {nonfinite} non-finite "
                                                       "values: its latency is not recorded")


def policy_check(family: str, recipe, run: RunFolder, checkpoint: Path, weights: Callable, args,
                 record: Dict[str, Any]) -> None:
    """zoo's policy check of the lowered run, inside the policy's seeded weights (LeRobot's bf16 and float32
    policies and the unit then hold the same values), recorded under ``record["policy_check"]``. A check that
    fails, or cannot run, is recorded as such; main() counts it as the policy's failure."""
    say(f"{family}: policy check ({args.backend} runner against LeRobot, {recipe.unit.dtype} unit)")
    entry: Dict[str, Any] = {}
    record["policy_check"] = entry
    started = time.perf_counter()
    try:
        with weights():
            result = check_run(run, recipe, checkpoint, backend=args.backend, device=args.device)
        entry.update(status="passed" if result.ok else "failed", result=result.as_dict(), table=result.table())
        print(result.table(), file=sys.stderr, flush=True)
    except Exception as exc:  # the check not running is a failure of its own, with the reason kept
        entry.update(status="error", error=error_line(exc), traceback=traceback.format_exc(limit=8))
        say(f"{family} policy check could not run: {entry['error']}")
    entry["seconds"] = round(time.perf_counter() - started, 1)
    if entry["status"] != "passed":
        say(f"{family}: policy check {entry['status']}")


def check_passed(record: Dict[str, Any]) -> bool:
    """Whether the policy's record holds no failure: timing done (or lowered/checked only), and a policy check,
    where one ran, passed."""
    check = record.get("policy_check")
    return record.get("status") in ("done", "lowered", "checked") and (check is None or check["status"] == "passed")


def ratios(candidates: Dict[str, Dict[str, Any]]) -> Dict[str, Optional[float]]:
    """Each ratio of TARGETS and LEVERS whose two chunk medians were measured (``floor``: the runner's chunk floor,
    which every runner candidate shares: they make the same calls)."""
    def median(name: str) -> Optional[float]:
        if name == "floor":
            return chunk_floor_of(candidates.get("runner"))
        return ((candidates.get(name) or {}).get("chunk_ms") or {}).get("median")

    out: Dict[str, Optional[float]] = {}
    for key in list(TARGETS) + list(LEVERS):
        top, bottom = (median(part) for part in key.split("/"))
        out[key] = top / bottom if top and bottom else None
    return out


def record_timings(results: Dict[str, Any], args, command: str) -> Optional[Path]:
    """The timed policies' entries into ``args.record`` (``zoo.contract.chunk_latency``); None when nothing was timed. A
    policy whose policy check failed in the same run is left out: the card quotes speed of an artifact that works."""
    env = results["environment"]
    entries = {r["recipe"]: chunk_latency.entry_from_bench(
        r, gpu=str(env.get("gpu") or env.get("device")), command=command, measured=time.strftime("%Y-%m-%d"),
        weights="zoo's fabricated tiny checkpoint" if fabricated_checkpoint(results["settings"]) else
        "seeded random weights (fast_init.seeded_weights), no checkpoint download")
        for r in results["policies"] if r.get("status") == "done" and check_passed(r)}  # a failed check: no numbers
    if not entries:
        return None
    path = chunk_latency.record_measured(entries, args.record)
    say(f"recorded the chunk latency of {', '.join(entries)} in {path}")
    return path


