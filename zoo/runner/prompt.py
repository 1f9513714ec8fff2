"""Prompt embedding files: what ``python -m zoo prompt RUN_DIR "text" [-o FILE]`` writes and the runner loads.

The UMT5-XXL text encoder (5.68 B parameters, 11.4 GB in bf16) runs once per prompt, eagerly, on a
workstation; the robot gets its output only (a [1, L, 4096] bf16 context: 4 MB at LingBot-VA's 512 tokens,
1 MB at Fast-WAM's 128). The file is safetensors (no pickle): the tensors the policy feeds its DiT, plus
metadata naming the task text and the policy type it was computed for, which the runner checks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from zoo.core import atomic
from zoo.core.errors import RunnerError

FORMAT = "zoo-prompt-1"


class PromptEmbedding:
    """One prompt's embeddings: ``task`` (as the batch's ``task`` holds it), the tensors by name."""

    def __init__(self, task: str, policy_type: str, tensors: Dict[str, torch.Tensor], text: str = ""):
        self.task = task
        self.policy_type = policy_type
        self.tensors = dict(tensors)
        self.text = text or task  # what the text encoder saw (a policy may wrap the task in a template)

    def save(self, path: Path) -> Path:
        meta = {"format": FORMAT, "task": self.task, "text": self.text, "policy_type": self.policy_type}
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic.atomic_path(path) as tmp:
            save_file({k: v.detach().contiguous().cpu() for k, v in self.tensors.items()}, str(tmp),
                      metadata={"zoo": json.dumps(meta)})
        return path

    @classmethod
    def load(cls, path: Path) -> "PromptEmbedding":
        path = Path(path)
        if not path.is_file():
            raise RunnerError(f"prompt embedding file {path} does not exist",
                              'compute it with: python -m zoo prompt RUN_DIR "task text" [-o FILE]')
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = json.loads((f.metadata() or {}).get("zoo", "{}"))
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as exc:  # safetensors raises its own error types for a damaged header
            raise RunnerError(f"{path} is not a zoo prompt embedding file: {exc}",
                              'compute it again with: python -m zoo prompt RUN_DIR "task text" [-o FILE]') from None
        if meta.get("format") != FORMAT:
            raise RunnerError(f"{path} is not a zoo prompt embedding file (format {meta.get('format')!r})",
                              'compute it with: python -m zoo prompt RUN_DIR "task text" [-o FILE]')
        return cls(meta["task"], meta["policy_type"], tensors, meta.get("text", ""))
