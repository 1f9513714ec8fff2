"""The closed-loop check: whole simulated episodes of a LeRobot environment, driven once by the zoo policy (the
run's artifact through ``zoo.runner``) and once by LeRobot's own policy built from the run's checkpoint, with the
same seeds, in LeRobot's own episode loop (``lerobot.scripts.lerobot_eval.rollout``) and processors.

Each episode is judged step by step: the action the environment was given (robot units) by its relative L2 against
LeRobot's, and the observed state. Any difference feeds back (the environment reacts to the action), so the
first step beyond the rule is where the trajectories part. Success flags are reported, not judged: a tiny recipe's
seeded random weights succeed by chance only.

    python -m lerobot_policy_zoo.closed_loop RUN_DIR --env.type=pusht --episodes 2 --steps 200 \
        --rename_map '{"observation.image": "observation.images.image"}'
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch

from lerobot_policy_zoo.configuration_zoo import BACKENDS
from zoo.core.report import format_table

FLOAT32_RULE = 1e-5  # relative L2 per step: the float32 rule of the policy check (ChunkTolerance.float32)


@dataclass
class EpisodeRow:
    episode: int
    seed: int
    steps: int
    worst_action_rel_l2: float
    first_step_beyond: Optional[int]  # None: every step within the rule
    worst_state_max_abs: float  # over every observation the policies acted on
    final_state_max_abs: float  # the last one (after it the vector env resets itself: that one is not compared)
    final_image_max_abs: float
    zoo_success: bool
    lerobot_success: bool
    state_travel: float  # how far LeRobot's episode moved the observed state (sum of |step|): 0 would prove little


@dataclass
class ClosedLoopResult:
    rows: List[EpisodeRow]
    backend: str
    env: str
    rule: float

    @property
    def ok(self) -> bool:
        return bool(self.rows) and all(r.first_step_beyond is None for r in self.rows)

    def table(self) -> str:
        rows = [["episode", "seed", "steps", "worst action rel L2", "first step beyond", "worst state max|diff|",
                 "final state max|diff|",
                 "final image max|diff|", "state travel", "success zoo / LeRobot"]]
        for r in self.rows:
            rows.append([r.episode, r.seed, r.steps, f"{r.worst_action_rel_l2:.3e}",
                         "none" if r.first_step_beyond is None else r.first_step_beyond,
                         f"{r.worst_state_max_abs:.3e}", f"{r.final_state_max_abs:.3e}",
                         f"{r.final_image_max_abs:.3e}", f"{r.state_travel:.1f}",
                         f"{r.zoo_success} / {r.lerobot_success}"])
        return (f"closed loop: zoo ({self.backend}) against LeRobot's own policy in {self.env}, rule: action rel L2 "
                f"<= {self.rule:.0e} at every step\n" + format_table(rows))


def step_rel_l2(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per step (rows of ``[steps, dim]``): ||got - want|| / ||want|| (the plain difference where ``want`` is 0)."""
    diff = (got.double() - want.double()).norm(dim=-1)
    scale = want.double().norm(dim=-1)
    return torch.where(scale > 0, diff / scale.clamp_min(1e-300), diff)


def judge_episode(index: int, seed: int, zoo_ep: Dict[str, Any], ref_ep: Dict[str, Any], rule: float) -> EpisodeRow:
    """One episode of each side (``rollout``'s dicts, batch of one) compared step by step."""
    steps = min(_length(zoo_ep), _length(ref_ep))
    got, want = zoo_ep["action"][0, :steps], ref_ep["action"][0, :steps]
    rel = step_rel_l2(got, want)
    beyond = [i for i, r in enumerate(rel.tolist()) if not r <= rule]  # NaN counts as beyond
    if _length(zoo_ep) != _length(ref_ep):  # one episode ended (success, termination) where the other did not
        beyond.append(steps)
    state_key = "observation.state"
    image_key = next((k for k in ref_ep["observation"] if "image" in k), None)
    # Observations 0 .. steps-1 are what the policies acted on; the one after the last step is the vector env's
    # automatic reset for the next episode (the same for both sides), so it proves nothing.
    mine_states, states = zoo_ep["observation"].get(state_key), ref_ep["observation"].get(state_key)
    worst = _max_abs(mine_states, states, slice(0, steps))
    state = _max_abs(mine_states, states, steps - 1)
    image = _max_abs(zoo_ep["observation"].get(image_key), ref_ep["observation"].get(image_key), steps - 1)
    travel = float((states[0, 1:steps] - states[0, :steps - 1]).abs().sum()) if states is not None else math.nan
    return EpisodeRow(index, seed, steps, float(rel.max()) if steps else math.nan, min(beyond) if beyond else None,
                      worst, state, image, _success(zoo_ep, steps), _success(ref_ep, steps), travel)


def _length(episode: Dict[str, Any]) -> int:
    done = episode["done"][0]
    return int(done.float().argmax()) + 1 if bool(done.any()) else int(done.numel())


def _success(episode: Dict[str, Any], steps: int) -> bool:
    return bool(episode["success"][0, :steps].any())


def _max_abs(a: Optional[torch.Tensor], b: Optional[torch.Tensor], index) -> float:
    if a is None or b is None:
        return math.nan
    return float((a[0, index].double() - b[0, index].double()).abs().max())


# --------------------------------------------------------------------------------------------------------
# The two policies and the episodes


def make_env(env_type: str, steps: int, options: Dict[str, Any]):
    """LeRobot's environment config (``--env.type``) with ``episode_length`` = ``steps``, and one environment."""
    from lerobot.envs.configs import EnvConfig
    from lerobot.envs.factory import make_env as lerobot_make_env

    try:
        env_cfg = EnvConfig.get_choice_class(env_type)(episode_length=int(steps), **options)
    except Exception as exc:  # draccus' registry or the dataclass refusing a field
        raise SystemExit(f"error: --env.type={env_type!r} with {options}: {exc}")
    envs = lerobot_make_env(env_cfg, n_envs=1)
    (suite,) = envs.values()
    (env,) = suite.values()
    return env_cfg, env


