"""``python -m lerobot_policy_zoo.policy_folder RUN OUT``: a LeRobot policy folder for a zoo run, so that every
LeRobot tool that names a policy by ``--policy.path=OUT`` (``lerobot-eval``, ``lerobot-rollout``, the async policy
server's ``pretrained_name_or_path``) drives the run's artifact.

A ``--policy.path`` folder is what LeRobot's ``save_pretrained`` writes for a policy and its processors: the
policy config's ``config.json`` (with its ``type``) and the processor pipelines' files, all at the folder's top.
LeRobot reads ``config.json`` (``PreTrainedConfig.from_pretrained``), builds the policy class its ``type`` names
(``ZooPolicy.from_pretrained``) and loads the processors from the same folder (``make_pre_post_processors``). So
the folder holds a ``ZooConfig``'s ``config.json``, written by LeRobot's own ``_save_pretrained``, naming the run
(an absolute path, or a published repo id as given), the backend, the device and the run's input and output
features (LeRobot checks an environment's or dataset's features against them), and a copy of the run's
``processors/``. No weights: the artifact keeps them, and the run stays where it is.

The folder is built beside OUT and renamed into place (``zoo.core.atomic.atomic_folder``): a failure leaves OUT
as it was. A non-empty OUT is replaced only with ``--force``, and a zoo run folder never.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Optional, Sequence, Tuple

from huggingface_hub.constants import CONFIG_NAME  # "config.json": what PreTrainedConfig.from_pretrained reads

from lerobot_policy_zoo.configuration_zoo import BACKENDS, ZooConfig, ZooConfigError, _resolve
from zoo.cli.common import EXIT_ERROR, EXIT_OK, guarded, parser
from zoo.contract.run_folder import RunFolder
from zoo.core import atomic
from zoo.core.errors import ZooError

EXPORT_AGAIN = ("export the run again with this zoo (`python -m zoo.export RECIPE`), or download the whole "
                "published folder")


def write_policy_folder(run: str, out: Path, *, backend: str = "eager", device: Optional[str] = None,
                        embed_prompts: bool = True, et_runner: Optional[str] = None, force: bool = False) -> Path:
    """Write the LeRobot policy folder of ``run`` (a run folder or a published repo id) to ``out``; its path.
    Everything is checked before ``out`` is touched; a ``ZooError`` says what is wrong and what to do."""
    source, reference = zoo_run(run)
    if et_runner:  # by its absolute path, as the run: the folder is used from other working directories
        et_runner = str(Path(et_runner).expanduser().resolve())
    config = folder_config(reference, backend=backend, device=device or default_device(backend),
                           embed_prompts=embed_prompts, et_runner=et_runner)
    out = Path(out).expanduser().resolve()
    check_target(out, source, force)
    with atomic.atomic_folder(out) as staged:
        copy_processors(source, staged)
        config._save_pretrained(staged)  # LeRobot's own writer: draccus's encoding, with the "type" key
        check_processors_load(staged, config, source.read_host_settings().policy_type)
    return out


def default_device(backend: str) -> str:
    """``eager`` runs on the CPU unless told otherwise; ``artifact`` and ``executorch`` run on a CUDA GPU."""
    return "cpu" if backend == "eager" else "cuda"


def zoo_run(run: str) -> Tuple[RunFolder, str]:
    """The run folder (downloaded where ``run`` is a repo id) and how config.json names it: a local folder by its
    absolute path, so the policy folder works from any working directory; a repo id as given."""
    local = Path(run).expanduser()
    source = _resolve(run)
    source.read_host_settings()  # a folder that is not a zoo run fails here, naming the file it lacks
    missing = [p.name for p in (source.preprocessor_file, source.postprocessor_file) if not p.is_file()]
    if missing:
        where = source.processors_dir
        what = "is missing" if not where.is_dir() else f"lacks {', '.join(missing)}"
        raise ZooError(f"{where} {what}: a LeRobot policy folder holds the run's processor pipelines",
                       EXPORT_AGAIN)
    return source, str(local.resolve()) if local.exists() else run


def folder_config(run: str, *, backend: str, device: str, embed_prompts: bool,
                  et_runner: Optional[str]) -> ZooConfig:
    """The ``ZooConfig`` the folder's config.json holds."""
    try:
        # Built for the CPU, which every machine has: LeRobot swaps a device this machine lacks for one it has,
        # and the folder is for the machine that will run it, which may have a GPU where this one has none.
        config = ZooConfig(run=run, backend=backend, device="cpu", embed_prompts=embed_prompts,
                           et_runner=et_runner)
        config.validate_features()
    except ZooConfigError as exc:
        raise ZooError(str(exc)) from None
    config.device = device
    # Whoever loads the folder points pretrained_path at it (lerobot-eval and lerobot-rollout set it to
    # --policy.path, ZooConfig.from_pretrained to the folder), so the folder can be moved.
    config.pretrained_path = None
    return config


