"""The deploy side: a policy's host loop around the artifact's methods, with LeRobot's policy interface.

    runner = zoo.runner.load("runs/fast-wam-tiny")          # or a published repo id; backend="artifact" on a GPU
    runner.load_prompt("pick_bowl.prompt.safetensors")      # python -m zoo prompt RUN_DIR "pick up the bowl" -o ...
    action = runner.select_action(observation)              # LeRobot's observation dict in, an action out

Imports torch, safetensors and huggingface_hub only: no lerobot, transformers or diffusers.
"""

from __future__ import annotations

from .base import PolicyRunner, load
from .errors import RunnerError
from .prompt import PromptEmbedding

__all__ = ["PolicyRunner", "PromptEmbedding", "RunnerError", "load"]
