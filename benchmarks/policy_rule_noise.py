"""How often zoo's bf16 policy rule fails a runner that is right, and whether it catches one that is wrong.

The runner over a bf16 run folder (its programs equal LeRobot's in float32; in bf16 they round differently) is
judged against LeRobot's float32 episode, with LeRobot's own bf16 episode as the yardstick, over many seeds. Since
the programs are right, every failure is a false one. Two rules are counted side by side on the same episodes:
chunk by chunk (each chunk's own 1.25x bound, the rule before) and over all of an episode's actions (the rule now,
``zoo.runner.check.Pooled``), and the latter over groups of episodes. Copies of the run with one sigma of a
stream's schedule (``--stream``) off by each ``--sigma-error`` are judged the same way: what a rule lets through. Runs where the
policy check runs (the CPU for LingBot-VA's tiny recipe); results in docs/benchmarks.md.

    python -m zoo.export lingbot-va-tiny unit.dtype=bfloat16 --output-dir RUN
    python benchmarks/policy_rule_noise.py RUN --set unit.dtype=bfloat16 --episodes 21 --group 3
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path
from typing import Dict, List

from zoo.contract.recipes import load_recipe
from zoo.contract.run_folder import RunFolder
from zoo.export.policy_check import check_run, checkpoint_in_reach
from zoo.runner.check import PolicyCheckResult


def episodes(run: RunFolder, recipe_name: str, overrides: List[str], seeds: range, device: str
             ) -> List[PolicyCheckResult]:
    results = []
    for seed in seeds:
        recipe = load_recipe(recipe_name, overrides + [f"policy_check.seed={seed}", "policy_check.episodes=1"])
        with checkpoint_in_reach(recipe) as checkpoint:
            results.append(check_run(run, recipe, checkpoint, backend="eager", device=device))
    return results


def verdicts(results: List[PolicyCheckResult], group: int) -> Dict[str, int]:
    """Failures under each rule: chunk by chunk, over each episode, over each group of ``group`` episodes."""
    by_chunk = sum(not all(r.ok and r.rel_l2 <= r.bound for r in res.rows) for res in results)
    by_episode = sum(not res.ok for res in results)
    groups = [results[i:i + group] for i in range(0, len(results) - group + 1, group)]
    by_group = sum(not PolicyCheckResult.merged(g).ok for g in groups)
    return {"episodes": len(results), "chunk by chunk": by_chunk, "over each episode": by_episode,
            "groups": len(groups), f"over {group} episodes": by_group}


def perturbed(run: RunFolder, folder: Path, stream: str, error: float) -> RunFolder:
    """The run with sigma 5 of one stream's schedule in its host settings off by ``error``
    (tests/runner/test_lingbot_va_runner.py catches a video sigma 1% off in float32)."""
    shutil.copytree(run.path, folder)
    copy = RunFolder(folder)
    settings = copy.read_host_settings()
    getattr(settings.scheduler, stream).sigmas[5] *= 1 + error
    copy.write_host_settings(settings)
    return copy


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a bf16 run folder of the recipe (python -m zoo.export ...)")
    parser.add_argument("--recipe", default="lingbot-va-tiny")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="the overrides it was exported with")
    parser.add_argument("--episodes", type=int, default=20)
    parser.add_argument("--group", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sigma-error", type=float, nargs="*", default=[0.01, 0.05, 0.2],
                        help="relative errors put into one sigma, each judged as a run of its own")
    parser.add_argument("--stream", choices=("video", "action"), default="action",
                        help="whose schedule the error goes into (the actions follow the action stream's directly)")
    args = parser.parse_args()
    run = RunFolder(args.run)
    seeds = range(args.episodes)
    rows = {"as exported": verdicts(episodes(run, args.recipe, args.set, seeds, args.device), args.group)}
    with tempfile.TemporaryDirectory() as tmp:
        for error in args.sigma_error:
            broken = perturbed(run, Path(tmp) / f"perturbed-{error}", args.stream, error)
            rows[f"one {args.stream} sigma {error:.0%} off"] = verdicts(episodes(broken, args.recipe, args.set, seeds,
                                                                         args.device), args.group)
    keys = list(next(iter(rows.values())))
    print("failures under each rule, out of the episodes (or groups) judged")
    print(" | ".join(["run"] + keys))
    for name, counts in rows.items():
        print(" | ".join([name] + [str(counts[k]) for k in keys]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
