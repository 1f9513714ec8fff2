"""What a policy family hands the pipeline: an export unit with its methods and how to feed them.

A family module (``zoo/policies/<family>.py``) builds the unit from a pulled checkpoint. Everything the
later steps need to lower and verify *without* lerobot (input specs, dynamic dims, host settings) is a typed
dataclass of ``zoo.contract`` written to the run folder as JSON, so ``python -m zoo lower RUN_DIR`` works on a
Jetson.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from zoo.contract.host_settings import HostSettings, NoHostSettings, ObservationFeature
from zoo.contract.io_spec import Dim, InputSpec, MethodIo

__all__ = ["Dim", "ExportUnit", "InputSpec", "MethodSpec", "feature_record"]

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

    def io_spec(self) -> MethodIo:
        return MethodIo(inputs=list(self.inputs), outputs=list(self.output_names))


@dataclass
class ExportUnit:
    """The GPU part of a policy, cut out for export, plus what stays on the host."""

    family: str
    methods: Dict[str, MethodSpec]
    # What the deploy side needs to drive the artifact (steps, shifts, guidance, slot layout, ...): the family's
    # dataclass of zoo.contract.host_settings; a unit with no host loop has none.
    host_settings: HostSettings = field(default_factory=NoHostSettings)
    # Files from the checkpoint the deploy side needs besides the .pte (normalisation processors, configs).
    host_files: List[Path] = field(default_factory=list)
    # Optional: a function that runs the policy's own eager code for the unit's equivalence test.
    reference: Optional[Callable[..., Any]] = None
    # Optional: the LeRobot policy module the methods were cut from (their modules are its submodules). The
    # quantize stage names the layers it quantizes as this policy names them, so that the policy check can
    # quantize LeRobot's own policy the same way (zoo.export.quantize.quantize_policy).
    policy: Optional[torch.nn.Module] = None

    def io_spec(self) -> Dict[str, MethodIo]:
        return {name: m.io_spec() for name, m in self.methods.items()}


def feature_record(features: Dict[str, Any]) -> Dict[str, ObservationFeature]:
    """A LeRobot config's ``input_features`` (``{key: PolicyFeature(type, shape)}``) for host_settings.json: what
    observation keys the policy reads, of which kind (VISUAL, STATE, ...) and shape."""
    return {key: ObservationFeature(type=str(getattr(feature.type, "value", feature.type)),
                                    shape=[int(s) for s in feature.shape])
            for key, feature in sorted(features.items())}
