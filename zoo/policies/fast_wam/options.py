"""The fast_wam family's ``unit.options`` (read by the recipe schema; imports nothing heavy)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional

from zoo.policies import FamilyOptions


@dataclass
class FastWamOptions(FamilyOptions):
    num_inference_steps: Optional[int] = None  # Euler steps per chunk; None: the checkpoint's (LeRobot: 10)
    sigma_shift: Optional[float] = None  # None: the checkpoint's (itself None: the scheduler's infer_shift)
    # FastWAMConfig fields tiny recipes fabricate their checkpoint from; checked by FastWAMConfig itself
    # (lerobot's) when zoo.policies.fast_wam.checkpoint fabricates.
    fabricate_config: Dict[str, Any] = field(default_factory=dict)

    def validate(self, fail: Callable[[str, str], None]) -> None:
        steps, shift = self.num_inference_steps, self.sigma_shift
        if steps is not None and steps < 1:
            fail(f"unit.options.num_inference_steps={steps!r}", "give a whole number >= 1 (LeRobot's default is 10)")
        if shift is not None and not shift > 0:
            fail(f"unit.options.sigma_shift={shift!r}",
                 "give a number > 0, or leave it out to use the checkpoint's shift")
