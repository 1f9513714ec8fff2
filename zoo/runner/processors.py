"""LeRobot's policy pre/post-processor pipelines, read from the checkpoint's own files, without lerobot.

A LeRobot checkpoint ships ``policy_preprocessor.json`` / ``policy_postprocessor.json`` (the pipeline: step
registry names and configs) and one ``*.safetensors`` per stateful step (normalisation statistics, flat
``"<feature>.<stat>"`` keys). The export copies them into the run folder's ``processors/``. This module runs
the steps LeRobot 0.6.1 writes for the zoo families, with LeRobot's arithmetic (lerobot/processor/
normalize_processor.py ``_NormalizationMixin._apply_transform``, batch_processor.py, device_processor.py,
rename_processor.py, policies/fastwam/processor_fastwam.py). A step it does not know is refused by name:
silently skipping one would hand the robot actions in the wrong units.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
from safetensors.torch import load_file

from zoo.core.errors import RunnerError
from zoo.contract.run_folder import RunFolder

OBS_PREFIX = "observation."
OBS_STATE = "observation.state"
OBS_ENV_STATE = "observation.environment_state"
OBS_IMAGE = "observation.image"
OBS_IMAGES_PREFIX = "observation.images."
ACTION = "action"

Batch = Dict[str, Any]


# --- normalisation (LeRobot's _NormalizationMixin) ------------------------------------------------------------


class _Normalization:
    """Statistics and modes of one normalizer/unnormalizer step, applied as LeRobot applies them."""

    def __init__(self, config: Dict[str, Any], stats: Dict[str, torch.Tensor], inverse: bool):
        self.eps = float(config.get("eps", 1e-8))
        self.features = {k: (v["type"], tuple(v["shape"])) for k, v in (config.get("features") or {}).items()}
        self.norm_map = dict(config.get("norm_map") or {})
        keys = config.get("normalize_observation_keys")
        self.observation_keys = None if keys is None else set(keys)
        self.inverse = inverse
        self.stats: Dict[str, Dict[str, torch.Tensor]] = {}
        for flat, tensor in stats.items():
            key, stat = flat.rsplit(".", 1)
            # LeRobot loads every statistic as float32 (load_state_dict) ...
            self.stats.setdefault(key, {})[stat] = tensor.to(torch.float32)
        for key, (kind, _) in self.features.items():
            if kind == "VISUAL" and key in self.stats:  # ... and gives flat visual stats a (C, 1, 1) shape
                self.stats[key] = {s: (t.reshape(-1, 1, 1) if t.ndim == 1 else t) for s, t in self.stats[key].items()}
        unknown = sorted({m for m in self.norm_map.values()} - set(_MODES))
        if unknown:
            raise RunnerError(f"normalisation mode(s) {unknown} are not known to zoo.runner",
                              f"known modes: {', '.join(_MODES)}; this checkpoint needs a newer zoo")

    def transform(self, tensor: torch.Tensor, key: str, kind: str) -> torch.Tensor:
        mode = self.norm_map.get(kind, "IDENTITY")
        if mode == "IDENTITY" or key not in self.stats:
            return tensor
        # LeRobot moves the statistics to the input's device and dtype before the arithmetic.
        stats = {name: t.to(device=tensor.device, dtype=tensor.dtype) for name, t in self.stats[key].items()}
        return _MODES[mode](self, tensor, stats, key)

    def observation(self, batch: Batch) -> Batch:
        out = dict(batch)
        for key, (kind, _) in self.features.items():
            if self.observation_keys is not None and key not in self.observation_keys:
                continue
            if kind != "ACTION" and key in out:
                out[key] = self.transform(torch.as_tensor(out[key]), key, kind)
        return out


def _need(stats: Dict[str, torch.Tensor], names, mode: str, key: str) -> List[torch.Tensor]:
    missing = [n for n in names if n not in stats]
    if missing:
        raise RunnerError(f"{mode} normalisation of {key!r} needs statistics {missing}, which the processor file "
                          "does not hold", "the checkpoint's processors are incomplete; re-export from a checkpoint "
                          "with its dataset statistics")
    return [stats[n] for n in names]


def _mean_std(norm: _Normalization, x, stats, key):
    mean, std = _need(stats, ("mean", "std"), "MEAN_STD", key)
    if norm.inverse:
        return x * std + mean
    return (x - mean) / (std + norm.eps)


def _range(low_name: str, high_name: str, mode: str):
    def apply(norm: _Normalization, x, stats, key):
        low, high = _need(stats, (low_name, high_name), mode, key)
        denom = high - low
        denom = torch.where(denom == 0, torch.tensor(norm.eps, device=x.device, dtype=x.dtype), denom)
        if mode == "MIN_MAX":
            return (x + 1) / 2 * denom + low if norm.inverse else 2 * (x - low) / denom - 1
        return (x + 1.0) * denom / 2.0 + low if norm.inverse else 2.0 * (x - low) / denom - 1.0

    return apply


_MODES: Dict[str, Callable] = {
    "IDENTITY": lambda norm, x, stats, key: x,
    "MEAN_STD": _mean_std,
    "MIN_MAX": _range("min", "max", "MIN_MAX"),
    "QUANTILES": _range("q01", "q99", "QUANTILES"),
    "QUANTILE10": _range("q10", "q90", "QUANTILE10"),
}


# --- the steps ------------------------------------------------------------------------------------------------


class Step:
    """One processor step over a batch dict (observation keys, ``action``, ``task``, ...)."""

    def __call__(self, batch: Batch) -> Batch:
        raise NotImplementedError


class Rename(Step):
    def __init__(self, config, stats, device):
        self.rename_map = dict(config.get("rename_map") or {})

    def __call__(self, batch):
        return {(self.rename_map.get(k, k) if k.startswith(OBS_PREFIX) else k): v for k, v in batch.items()}


class ToBatch(Step):
    """Unbatched observations get a leading batch dim; a task string becomes a one-element list."""

    def __init__(self, config, stats, device):
        pass

    def __call__(self, batch):
        out = dict(batch)
        for key, value in batch.items():
            if not isinstance(value, torch.Tensor):
                continue
            if key in (OBS_STATE, OBS_ENV_STATE, ACTION) and value.dim() == 1:
                out[key] = value.unsqueeze(0)
            elif (key == OBS_IMAGE or key.startswith(OBS_IMAGES_PREFIX)) and value.dim() == 3:
                out[key] = value.unsqueeze(0)
        for key in ("index", "task_index"):
            if isinstance(out.get(key), torch.Tensor) and out[key].dim() == 0:
                out[key] = out[key].unsqueeze(0)
        if isinstance(out.get("task"), str):
            out["task"] = [out["task"]]
        return out


class ToDevice(Step):
    """Tensors to the runner's device (the file's device is where the checkpoint was trained), floats cast."""

    _DTYPES = {"float16": torch.float16, "float32": torch.float32, "float64": torch.float64,
               "bfloat16": torch.bfloat16}

    def __init__(self, config, stats, device):
        self.device = torch.device(device)
        name = config.get("float_dtype")
        if name is not None and name not in self._DTYPES:
            raise RunnerError(f"device_processor float_dtype {name!r} is not known", f"known: {list(self._DTYPES)}")
        self.dtype = self._DTYPES.get(name) if name else None

    def __call__(self, batch):
        out = {}
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                value = value.to(self.device)
                if self.dtype is not None and value.is_floating_point():
                    value = value.to(self.dtype)
            out[key] = value
        return out


class Normalize(Step):
    inverse = False

    def __init__(self, config, stats, device):
        self.norm = _Normalization(config, stats, inverse=self.inverse)

    def __call__(self, batch):
        out = self.norm.observation(batch)
        if isinstance(out.get(ACTION), torch.Tensor):
            out[ACTION] = self.norm.transform(out[ACTION], ACTION, "ACTION")
        return out


class Unnormalize(Normalize):
    inverse = True


class FastWAMActionToggle(Step):
    """lerobot/policies/fastwam/processor_fastwam.py: LIBERO gripper toggle on the named action dims."""

    def __init__(self, config, stats, device):
        self.dims = [int(d) for d in config.get("toggle_dimensions") or []]

    def __call__(self, batch):
        action = batch.get(ACTION)
        if not self.dims or not isinstance(action, torch.Tensor):
            return batch
        action = action.clone()
        size = int(action.shape[-1])
        for dim in self.dims:
            resolved = dim if dim >= 0 else size + dim
            if not 0 <= resolved < size:
                raise RunnerError(f"action toggle dimension {dim} is out of bounds for action dim {size}",
                                  "the checkpoint's postprocessor does not fit its action size")
            value = action[..., resolved] * 2.0 - 1.0
            action[..., resolved] = torch.sign(-value)
        return {**batch, ACTION: action}


STEPS: Dict[str, Callable[..., Step]] = {
    "rename_observations_processor": Rename,
    "to_batch_processor": ToBatch,
    "device_processor": ToDevice,
    "normalizer_processor": Normalize,
    "unnormalizer_processor": Unnormalize,
    "fastwam_action_toggle_processor": FastWAMActionToggle,
}


# lerobot/processor/converters.py ``_COMPLEMENTARY_KEYS``: the keys besides observation.* and action that a
# policy preprocessor carries through (batch_to_transition keeps these and *_is_pad keys, and drops the rest).
COMPLEMENTARY_KEYS = ("task", "index", "task_index", "episode_index", "timestamp", "language_persistent",
                      "language_events", "messages", "message_streams", "target_message_indices")


def transition_keys(batch: Batch) -> Batch:
    """What survives LeRobot's ``batch_to_transition`` / ``transition_to_batch`` round trip around a policy
    preprocessor: observation.* keys, the action, the complementary keys and padding flags. Anything else
    (a per-call option such as ``seed``, a precomputed ``context``) is dropped, as LeRobot drops it; pass it with
    ``processors=False`` and apply ``runner.preprocessor`` yourself, as in LeRobot's own loop."""
    return {k: v for k, v in batch.items()
            if k.startswith(OBS_PREFIX) or k == ACTION or k in COMPLEMENTARY_KEYS or "_is_pad" in k}


