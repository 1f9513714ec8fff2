"""The policy check: the runner over a run folder against LeRobot's own policy from the same checkpoint, driven as a
LeRobot control loop drives it, over seeded synthetic episodes (``policy_check.episodes``), float32 judged per action
chunk, bf16 by zoo's bf16 rule over all actions: on the CPU during export (eager runner, float32 units) and on the
GPU after verification (the artifact). A quantized unit's reference is LeRobot's policy quantized as the unit was
(the same layers, zoo.export.quantize's own code), and the check reports what quantization costs the actions.
Skipped where lerobot is missing; "not applicable" to families without an action loop (docs/host-loops.md).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional

import torch

from zoo.export import pull as hub
from zoo import policies
from zoo.export import tiny_hub
from zoo.core.errors import PolicyCheckFailed, PullError
from zoo.core.progress import Progress, say
from zoo.core.report import RunReport, timed_stage
from zoo.contract.run_folder import RunFolder
from zoo.runner import load as load_runner
from zoo.runner.check import ChunkTolerance, PolicyCheckResult, ProcessedPolicy, compare_episode, run_episode
from zoo.runner.loading import RUNNERS
from zoo.runner.observations import synthetic_observations
from zoo.export.quant_cost import policy_cost
from zoo.export.quantize import quantize_policy
from zoo.export.verify import full_fp32_precision

# The stage each place of the check is recorded under, and its label.
STAGES = {"cpu": ("policy_check", "policy check: eager runner against LeRobot's select_action on the CPU"),
          "gpu": ("policy_check_gpu", "policy check: artifact runner against LeRobot's select_action on the GPU")}
NEEDS_LEROBOT = "needs lerobot (the policies extra: pip install 'zoo[policies]'), which is not installed here"
# The CPU check runs for float32 units only. LeRobot's Fast-WAM keeps its float32 regions with
# torch.amp.autocast("cuda"), which does nothing on the CPU, so its bf16 policy fails there ("mat1 and mat2 must
# have the same dtype"); and bf16 episodes on the CPU take minutes. The GPU stage runs the bf16 check.
BF16_ON_CPU = ("the CPU policy check runs for float32 units only ({dtype} here): LeRobot's bf16 policies need "
               "the GPU (Fast-WAM's float32 regions use CUDA autocast) and bf16 episodes on the CPU take minutes; "
               "the GPU policy check covers {dtype} units")


def not_applicable(recipe) -> Optional[str]:
    """Why the recipe's family has no policy check, or None when it has one."""
    families = sorted(r.family for r in RUNNERS.values())
    if recipe.family in families:
        return None
    return (f"not applicable: {recipe.family} has no action loop (zoo.runner drives "
            f"{', '.join(families)})")


def why_skipped(recipe, where: str) -> Optional[str]:
    """Why the policy check does not run here (``where``: "cpu" or "gpu"), or None when it runs."""
    reason = not_applicable(recipe)
    if reason:
        return reason
    if not getattr(recipe.policy_check, where):
        return f"policy_check.{where} is false in the recipe"
    if where == "cpu" and recipe.unit.dtype != "float32":
        return BF16_ON_CPU.format(dtype=recipe.unit.dtype)
    if importlib.util.find_spec("lerobot") is None:
        return NEEDS_LEROBOT
    return None


@contextlib.contextmanager
def checkpoint_in_reach(recipe) -> Iterator[Path]:
    """The recipe's checkpoint folder, with the repos its policy loads by Hub id (VAE, UMT5, tokenizer) in
    reach: for a tiny recipe, zoo's fabricated cache served offline; otherwise the user's Hub cache as it is."""
    if recipe.source.fabricate and not recipe.source.local_dir:
        with tiny_hub.fabricated_hub(recipe):
            yield hub.pull(recipe).path
    else:
        yield hub.pull(recipe).path


