"""What a policy family hands the pipeline: an export unit with its methods and how to feed them.

A family module (``zoo/policies/<family>.py``) builds the unit from a pulled checkpoint. Everything the
later steps need to lower and verify *without* lerobot (input specs, dynamic dims, host settings) is plain
data here and is written to the run folder as JSON, so ``python -m zoo lower RUN_DIR`` works on a Jetson.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

Dim = Union[int, str]  # a static size, or the name of a recipe dynamic dim


@dataclass
class InputSpec:
    """One method input: name, dtype, shape, and how to draw fresh valid values for verification.

    ``sampler`` is one of:
      "normal"                 standard normal (floating dtypes)
      "uniform:LOW:HIGH"       uniform floats in [LOW, HIGH)
      "randint:LOW:HIGH"       integers in [LOW, HIGH)
      "randperm:N"             distinct integers drawn from range(N) (slot indices for index_copy_)
      "arange:START"           START, START+1, ... (positions)
      "bernoulli:P"            bool, True with probability P
      "ones"                   all ones / True
    """

    name: str
    dtype: str  # torch dtype name without "torch.", e.g. "float32", "int64", "bool"
    shape: List[Dim]
    sampler: str = "normal"

    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def concrete_shape(self, sizes: Dict[str, int]) -> List[int]:
        return [sizes[d] if isinstance(d, str) else int(d) for d in self.shape]

    def sample(self, generator: torch.Generator, sizes: Dict[str, int]) -> torch.Tensor:
        shape = self.concrete_shape(sizes)
        dtype = self.torch_dtype()
        kind, *args = self.sampler.split(":")
        if kind == "normal":
            return torch.randn(shape, generator=generator, dtype=torch.float32).to(dtype)
        if kind == "uniform":
            low, high = float(args[0]), float(args[1])
            return (torch.rand(shape, generator=generator, dtype=torch.float64) * (high - low) + low).to(dtype)
        if kind == "randint":
            return torch.randint(int(args[0]), int(args[1]), shape, generator=generator).to(dtype)
        if kind == "randperm":
            numel = int(torch.Size(shape).numel())
            return torch.randperm(int(args[0]), generator=generator)[:numel].reshape(shape).to(dtype)
        if kind == "arange":
            numel = int(torch.Size(shape).numel())
            return (torch.arange(numel) + int(args[0])).reshape(shape).to(dtype)
        if kind == "bernoulli":
            return torch.rand(shape, generator=generator) < float(args[0])
        if kind == "ones":
            return torch.ones(shape, dtype=dtype)
        raise ValueError(f"input {self.name!r}: unknown sampler {self.sampler!r}")


@dataclass
class MethodSpec:
    """One method of the unit: the module to export and its inputs and outputs, in signature order."""

    name: str
    module: torch.nn.Module
    inputs: List[InputSpec]
    output_names: List[str]

    def example_inputs(self, sizes: Dict[str, int], seed: int = 0) -> Tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        return tuple(spec.sample(g, sizes) for spec in self.inputs)

    def dynamic_shapes(self, dims: Dict[str, torch.export.Dim]) -> Optional[Tuple[Dict[int, Any], ...]]:
        """``torch.export`` dynamic_shapes for this method, from the recipe's named dims."""
        per_input = tuple({i: dims[d] for i, d in enumerate(spec.shape) if isinstance(d, str)} for spec in self.inputs)
        return per_input if any(per_input) else None

    def io_spec(self) -> Dict[str, Any]:
        return {"inputs": [asdict(s) for s in self.inputs], "outputs": list(self.output_names)}


@dataclass
class ExportUnit:
    """The GPU part of a policy, cut out for export, plus what stays on the host."""

    family: str
    methods: Dict[str, MethodSpec]
    # Settings the deploy side needs to drive the artifact: steps, shifts, guidance, slot layout, ...
    host_settings: Dict[str, Any] = field(default_factory=dict)
    # Files from the checkpoint the deploy side needs besides the .pte (normalisation processors, configs).
    host_files: List[Path] = field(default_factory=list)
    # Optional: a function that runs the policy's own eager code for the unit's equivalence test.
    reference: Optional[Callable[..., Any]] = None

    def io_spec(self) -> Dict[str, Any]:
        return {name: m.io_spec() for name, m in self.methods.items()}


def feature_record(features: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """A LeRobot config's ``input_features`` (``{key: PolicyFeature(type, shape)}``) as plain data for
    host_settings.json: what observation keys the policy reads, of which kind (VISUAL, STATE, ...) and shape."""
    return {key: {"type": str(getattr(feature.type, "value", feature.type)), "shape": [int(s) for s in feature.shape]}
            for key, feature in sorted(features.items())}