def zoo_side(run: str, backend: str, device: str, rename_map: Dict[str, str]):
    """The zoo policy and the run's processors, made as lerobot-eval makes them for ``--policy.type=zoo``."""
    from lerobot.policies.factory import make_pre_post_processors

    from lerobot_policy_zoo.configuration_zoo import ZooConfig
    from lerobot_policy_zoo.modeling_zoo import ZooPolicy

    config = ZooConfig(run=run, backend=backend, device=device)
    policy = ZooPolicy(config).eval()
    pre, post = make_pre_post_processors(config, pretrained_path=str(config.pretrained_path),
                                         preprocessor_overrides=_overrides(device, rename_map))
    return policy, pre, post


def lerobot_side(run: str, device: str, rename_map: Dict[str, str]):
    """LeRobot's own policy from the run's checkpoint (``strict`` loading, its own text encoder) with the checkpoint's
    processors, as lerobot-eval makes them for ``--policy.path=CHECKPOINT``."""
    from lerobot.policies.factory import make_pre_post_processors

    from zoo import policies
    from zoo.cli.deploy import run_recipe
    from zoo.core.progress import held_back
    from zoo.export.policy_check import checkpoint_in_reach
    from zoo.runner.loading import resolve

    recipe = run_recipe(resolve(run))
    with held_back(), checkpoint_in_reach(recipe) as checkpoint:
        family = policies.load_family(recipe.family)
        policy, _, _ = family.lerobot_policy(checkpoint, recipe, device=device)
        pre, post = make_pre_post_processors(policy.config, pretrained_path=str(checkpoint),
                                             preprocessor_overrides=_overrides(device, rename_map))
    return policy.eval(), pre, post


def _overrides(device: str, rename_map: Dict[str, str]) -> Dict[str, Any]:
    return {"device_processor": {"device": device}, "rename_observations_processor": {"rename_map": rename_map}}


def episode(env, env_cfg, side, seed: int) -> Dict[str, Any]:
    """One whole episode in LeRobot's own loop, from ``torch.manual_seed(seed)`` and ``env.reset(seed=seed)``."""
    from lerobot.envs.factory import make_env_pre_post_processors
    from lerobot.scripts.lerobot_eval import rollout

    policy, pre, post = side
    env_pre, env_post = make_env_pre_post_processors(env_cfg=env_cfg, policy_cfg=policy.config)
    torch.manual_seed(seed)
    with torch.no_grad():
        return rollout(env, policy, env_pre, env_post, pre, post, seeds=[seed], return_observations=True)


def closed_loop_check(run: str, env_type: str = "pusht", *, episodes: int = 2, steps: int = 200, seed: int = 1000,
                      backend: str = "eager", device: str = "cpu", rename_map: Optional[Dict[str, str]] = None,
                      env_options: Optional[Dict[str, Any]] = None, rule: float = FLOAT32_RULE) -> ClosedLoopResult:
    """``episodes`` episodes of ``steps`` environment steps each (seeds ``seed``, ``seed + 1``, ...), each run once
    per side, the LeRobot episode first; judged step by step (``judge_episode``)."""
    rename_map = dict(rename_map or {})
    env_cfg, env = make_env(env_type, steps, dict(env_options or {}))
    try:
        reference = lerobot_side(run, device, rename_map)
        mine = zoo_side(run, backend, device, rename_map)
        rows = []
        for index in range(episodes):
            ref_ep = episode(env, env_cfg, reference, seed + index)
            zoo_ep = episode(env, env_cfg, mine, seed + index)
            rows.append(judge_episode(index, seed + index, zoo_ep, ref_ep, rule))
    finally:
        env.close()
    return ClosedLoopResult(rows, backend=backend, env=env_type, rule=rule)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lerobot_policy_zoo.closed_loop", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="exit 0: every step within the rule; 3: the trajectories part (the table says "
                                       "where); 2: bad input")
    p.add_argument("run", help="run folder of `python -m zoo.export`, or a published artifact's repo id")
    p.add_argument("--env.type", dest="env_type", default="pusht", help="LeRobot environment type (default pusht)")
    p.add_argument("--env", dest="env_options", default="{}", help="JSON of further LeRobot env config fields")
    p.add_argument("--episodes", type=int, default=2)
    p.add_argument("--steps", type=int, default=200, help="environment steps per episode (env episode_length)")
    p.add_argument("--seed", type=int, default=1000, help="first episode's seed (lerobot-eval's default)")
    p.add_argument("--backend", default="eager", choices=BACKENDS)
    p.add_argument("--device", default="cpu")
    p.add_argument("--rename_map", default="{}", help="JSON, as lerobot-eval's --rename_map")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    try:
        rename_map, options = json.loads(args.rename_map), json.loads(args.env_options)
    except ValueError as exc:
        print(f"error: --rename_map / --env must be JSON objects: {exc}", file=sys.stderr)
        return 2
    result = closed_loop_check(args.run, args.env_type, episodes=args.episodes, steps=args.steps, seed=args.seed,
                               backend=args.backend, device=args.device, rename_map=rename_map, env_options=options)
    print(result.table())
    print("success rates of a tiny recipe's seeded random weights mean nothing; the trajectories are what is compared")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"passed": result.ok, "rows": [asdict(r) for r in result.rows]}, fh, indent=1)
    return 0 if result.ok else 3


if __name__ == "__main__":
    sys.exit(main())