def episode(run: RunFolder, recipe, seed: Optional[int] = None) -> List[dict]:
    """The observation sequence both sides get: enough for ``policy_check.chunks`` chunks and one more action
    (seeded by ``seed``, by default the recipe's ``policy_check.seed``)."""
    settings = run.read_host_settings()
    runner_class = RUNNERS[settings.policy_type]
    check = recipe.policy_check
    return synthetic_observations(settings, runner_class.episode_steps(settings, check.chunks),
                                  check.seed if seed is None else seed, check.task)


def check_run(run: RunFolder, recipe, checkpoint: Path, *, backend: str = "eager",
              device: str = "cpu", cuda_graphs: bool = False,
              quantized: Optional[Mapping[str, Any]] = None) -> PolicyCheckResult:
    """The runner over ``run`` (``backend`` on ``device``, its methods replayed as CUDA graphs with
    ``cuda_graphs``) against LeRobot's policy from ``checkpoint`` on the same device, over
    ``policy_check.episodes`` episodes (seeds ``seed``, ``seed + 1``, ...). Returns the result, every chunk and,
    under the bf16 rule, the verdict over all actions; raising on a failed one is the caller's.

    A quantized unit is judged by the same rule against LeRobot's policy quantized as the unit was (``quantized``:
    the run's ``quantization.applied`` record, read from its report when None), and the result carries what
    quantization costs the policy's actions against LeRobot's unquantized float32 policy."""
    family = policies.load_family(recipe.family)
    check = recipe.policy_check
    seeds = [check.seed + k for k in range(max(1, check.episodes))]
    observations = {seed: episode(run, recipe, seed) for seed in seeds}
    applied = _applied_quantization(run, recipe, quantized)
    low_precision = recipe.unit.dtype != "float32"
    tolerance = ChunkTolerance(float32=check.tolerance.float32 if device == "cpu" else check.tolerance.gpu_float32,
                               bf16_factor=check.tolerance.bf16_factor,
                               bf16_min_cosine=check.tolerance.bf16_min_cosine)
    precision = full_fp32_precision() if device != "cpu" else contextlib.nullcontext()
    # Past 10 s a bar shows which episode runs: LeRobot's (its float32 one for bf16, its unquantized one for a
    # quantized unit), then the runner's.
    per_seed = 2 + low_precision + (applied is not None)
    with precision, tempfile.TemporaryDirectory(prefix="zoo-policy-check-") as tmp, \
            Progress("policy check", per_seed * len(seeds), unit="episode") as bar:
        # The runner reads the task's embedding from a prompt file, as a deployed runner does.
        lerobot = _lerobot_references(family, checkpoint, recipe, device, observations, bar, applied,
                                      Path(tmp) / "task.safetensors")
        bar.begin(f"the {backend} runner")
        runner = load_runner(run, backend=backend, device=device, cuda_graphs=cuda_graphs)
        try:
            runner.load_prompt(lerobot.prompt)
            results = []
            for seed in seeds:
                results.append(compare_episode(runner, lerobot.expected[seed], observations[seed], seed=seed,
                                               tolerance=tolerance, min_chunks=check.chunks,
                                               reference_low=lerobot.low[seed] if low_precision else None))
                bar.advance()
        finally:
            runner.close()
    result = PolicyCheckResult.merged(results)
    result.notes.append(f"{len(observations[seeds[0]])} observations an episode: seeded synthetic (seed of the "
                        f"episode) from the policy's input features; task {check.task!r}")
    if applied is not None:
        result.notes.append(f"LeRobot's policy quantized as the unit: {len(applied['policy_layers'])} linear "
                            f"layer(s), {applied.get('words')} (torchao {applied.get('torchao')})")
        chunks = {res.seed: [row.steps for row in res.rows] for res in results}
        result.quantization_cost = policy_cost(lerobot.low, lerobot.unquantized, chunks, recipe,
                                               lerobot.expected if low_precision else None)
    return result


def _applied_quantization(run: RunFolder, recipe, given: Optional[Mapping[str, Any]]) -> Optional[Mapping[str, Any]]:
    """What the quantize stage did to the run's unit (its report's ``quantization.applied``), or None for a unit
    that is not quantized. A run whose report does not say gives {}: ``quantize_policy`` refuses it."""
    if not recipe.unit.quantize.enabled:
        return None
    if given is not None:
        return given
    return (run.read_report().get("quantization") or {}).get("applied") or {}