def check_target(out: Path, source: RunFolder, force: bool) -> None:
    """Refuse an ``out`` that must not be replaced: a file, the run itself or a folder holding it, another zoo run,
    or (without ``force``) a folder with anything in it."""
    if out.exists() and not out.is_dir():
        raise ZooError(f"{out} is a file, not a folder", "name a new folder for the policy")
    run_path = source.path.resolve()
    if out == run_path or out in run_path.parents:
        raise ZooError(f"{out} holds the run {run_path}: writing the policy folder there would replace the run",
                       "name a folder outside the run, e.g. beside it")
    existing = RunFolder(out)
    if existing.is_run() or existing.host_settings_file.is_file():
        raise ZooError(f"{out} is a zoo run folder; a policy folder never replaces one", "name another folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ZooError(f"{out} exists and is not empty", "pass --force to replace it, or name another folder")


def copy_processors(source: RunFolder, staged: Path) -> None:
    """The run's processor files (and any tokenizer folder beside them), byte for byte, at the folder's top:
    LeRobot's ``save_pretrained`` wrote them into the checkpoint, and the export copied them into ``processors/``."""
    for entry in sorted(source.processors_dir.iterdir()):
        if entry.name == CONFIG_NAME:
            raise ZooError(f"{entry} would take the place of the policy's {CONFIG_NAME}", EXPORT_AGAIN)
        if entry.is_dir():
            shutil.copytree(entry, staged / entry.name)
        else:
            shutil.copy2(entry, staged / entry.name)


def check_processors_load(folder: Path, config: ZooConfig, policy_type: str) -> None:
    """Load the folder's processors as LeRobot will (its ``make_pre_post_processors``, the family's steps
    registered), so a damaged pipeline file is refused now rather than on the robot."""
    from lerobot.policies.factory import make_pre_post_processors

    from lerobot_policy_zoo.modeling_zoo import register_family_steps

    register_family_steps(policy_type)
    try:
        make_pre_post_processors(config, pretrained_path=str(folder),
                                 preprocessor_overrides={"device_processor": {"device": "cpu"}},
                                 postprocessor_overrides={"device_processor": {"device": "cpu"}})
    except Exception as exc:  # LeRobot raises many kinds for a pipeline it cannot build
        said = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ZooError(f"the run's processors do not load with LeRobot: {type(exc).__name__}: {said}",
                       EXPORT_AGAIN) from exc


def build_parser():
    cli = parser("python -m lerobot_policy_zoo.policy_folder",
                 "Write a LeRobot policy folder (config.json of type zoo and the run's processor files) for a zoo "
                 "run, for LeRobot's --policy.path.", (EXIT_OK, EXIT_ERROR))
    cli.add_argument("run", help="a run folder of `python -m zoo.export`, or a published artifact's repo id")
    cli.add_argument("out", type=Path, help="the policy folder to write")
    cli.add_argument("--backend", choices=BACKENDS, default="eager", help="zoo.runner's backend (default: eager)")
    cli.add_argument("--device", help="where the policy runs (default: cpu for eager, cuda otherwise); LeRobot's "
                                      "--policy.device overrides it when the folder is used")
    cli.add_argument("--et-runner", help="the zoo_runner binary for --backend executorch (else $ZOO_ET_RUNNER)")
    cli.add_argument("--no-embed-prompts", dest="embed_prompts", action="store_false",
                     help="refuse a task with no prompt file instead of embedding it with the checkpoint's encoder")
    cli.add_argument("--force", action="store_true", help="replace OUT when it is a non-empty folder")
    return cli


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)

    def write() -> int:
        out = write_policy_folder(args.run, args.out, backend=args.backend, device=args.device,
                                  embed_prompts=args.embed_prompts, et_runner=args.et_runner, force=args.force)
        written = json.loads((out / CONFIG_NAME).read_text())
        print(f"policy folder: {out}")
        print(f"  type {written['type']}, run {written['run']}, backend {written['backend']}, "
              f"device {written['device']}")
        print(f"  files: {', '.join(sorted(p.name for p in out.iterdir()))}")
        print(f"use it: lerobot-eval --policy.path={out} --env.type=... (or lerobot-rollout --policy.path={out} "
              "--robot.type=...)")
        return EXIT_OK

    return guarded(write)


if __name__ == "__main__":
    sys.exit(main())
