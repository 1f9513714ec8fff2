#!/usr/bin/env python3
"""Chunk latency at real size: observation -> actions for one whole action chunk.

    python benchmarks/bench_chunk.py --out OUT [--policies lingbot_va fast_wam] [--chunks 4] [--episodes 3]

For each policy, three candidates drive the same seeded observation sequence, one episode at a time:

  runner (artifact)        zoo.runner over the lowered run folder: the shipped .so files through torch's AOTI
                           runner, the host loop in Python (the VAE encode, every video and action step, CFG,
                           slot bookkeeping, processors)
  LeRobot eager            LeRobot's own policy, ``postprocessor(policy.select_action(preprocessor(obs)))``
  LeRobot torch.compile    the same policy with its DiT blocks compiled (``nn.Module.compile`` on each block of
                           LingBot-VA's ``transformer.blocks`` / Fast-WAM's ``model.mot.layers``: the policy's
                           loops, KV cache and VAE stay eager, as a user compiling the model would leave them)

A chunk's latency is the wall time of the ``select_action`` call that predicts it (synchronised before and
after): everything from observation to actions. The first chunk of each episode is not counted (it holds the
once-per-episode work: LingBot-VA's prompt encode and streaming-cache set-up, compilation warm-up); chunks 2..N
of every episode are, after one untimed warm-up episode. Actions per second = the actions of those chunks over
the time of all ``select_action`` calls that produced them (queue pops and keyframe buffering included).
Targets: runner/eager <= 0.5 and runner/compile <= 1.0.

Prompts: LingBot-VA embeds the task once per episode (the first chunk); Fast-WAM's LeRobot policy would run
UMT5 on every chunk, so both sides get the precomputed context in the batch (``context``/``context_mask``, which
LeRobot's Fast-WAM accepts in place of a task) and UMT5 is out of the timed work on both sides, as in a deployed
runner with its prompt file.

Weights: seeded random, no checkpoint download. The policy is built from the recipe's configuration with the
construction ``zoo.bench.seeded`` uses (``fast_init.seeded_weights``; ``seeded_policy_weights`` below is the
one place to switch to another initialiser); the export unit and LeRobot's policy are built the same way from the
same seed, every value drawn in the unit's dtype (``draw_dtype``): so LeRobot's policy built in float32 (the
reference of zoo's bf16 rule) holds exactly the bf16 policy's weights, upcast. The repos the policies load by
Hub id are stand-ins in a private cache: the real-size Wan2.2 VAE
(0.7 B parameters, random) and a one-layer UMT5 and tokenizer at the policy's text width.

Stages, each resumable (a 10-minute command limit cuts a real-size run into calls): ``--only lower`` builds,
exports and lowers into OUT/<policy>/run, and on a GPU verifies the artifact as every zoo artifact is (the bf16
rule against the unit's float32 copy; skipped when model.pte is already there); ``--only bench`` times an
already-lowered run; ``--only check`` runs the policy check alone over an already-lowered run.
OUT/chunk_latency.json and OUT/chunk_latency.md are rewritten after every policy (by ``--only check``:
OUT/policy_check.json and OUT/policy_check.md, so an earlier timing stays).

Policy check (``--policy-check``, after the timing; or ``--only check``): zoo's own check of the run,
``zoo.export.policy_check.check_run`` (the runner on ``--backend``/``--device`` against LeRobot's select_action over the
recipe's policy_check episode), inside the same seeded weights: for a bf16 unit zoo's bf16 rule (per chunk, the
runner's distance from LeRobot float32 <= bf16_factor x LeRobot bf16's own, cosine >= bf16_min_cosine), for a
float32 unit the float32 tolerance. Recorded per policy under ``policy_check`` and in its own section of the
markdown; a failed or broken check fails the policy (exit status 1) without hiding its timing.
``--tiny --backend eager --device cpu --no-compile`` checks this script on a CPU; with ``--seeded`` too it takes the
real-size run's weights path (placeholder checkpoint, seeded weights, stand-ins), which a tiny checkpoint skips.

``--record`` stores each timed policy's numbers under its recipe in ``zoo/data/chunk_latency.json``
(``zoo.contract.chunk_latency``), which the model card of every artifact of that recipe quotes; only the artifact runner on
a GPU at real size may go there (``--record FILE`` writes any run elsewhere).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import shlex
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import torch  # noqa: E402

from zoo import bench
from zoo.bench.seeded import fast_wam_config, placeholder_checkpoint, write_seeded_processors
from zoo.contract import chunk_latency
from zoo.export import stages as gpu_steps
from zoo.export import pipeline
from zoo import policies  # noqa: E402
from zoo.export.hub_cache import hub_environment, put_in_cache  # noqa: E402
from zoo.export.policy_check import check_run, checkpoint_in_reach  # noqa: E402
from zoo.policies import fast_init  # noqa: E402
from zoo.policies.tiny_wan import real_size_wan22_vae  # noqa: E402
from zoo.contract.recipes import load_recipe  # noqa: E402
from zoo.core.report import RunReport, format_table, markdown_table  # noqa: E402
from zoo.contract.run_folder import RunFolder  # noqa: E402
from zoo.runner import load as load_runner  # noqa: E402
from zoo.runner.check import ProcessedPolicy  # noqa: E402
from zoo.runner.loading import RUNNERS  # noqa: E402
from zoo.runner.observations import synthetic_observations  # noqa: E402

POLICIES = {"lingbot_va": ("lingbot-va", "lingbot-va-tiny"), "fast_wam": ("fast-wam", "fast-wam-tiny")}
# Where each family's DiT blocks are, for the torch.compile candidate.
COMPILED_BLOCKS = {"lingbot_va": "transformer.blocks", "fast_wam": "model.mot.layers"}
TARGETS = {"runner/eager": 0.5, "runner/compile": 1.0}
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
# Export and lower


def lower_policy(family: str, recipe, run: RunFolder, checkpoint: Path, weights: Callable, device: str) -> None:
    """Build, export, rewrite, preflight, lower and verify through the pipeline's own steps into ``run``.

    On a GPU the lowered artifact is verified as every zoo artifact is (``gpu_steps.verify_unit_step``: the
    bf16 rule against the unit's float32 copy, made on the GPU) before anything is timed on it; a failed
    verification fails the policy here. The eager backend (a CPU check of this script) saves the rewritten
    programs instead, and there is nothing to verify."""
    run.path.mkdir(parents=True, exist_ok=True)
    report = RunReport(run.path, recipe.to_dict())
    run.write_recipe(recipe)
    try:
        fam = policies.load_family(family)
        with weights():
            unit = pipeline.build_step(None, recipe, run, report, build=lambda: fam.build_unit(checkpoint, recipe))
        programs, _ = pipeline.export_step(unit, recipe, run, report, save=False, reference=False)
        rewritten = pipeline.rewrite_step(programs, recipe, report)
        del programs
        gc.collect()
        if torch.device(device).type == "cuda":
            # lower_step runs the kernel preflight on each method's own edge program: no second to_edge here.
            gpu_steps.lower_step(rewritten, run, recipe, report, consume=True)
            del rewritten
            gc.collect()
            say(f"{family}: verify the artifact (bf16 rule against the float32 unit, on {device})")
            gpu_steps.verify_unit_step(run, recipe, report, unit, device=device)
            report.record("status", "verified")
        else:
            pipeline.save_step(rewritten, recipe, run, report)
            report.record("status", "lowered")
    finally:
        run.write_report(report)


# ------------------------------------------------------------------------------------------------------
# Timing


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


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
    stats = bench.Stats.from_samples(chunk_ms)
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


def bench_policy(family: str, args, out: Path, results: Dict[str, Any]) -> None:
    real, tiny = POLICIES[family]
    recipe = load_recipe(tiny if args.tiny else real)
    work = out / family
    run = RunFolder(work / "run")
    record: Dict[str, Any] = {"policy": family, "recipe": recipe.name, "dtype": recipe.unit.dtype,
                              "candidates": {}}
    results["policies"].append(record)
    have = run.pte.is_file() if args.backend == "artifact" else run.program("rewritten", recipe.unit.methods[0]).is_file()
    try:
        with policy_source(family, recipe, work, results["settings"]) as (checkpoint, weights):
            if not have and args.only not in ("bench", "check"):
                say(f"{family}: build, export and lower ({', '.join(recipe.unit.methods)}) into {run.path}")
                lower_policy(family, recipe, run, checkpoint, weights, args.device)
            record["run"] = str(run.path)
            if args.only == "lower":
                record["status"] = "lowered"
                return
            if args.only == "check":
                record["status"] = "checked"
                policy_check(family, recipe, run, checkpoint, weights, args, record)
                return
            if args.backend == "artifact" and run.status() != "verified":
                # A latency is worth quoting only for an artifact that computes what the policy does.
                raise RuntimeError(f"the artifact in {run.path} has not passed verification (report status "
                                   f"{run.status()!r}): nothing is timed on it; lower and verify it first "
                                   "(--only lower), or run --only check to see how its actions differ")
            settings = run.read_host_settings()
            steps = RUNNERS[settings.policy_type].episode_steps(settings, args.chunks)
            observations = synthetic_observations(settings, steps, args.seed, recipe.policy_check.task)
            fam = policies.load_family(family)
            runner = load_runner(run, backend=args.backend, device=args.device)
            with weights():
                policy, pre, post = fam.lerobot_policy(checkpoint, recipe, device=args.device)
            embedding = fam.embed_prompt(policy, recipe.policy_check.task)
            runner.prompts[embedding.task] = embedding
            if family == "fast_wam":
                # The context on both sides, added past the preprocessor (LeRobot's pipeline drops extra keys):
                # UMT5 out of the timed work, and the task text out of the batch (LeRobot takes one or the other).
                context = {"context": embedding.tensors["context"], "context_mask": embedding.tensors["context_mask"]}
                for obs in observations:
                    del obs["task"]
                pre = WithContext(pre, context)
                runner.preprocessor = WithContext(runner.preprocessor, context)
            starts = chunk_starts_of(runner, observations, args.seed)
            record["actions_per_chunk"] = starts[2] - starts[1]
            record["chunk_starts"] = starts
            timed: Dict[str, Dict[str, Any]] = {}
            say(f"{family}: runner ({args.backend})")
            timed["runner"] = time_episodes(runner, observations, starts, args.episodes, args.seed, args.device)
            runner.close()
            del runner
            gc.collect()
            reference = ProcessedPolicy(policy, pre, post)
            say(f"{family}: LeRobot eager")
            timed["eager"] = time_episodes(reference, observations, starts, args.episodes, args.seed, args.device)
            if not args.no_compile:
                say(f"{family}: LeRobot torch.compile")
                try:
                    record["compiled_blocks"] = compile_blocks(policy, family)
                    timed["compile"] = time_episodes(reference, observations, starts, args.episodes, args.seed,
                                                     args.device)
                except Exception as exc:  # a compile failure is a result of its own; the other numbers stand
                    record["candidates"]["compile"] = {"error": bench.error_line(exc)}
            for name, t in timed.items():
                record["candidates"][name] = {k: v for k, v in t.items() if k != "actions"}
            # How far the runner's actions are from LeRobot eager's on the timed episode (same seed and weights).
            diff = timed["runner"]["actions"] - timed["eager"]["actions"]
            record["runner_vs_eager_rel_l2"] = float(diff.norm() / timed["eager"]["actions"].norm())
            record["ratios"] = ratios(record["candidates"])
            record["status"] = "done"
            nonfinite = int((~torch.isfinite(timed["runner"]["actions"])).sum())
            if nonfinite:  # the JSON keeps the timings; the table shows the error; nothing is recorded for a card
                record["status"], record["error"] = "failed", (f"the runner's actions hold {nonfinite} non-finite "
                                                               "values: its latency is not recorded")
            del policy, pre, post, reference, timed
            if args.policy_check:
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                policy_check(family, recipe, run, checkpoint, weights, args, record)
    except Exception as exc:  # one policy failing (out of memory, a lowering refusal) must not lose the other
        record["status"] = "failed"
        record["error"] = bench.error_line(exc)
        record["traceback"] = traceback.format_exc(limit=8)
        say(f"{family} failed: {record['error']}")
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


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
        entry.update(status="error", error=bench.error_line(exc), traceback=traceback.format_exc(limit=8))
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
    def median(name: str) -> Optional[float]:
        return ((candidates.get(name) or {}).get("chunk_ms") or {}).get("median")

    runner = median("runner")
    return {"runner/eager": runner / median("eager") if runner and median("eager") else None,
            "runner/compile": runner / median("compile") if runner and median("compile") else None}


# ------------------------------------------------------------------------------------------------------
# Rendering


def table_rows(results: Dict[str, Any]) -> List[List[str]]:
    rows = [["policy", "actions/chunk", "runner ms", "eager ms", "compile ms", "runner/eager", "runner/compile",
             "actions/s runner", "actions/s eager", "actions/s compile", "runner vs eager rel L2"]]

    def ms(c: Dict[str, Any]) -> str:
        if c.get("error"):
            return "failed"
        s = c.get("chunk_ms")
        return f"{s['median']:.1f} (p10 {s['p10']:.1f}, p90 {s['p90']:.1f})" if s else "-"

    def aps(c: Dict[str, Any]) -> str:
        v = c.get("actions_per_second")
        return f"{v:.1f}" if v else "-"

    def ratio(value: Optional[float], key: str) -> str:
        if value is None:
            return "-"
        return f"{value:.2f}x ({'meets' if value <= TARGETS[key] else 'misses'} <= {TARGETS[key]})"

    for r in results["policies"]:
        if r.get("status") == "checked":
            continue  # the policy check alone: its own section
        if r.get("status") != "done":
            rows.append([r["policy"], r.get("status", "?"), r.get("error", "")] + [""] * 8)
            continue
        c = r["candidates"]
        rows.append([f"{r['policy']} ({r['dtype']})", str(r["actions_per_chunk"]), ms(c.get("runner", {})),
                     ms(c.get("eager", {})), ms(c.get("compile", {})),
                     ratio(r["ratios"]["runner/eager"], "runner/eager"),
                     ratio(r["ratios"]["runner/compile"], "runner/compile"), aps(c.get("runner", {})),
                     aps(c.get("eager", {})), aps(c.get("compile", {})), f"{r['runner_vs_eager_rel_l2']:.2e}"])
    return rows


def write(results: Dict[str, Any], out: Path) -> None:
    check_only = results["settings"]["only"] == "check"
    json_name, md_name = (CHECK_JSON_NAME, CHECK_MD_NAME) if check_only else (JSON_NAME, MD_NAME)
    (out / json_name).write_text(json.dumps(results, indent=2, default=str))
    env = results["environment"]
    title = ("Policy check of the lowered runs" if check_only
             else "Chunk latency: observation -> actions for one whole chunk")
    md = [f"# {title}", "",
          f"Command: `{results['command']}`", "",
          f"GPU: {env.get('gpu') or env.get('device')}; torch {env.get('torch')}; executorch {env.get('executorch')}.",
          ""] + ([] if check_only else [markdown_table(table_rows(results)), ""])
    md += policy_check_section(results)
    (out / md_name).write_text("\n".join(md))


def policy_check_section(results: Dict[str, Any]) -> List[str]:
    """The markdown section of the policy checks that ran: verdict, rule and zoo's per-chunk table."""
    checked = [r for r in results["policies"] if r.get("policy_check")]
    if not checked:
        return []
    md = ["## Policy check: the runner against LeRobot's select_action (zoo.export.policy_check.check_run)", "",
          ("zoo's fabricated tiny checkpoints." if fabricated_checkpoint(results["settings"]) else
           "Seeded weights drawn in the unit's dtype, so LeRobot's bf16 and float32 policies and the lowered unit "
           "hold the same values.")
          + " A bf16 unit is judged by zoo's bf16 rule, a float32 one by its float32 tolerance.", ""]
    for r in checked:
        c = r["policy_check"]
        result = c.get("result") or {}
        md.append(f"### {r['policy']} ({r['dtype']}): {c['status'].upper()}"
                  + (f", {result.get('rule')} rule, {result.get('chunks')} chunks" if result else "")
                  + f" ({c.get('seconds')} s)")
        md += ["", "```", c.get("table") or c.get("error", ""), "```", ""]
    return md


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benchmarks/bench_chunk.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--out", type=Path, required=True, help="output folder (one sub-folder per policy)")
    p.add_argument("--policies", nargs="+", choices=sorted(POLICIES), default=["lingbot_va", "fast_wam"])
    p.add_argument("--chunks", type=int, default=4, help="whole chunks per episode; 2..N are timed (default 4)")
    p.add_argument("--episodes", type=int, default=3, help="timed episodes after one untimed (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=("lower", "bench", "check"), default=None,
                   help="lower: build, export and lower only; bench: time an already-lowered run only; check: "
                        "the policy check of an already-lowered run only")
    p.add_argument("--policy-check", action="store_true",
                   help="after the timing, zoo's policy check of the run (bf16 rule for a bf16 unit)")
    p.add_argument("--backend", choices=("artifact", "eager"), default="artifact",
                   help="the runner's backend (eager: the rewritten programs, for a CPU check of this script)")
    p.add_argument("--no-compile", action="store_true", help="skip the LeRobot torch.compile candidate")
    p.add_argument("--tiny", action="store_true", help="the tiny recipes instead (checks this script)")
    p.add_argument("--seeded", action="store_true",
                   help="with --tiny: the weights the real-size run uses (a placeholder checkpoint with no weights, "
                        "seeded random weights, Hub stand-ins), so a CPU run checks that path")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--record", nargs="?", type=Path, const=chunk_latency.MEASURED_JSON, default=None, metavar="JSON",
                   help="after the timing, store each timed policy's numbers per recipe (default: zoo's own table, "
                        "zoo/data/chunk_latency.json, which model cards quote: only the artifact runner on a GPU "
                        "at real size goes there)")
    return p


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


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.chunks < 3:
        raise SystemExit("--chunks must be >= 3: chunks 2..N are timed and the first two set the chunk length")
    if (args.record is not None and args.record.resolve() == chunk_latency.MEASURED_JSON
            and (args.tiny or args.backend != "artifact" or torch.device(args.device).type != "cuda")):
        raise SystemExit(f"--record into {chunk_latency.MEASURED_JSON} takes only the artifact runner on a GPU at "
                         "real size (model cards quote it); give --record another file for this run")
    out = args.out.expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/bench_chunk.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    results: Dict[str, Any] = {"command": command, "environment": bench.environment(args.device),
                               "settings": {"chunks": args.chunks, "episodes": args.episodes, "seed": args.seed,
                                            "backend": args.backend, "tiny": args.tiny, "seeded": args.seeded,
                                            "only": args.only,
                                            "policy_check": args.policy_check or args.only == "check"},
                               "targets": TARGETS, "policies": []}
    for family in args.policies:
        bench_policy(family, args, out, results)
        write(results, out)
    if args.only != "check":
        print(format_table(table_rows(results)))
        if args.record is not None:
            record_timings(results, args, command)
    for line in policy_check_section(results):
        print(line)
    failed = [r["policy"] for r in results["policies"] if not check_passed(r)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