@dataclass
class _LeRobotEpisodes:
    """LeRobot's side of the check, per episode seed: ``low`` its policy in the unit's dtype (quantized as the unit
    for a quantized unit), ``expected`` what the runner is judged against (``low`` itself, or its policy in float32
    under the bf16 rule), ``unquantized`` its unquantized policy in float32 (a quantized unit only), and the prompt
    file the runner reads."""

    low: Dict[int, List[torch.Tensor]]
    expected: Dict[int, List[torch.Tensor]]
    unquantized: Optional[Dict[int, List[torch.Tensor]]]
    prompt: Path


def _lerobot_references(family, checkpoint: Path, recipe, device: str, observations: Dict[int, List[dict]], bar,
                        applied: Optional[Mapping[str, Any]], prompt_file: Path) -> _LeRobotEpisodes:
    """LeRobot's episodes, one policy built at a time. A policy's unquantized episodes run before it is quantized
    in place, so that each precision is built once."""
    bar.begin("LeRobot's select_action")
    policy, pre, post = _lerobot_policy(family, checkpoint, recipe, device)
    prompt = family.embed_prompt(policy, recipe.policy_check.task).save(prompt_file)
    unquantized = None
    low_precision = recipe.unit.dtype != "float32"
    if applied is not None and not low_precision:
        unquantized = _episodes(ProcessedPolicy(policy, pre, post), observations, bar)
    _quantized_as_unit(policy, applied, recipe)
    low = _episodes(ProcessedPolicy(policy, pre, post), observations, bar)
    del policy, pre, post
    expected = low
    if low_precision:  # the bf16 rule's float32 reference: LeRobot's policy in float32, same checkpoint
        bar.begin("LeRobot's select_action in float32")
        recipe32 = copy.deepcopy(recipe)
        recipe32.unit.dtype = "float32"
        policy, pre, post = _lerobot_policy(family, checkpoint, recipe32, device)
        # A family whose policy draws its noise in the policy dtype has the float32 episodes draw the
        # low-precision episode's noise, so the rule measures precision, not another sample.
        same_noise = getattr(family, "float32_reference_noise", None)
        with same_noise(getattr(torch, recipe.unit.dtype)) if same_noise else contextlib.nullcontext():
            if applied is not None:
                unquantized = _episodes(ProcessedPolicy(policy, pre, post), observations, bar)
            _quantized_as_unit(policy, applied, recipe)
            expected = _episodes(ProcessedPolicy(policy, pre, post), observations, bar)
        del policy, pre, post
    return _LeRobotEpisodes(low, expected, unquantized, prompt)


def _quantized_as_unit(policy, applied: Optional[Mapping[str, Any]], recipe) -> None:
    """LeRobot's policy quantized in place as the unit was, with zoo.export.quantize's own code; nothing for a unit
    that is not quantized."""
    if applied is not None:
        quantize_policy(policy, applied, recipe.unit.quantize)


def _episodes(policy: ProcessedPolicy, observations: Dict[int, List[dict]], bar) -> Dict[int, List]:
    """One episode of ``policy`` per seed, each from ``torch.manual_seed(seed)``."""
    actions = {}
    for seed, sequence in observations.items():
        actions[seed] = run_episode(policy, sequence, seed)
        bar.advance()
    return actions


def _lerobot_policy(family, checkpoint: Path, recipe, device: str):
    """LeRobot's policy and processors; the repos it loads by Hub id missing here is a PullError, not a bug."""
    try:
        return family.lerobot_policy(checkpoint, recipe, device=device)
    except OSError as exc:  # huggingface_hub / diffusers / transformers: a repo not in the cache while offline
        raise PullError(f"LeRobot's policy cannot be built here: {type(exc).__name__}: {exc}",
                        "the policy loads its VAE, text encoder and tokenizer by Hub id: run with network once, or "
                        "bring them with `python -m zoo bundle`") from None


