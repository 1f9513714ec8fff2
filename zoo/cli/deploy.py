"""Command lines of the deploy half: ``python -m zoo prompt RUN_DIR TASK`` (the task's UMT5 embedding, made once
with the policy's own text encoder, into RUN_DIR/prompts/) and ``python -m zoo act RUN_DIR --observation FILE``
(one action chunk for one observation, in robot units, on the eager, artifact or executorch backend). RUN_DIR is
a run folder or a published artifact (README, "Run a policy from its artifact").
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Sequence

import torch
from omegaconf import OmegaConf

from zoo.cli import common as cli
from zoo import policies
from zoo.core.errors import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, RunnerError, ZooError
from zoo.export.publish.manifest import read_manifest
from zoo.export.policy_check import checkpoint_in_reach, not_applicable
from zoo.core.progress import held_back, say
from zoo.contract.recipes import PolicyCheck, load_recipe
from zoo.core.report import format_table
from zoo.contract.run_folder import RunFolder
from zoo.runner import BACKENDS
from zoo.runner import load as load_runner
from zoo.runner.loading import resolve
from zoo.runner.observations import load_observation, save_observation, synthetic_observations


# --------------------------------------------------------------------------------------------------------
# python -m zoo prompt


def prompt_parser() -> argparse.ArgumentParser:
    p = cli.parser("python -m zoo prompt",
                   "Embed a task text once with the policy's own UMT5 text encoder (eager, needs lerobot) into a "
                   "prompt file the policy runner loads.",
                   [EXIT_OK, EXIT_ERROR, EXIT_INTERRUPTED],
                   {EXIT_OK: "the prompt file is written (atomically: an interrupted run leaves none)",
                    EXIT_ERROR: "no run folder or recipe there, a family without a runner, no lerobot, the "
                                "checkpoint out of reach, or the file cannot be written: the message says which"})
    p.add_argument("run_dir", help="run folder of `python -m zoo.export`, or a downloaded published artifact")
    p.add_argument("text", help="the task text, exactly as the observation batch's `task` will hold it")
    p.add_argument("-o", "--output", default=None,
                   help="prompt file to write (default: RUN_DIR/prompts/<task>-<hash>.safetensors, which the runner "
                        "loads by itself)")
    return p


def prompt_main(argv: Optional[Sequence[str]] = None) -> int:
    args = prompt_parser().parse_args(argv)
    run = RunFolder(Path(args.run_dir).expanduser())
    recipe = run_recipe(run)
    reason = not_applicable(recipe)
    if reason:
        raise RunnerError(f"{run.path}: {reason}", "prompt files are for the policies zoo.runner drives")
    if importlib.util.find_spec("lerobot") is None:
        raise ZooError("`python -m zoo prompt` runs the policy's own text encoder (UMT5), which needs lerobot",
                       "run it on a workstation with the policies extra (pip install 'zoo[policies]'); the robot "
                       "needs only the prompt file it writes")
    out = Path(args.output).expanduser() if args.output else run.prompt_file(args.text)
    start = time.perf_counter()
    say(f"embedding {args.text!r} with {recipe.family}'s own text encoder (eager, CPU) ...")
    # LeRobot, transformers and diffusers print as they load (shard writers, progress bars, deprecations): held
    # back, and shown only if the embedding fails.
    with held_back():
        family, policy = text_encoder(recipe)
        embedding = family.embed_prompt(policy, args.text)
    embedding.save(out)
    shapes = ", ".join(f"{k} {list(v.shape)} {str(v.dtype).replace('torch.', '')}"
                       for k, v in embedding.tensors.items())
    print(f"wrote {out} ({shapes}) in {time.perf_counter() - start:.1f} s")
    return 0


def text_encoder(recipe):
    """(family, LeRobot's policy) from the recipe's checkpoint, on the CPU: the family's ``embed_prompt`` runs the
    policy's own text encoder. The checkpoint and the repos the policy loads by Hub id are in reach only while it
    is built (``checkpoint_in_reach``)."""
    with checkpoint_in_reach(recipe) as checkpoint:
        family = policies.load_family(recipe.family)
        policy, _, _ = family.lerobot_policy(checkpoint, recipe, device="cpu")
    return family, policy


def run_recipe(run: RunFolder):
    """The run's resolved recipe: recipe.yaml of a run folder, or the recipe a published folder's manifest holds."""
    if run.recipe_file.is_file():
        return run.load_recipe()
    if run.manifest_file.is_file():
        recipe = read_manifest(run).get("recipe")
        if isinstance(recipe, dict):
            with tempfile.TemporaryDirectory(prefix="zoo-recipe-") as tmp:
                path = Path(tmp) / f"{recipe.get('name', 'recipe')}.yaml"
                path.write_text(OmegaConf.to_yaml(OmegaConf.create(recipe)))
                return load_recipe(str(path), check_name=False)
    raise RunnerError(f"{run.path} holds neither recipe.yaml nor a manifest.json naming its recipe",
                      "pass the run folder `python -m zoo.export` wrote, or a whole published artifact folder")


# --------------------------------------------------------------------------------------------------------
# python -m zoo act


def act_parser() -> argparse.ArgumentParser:
    p = cli.parser("python -m zoo act", "Print one action chunk for one observation, through zoo.runner.",
                   [EXIT_OK, EXIT_ERROR, EXIT_INTERRUPTED],
                   {EXIT_OK: "the action chunk is printed (or --example-observation's file written)",
                    EXIT_ERROR: "a missing or damaged run folder, observation or prompt file, or what the runner "
                                "refuses to drive (the message says why)"})
    p.add_argument("run", help="run folder, downloaded published folder, or published Hub repo id (ORG/NAME)")
    p.add_argument("--observation", default=None,
                   help="observation file: safetensors with LeRobot's batch keys, the task in its metadata")
    p.add_argument("--prompt", action="append", default=[],
                   help="prompt file from `python -m zoo prompt` (repeatable; RUN_DIR/prompts/ is loaded anyway)")
    p.add_argument("--backend", choices=BACKENDS, default="eager",
                   help="eager: the rewritten programs (CPU or GPU); artifact: the shipped .so files (GPU); "
                        "executorch: model.pte on ExecuTorch's C++ runtime ($ZOO_ET_RUNNER)")
    p.add_argument("--device", default=None, help="default: cpu for eager, cuda for artifact")
    p.add_argument("--json", action="store_true", help="print the chunk as JSON ([steps][action dims])")
    p.add_argument("--example-observation", metavar="OUT", default=None,
                   help="write a seeded synthetic observation file for this run (the format --observation reads) "
                        "and exit")
    p.add_argument("--task", default=PolicyCheck().task, help="the task text --example-observation writes")
    p.add_argument("--seed", type=int, default=0, help="the seed --example-observation draws with")
    return p


def act_main(argv: Optional[Sequence[str]] = None) -> int:
    args = act_parser().parse_args(argv)
    if args.example_observation:
        run = resolve(args.run)
        (obs,) = synthetic_observations(run.read_host_settings(), 1, args.seed, args.task)
        path = save_observation(obs, Path(args.example_observation).expanduser())
        print(f"wrote {path}: " + ", ".join(f"{k} {list(v.shape)}" for k, v in obs.items()
                                           if isinstance(v, torch.Tensor)) + f"; task {args.task!r}")
        return 0
    if not args.observation:
        raise RunnerError("no observation given", "pass --observation FILE (or write an example with "
                                                  "--example-observation FILE)")
    batch = load_observation(Path(args.observation).expanduser())
    say(f"loading the policy runner for {args.run} ({args.backend} backend) ...")
    with held_back():  # torch's warnings while loading the programs: shown only if the command fails
        runner = load_runner(args.run, backend=args.backend, device=args.device)
        try:
            for path in args.prompt:
                runner.load_prompt(Path(path).expanduser())
            say("predicting one action chunk ...")
            start = time.perf_counter()
            chunk = runner.predict_action_chunk(batch).detach().to("cpu", torch.float32)
            seconds = time.perf_counter() - start
        finally:
            runner.close()
    actions = chunk[0] if chunk.ndim == 3 else chunk
    if args.json:
        print(json.dumps(actions.tolist()))
        return 0
    print(f"action chunk {list(chunk.shape)} from {runner.run.path} ({args.backend}, {runner.device}) in "
          f"{seconds:.2f} s; robot units (the run's postprocessor applied)")
    print(chunk_table(actions))
    return 0


def chunk_table(actions: torch.Tensor) -> str:
    rows: List[List[str]] = [["step"] + [f"a{i}" for i in range(actions.shape[-1])]]
    rows += [[str(step)] + [f"{float(v):+.4f}" for v in row] for step, row in enumerate(actions)]
    return format_table(rows)