class Pipeline:
    """A processor pipeline file, loaded; ``pipeline(batch)`` runs its steps in order. A preprocessor
    (``batches=True``) first keeps only the keys LeRobot's pipeline carries (``transition_keys``)."""

    def __init__(self, steps: List[Step], names: List[str], path: Optional[Path] = None, batches: bool = False):
        self.steps = steps
        self.names = names
        self.path = path
        self.batches = batches

    def __call__(self, batch: Batch) -> Batch:
        if self.batches:
            batch = transition_keys(batch)
        for step in self.steps:
            batch = step(batch)
        return batch

    def action(self, action: torch.Tensor) -> torch.Tensor:
        """A postprocessor on an action tensor, as LeRobot's ``postprocessor(action)``."""
        return self({ACTION: action})[ACTION]


def load_pipeline(path: Path, device: str, batches: bool = False) -> Pipeline:
    """Read one pipeline file (and its steps' state files beside it); ``batches``: a preprocessor, which takes
    observation batches (see ``Pipeline``)."""
    path = Path(path)
    if not path.is_file():
        raise RunnerError(f"{path} is missing", "the run folder's processors/ must hold the checkpoint's "
                                                "policy_preprocessor.json and policy_postprocessor.json")
    try:
        spec = json.loads(path.read_text())
    except ValueError as exc:
        raise RunnerError(f"{path} is not valid JSON: {exc}", "export the recipe again") from None
    steps, names = [], []
    for entry in spec.get("steps", []):
        name = entry.get("registry_name")
        if name not in STEPS:
            raise RunnerError(f"{path.name}: processor step {name!r} is not one zoo.runner can apply",
                              f"known steps: {', '.join(STEPS)}; run this policy with LeRobot, or teach "
                              "zoo/runner/processors.py the step")
        stats: Dict[str, torch.Tensor] = {}
        if entry.get("state_file"):
            state = path.parent / entry["state_file"]
            if not state.is_file():
                raise RunnerError(f"{path.name}: step {name!r} needs {state.name}, which is missing",
                                  "copy the checkpoint's processor .safetensors files into processors/")
            stats = load_file(str(state))
        steps.append(STEPS[name](entry.get("config") or {}, stats, device))
        names.append(name)
    return Pipeline(steps, names, path, batches=batches)


def load_processors(run: RunFolder, device: str):
    """``(preprocessor, postprocessor)`` from a run folder's ``processors/``."""
    return load_pipeline(run.preprocessor_file, device, batches=True), load_pipeline(run.postprocessor_file, device)