def policy_check_step(run: RunFolder, recipe, report: RunReport, *, where: str = "cpu",
                      checkpoint: Optional[Path] = None) -> Optional[PolicyCheckResult]:
    """The policy check as a stage of the run (``where``: "cpu" during export, "gpu" after verification),
    recorded under report section ``policy_check`` (``{"cpu": ..., "gpu": ...}``). A failed check raises
    ``PolicyCheckFailed`` with the table; a check that cannot run here (not applicable, turned off, no lerobot,
    the policy's Hub repos out of reach) is recorded as skipped with the reason."""
    stage, label = STAGES[where]
    reason = why_skipped(recipe, where)
    if reason:
        record_skip(report, where, reason)
        return None
    backend, device = ("eager", "cpu") if where == "cpu" else ("artifact", "cuda")
    try:
        with timed_stage(report, stage, label) as facts:
            in_reach = contextlib.nullcontext(checkpoint) if checkpoint is not None else checkpoint_in_reach(recipe)
            applied = (report.get("quantization") or {}).get("applied")
            with in_reach as folder:
                result = check_run(run, recipe, folder, backend=backend, device=device, quantized=applied)
            report.record("policy_check", {**(report.get("policy_check") or {}), where: result.as_dict()})
            print(result.table())
            facts["failure"] = failed_detail(result)
            require_passed(result)
            facts["detail"] = passed_detail(result)
    except PullError as exc:
        if report.get("failed_stage") == stage:  # timed_stage marked it failed; it is a skip, the run goes on
            report.data.pop("failed_stage")
        record_skip(report, where, f"LeRobot's reference is out of reach: {exc.message}")
        return None
    return result


def record_skip(report: RunReport, where: str, reason: str) -> None:
    """Record the check at ``where`` as skipped (or not applicable), with the reason, in stage and section."""
    stage, label = STAGES[where]
    report.record("policy_check", {**(report.get("policy_check") or {}), where: skipped_record(reason)})
    report.stage(stage, "skipped", None, reason)
    say(f"{label}: skipped ({reason})")


def require_passed(result: PolicyCheckResult) -> None:
    if not result.ok:
        reproduced = not result.failures() and (result.pooled is None or result.pooled.ok)
        hint = ("quantization moves LeRobot's own actions more than the recipe allows: exclude the layers that "
                "matter (unit.quantize.exclude), use a finer group, or loosen unit.quantize.bound" if reproduced else
                "the runner or the artifact does not reproduce the policy: the table shows which chunk; check "
                "host_settings.json (schedules, shifts, guidance) and the verification report")
        exc = PolicyCheckFailed(
            f"policy check failed: {result.verdict()}, against LeRobot's select_action (runner {result.backend} on "
            f"{result.device})\n" + result.table(), hint, result=result)
        raise exc


def skipped_record(reason: str) -> dict:
    return {"status": "not applicable" if reason.startswith("not applicable") else "skipped", "reason": reason}


def passed_detail(result: PolicyCheckResult) -> str:
    actions = sum(r.steps for r in result.rows)
    cost = result.quantization_cost
    quantized = "" if cost is None else (
        f"; against LeRobot quantized as the unit; quantization moves LeRobot's actions by rel L2 "
        f"{cost['all_actions']['rel_l2']:.2e} (seeded synthetic episodes, not a task-success figure)")
    if result.pooled is not None:
        return (f"{len(result.rows)} chunks ({actions} actions): rel L2 {result.pooled.rel_l2:.2e} over all of "
                f"them, bound {result.pooled.bound:.3e} ({result.backend}, {result.device}, {result.rule})" + quantized)
    worst = max(r.rel_l2 for r in result.rows)
    return (f"{len(result.rows)} chunks ({actions} actions) within tolerance, "
            f"worst rel L2 {worst:.2e} ({result.backend}, {result.device}, {result.rule})" + quantized)


def failed_detail(result: Optional[Any]) -> Optional[str]:
    return result.verdict() if isinstance(result, PolicyCheckResult) else None

