"""Observations for the runner: the safetensors file ``python -m zoo act`` reads (LeRobot's batch keys, the task
text in its metadata) and the seeded synthetic sequence the policy check drives both the runner and LeRobot's
policy with (docs/host-loops.md, "Observations").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Mapping, Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from zoo.contract.host_settings import HostSettings, ObservationFeature
from zoo.core import atomic
from zoo.core.errors import RunnerError

FORMAT = "zoo-observation-1"
TASK = "task"

Batch = Dict[str, Any]


def observation_features(settings: HostSettings) -> Dict[str, ObservationFeature]:
    """What the policy reads (``{key: ObservationFeature(type, shape)}``, in key order), from host_settings."""
    # Only the LeRobot families' settings have the field: a language model or a synthetic unit reads no batch.
    features = getattr(settings, "observation_features", None)
    if not features:
        raise RunnerError(f"the run's host settings (family {settings.family!r}) name no observation_features (the "
                          "policy's input features)", "the policy check and synthetic observations need a LeRobot "
                                                       "policy's run (Fast-WAM, LingBot-VA)")
    return dict(sorted(features.items()))


def synthetic_observations(settings: HostSettings, count: int, seed: int, task: str) -> List[Batch]:
    """``count`` seeded observations shaped as the policy's input features (see the module's docstring)."""
    features = observation_features(settings)
    g = torch.Generator().manual_seed(int(seed))
    steps = []
    for _ in range(count):
        obs: Batch = {}
        for key, feature in features.items():
            shape = list(feature.shape)
            draw = torch.rand if feature.type == "VISUAL" else torch.randn
            obs[key] = draw(shape, generator=g, dtype=torch.float32)
        obs[TASK] = task
        steps.append(obs)
    return steps


def save_observation(batch: Mapping[str, Any], path: Union[str, Path]) -> Path:
    """Write one observation batch as an observation file (tensors by key, the task in the metadata)."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in batch.items() if isinstance(v, torch.Tensor)}
    task = batch.get(TASK)
    if isinstance(task, (list, tuple)):
        task = task[0] if task else None
    meta = {"format": FORMAT, TASK: task}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic.atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"zoo": json.dumps(meta)})
    return path


def load_observation(path: Union[str, Path]) -> Batch:
    """An observation file as LeRobot's batch dict (``task`` from the metadata, when the file has one)."""
    path = Path(path)
    if not path.is_file():
        raise RunnerError(f"observation file {path} does not exist",
                          "write one with `python -m zoo act RUN_DIR --example-observation FILE` and edit it, or "
                          "save your robot's observation with zoo.runner.observations.save_observation")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("zoo", "{}"))
            batch: Batch = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # safetensors raises its own error types for a damaged header
        raise RunnerError(f"{path} is not a safetensors observation file: {exc}",
                          "observation files are safetensors: LeRobot's batch keys, the task in the metadata") from None
    if meta.get("format") not in (None, FORMAT):
        raise RunnerError(f"{path} has format {meta.get('format')!r}, not {FORMAT!r}", "write it with this zoo")
    if meta.get(TASK) is not None:
        batch[TASK] = meta[TASK]
    return batch
