"""New tasks embedded on demand: the checkpoint's own text encoder, run eagerly on the CPU through the family's
``embed_prompt`` (what ``python -m zoo prompt`` runs), for a task the run has no prompt file for.

The runner keeps the result in the run's ``prompts/``, so a task costs one embedding ever. The encoder comes with
LeRobot's policy, built once per process from the run's checkpoint (zoo's fabricated cache for a tiny recipe, the
user's Hub cache otherwise) and kept for the next new task.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Optional

from zoo.contract.run_folder import RunFolder
from zoo.core.errors import RunnerError, ZooError
from zoo.runner.prompt import PromptEmbedding


class TaskEmbedder:
    """``embedder(task) -> PromptEmbedding`` for one run (``zoo.runner.load(..., embedder=...)``)."""

    def __init__(self, run: RunFolder):
        self.run = run
        self._family: Optional[Any] = None
        self._policy: Optional[Any] = None

    def __call__(self, task: str) -> PromptEmbedding:
        family, policy = self._encoder(task)
        return family.embed_prompt(policy, task)

    def _encoder(self, task: str):
        if self._policy is not None:
            return self._family, self._policy
        command = f'python -m zoo prompt {self.run.path} "{task}"'
        if importlib.util.find_spec("lerobot") is None or importlib.util.find_spec("transformers") is None:
            raise RunnerError(f"task {task!r} has no prompt embedding in {self.run.prompts_dir}, and the policy's text "
                              "encoder (lerobot, transformers) is not installed here",
                              f"embed it once where they are: {command}, and copy the file into prompts/")
        from zoo.cli.deploy import run_recipe, text_encoder
        from zoo.core.progress import held_back

        try:
            recipe = run_recipe(self.run)
            # LeRobot, transformers and diffusers print as they load: held back, shown only if it fails.
            with held_back():
                family, policy = text_encoder(recipe)
        except (ZooError, OSError) as exc:  # the checkpoint (or its text encoder) out of reach here
            message = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
            raise RunnerError(f"task {task!r} has no prompt embedding in {self.run.prompts_dir}, and the "
                              f"checkpoint's text encoder cannot be loaded here: {message}",
                              f"embed it once where the checkpoint is in reach: {command}") from None
        self._family, self._policy = family, policy
        return family, policy
