"""The deploy side: a policy's host loop around the artifact's methods, with LeRobot's policy interface.

    import zoo.runner
    runner = zoo.runner.load("runs/fast-wam-tiny")          # or a published repo id; backend="artifact" on a GPU
    runner.reset()
    action = runner.select_action(batch)                    # LeRobot's observation dict in, an action out

Prompt embeddings come from ``python -m zoo prompt RUN_DIR "task" [-o FILE]``: files in the run folder's
``prompts/`` are loaded with the runner, others with ``runner.load_prompt(FILE)``.

Imports torch, safetensors and huggingface_hub only: no lerobot, transformers or diffusers.
"""

from __future__ import annotations

from zoo.core.errors import RunnerError
from zoo.runner.base import PolicyRunner
from zoo.runner.loading import BACKENDS, load, runner_families
from zoo.runner.prompt import PromptEmbedding

__all__ = ["BACKENDS", "PolicyRunner", "PromptEmbedding", "RunnerError", "load", "runner_families"]
