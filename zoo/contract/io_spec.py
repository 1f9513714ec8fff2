"""``io_spec.json``: what every method of a run takes and returns, typed, so lowering, verification, bench and the
runner can feed the methods without the policy's code.

One shape: ``{"format": 1, "dtype", "methods": {name: {"inputs": [InputSpec], "outputs": [name]}},
"dynamic": {dim: {"min", "max"}}, "example_sizes": {dim: size}}``. ``IoSpec.from_json`` refuses any other
format, and any file missing a key or holding one of the wrong type, with a ``ContractError``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Union

import torch

from zoo.contract.typed_json import FORMAT_KEY, check_format, decode, encode

IO_SPEC_FORMAT = 1  # bump when a key changes meaning or shape; readers refuse every other value

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
class MethodIo:
    """One method's inputs, in signature order, and the names of its outputs, in return order."""

    inputs: List[InputSpec]
    outputs: List[str]


@dataclass(frozen=True)
class DynamicDim:
    """The range a named dynamic dim takes in the lowered artifact, both ends included."""

    min: int
    max: int


@dataclass
class IoSpec:
    """The whole of ``io_spec.json``."""

    dtype: str  # the unit's dtype (the model's floating inputs and weights)
    methods: Dict[str, MethodIo]
    dynamic: Dict[str, DynamicDim] = field(default_factory=dict)
    example_sizes: Dict[str, int] = field(default_factory=dict)  # the sizes the methods were traced at
    format: int = IO_SPEC_FORMAT

    def method(self, name: str) -> MethodIo:
        return self.methods[name]

    def to_json(self) -> Dict[str, Any]:
        data = encode(self)
        return {FORMAT_KEY: data.pop(FORMAT_KEY), **data}

    @classmethod
    def from_json(cls, data: Any, file: str) -> "IoSpec":
        """Parsed JSON as an ``IoSpec``; ``file`` (the path it was read from) names it in error messages."""
        check_format(data, file, IO_SPEC_FORMAT)
        return decode(cls, data, file)
