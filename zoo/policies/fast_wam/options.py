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
    # Normalisation statistics the fabricated checkpoint ships, {feature: {"mean": [...], "std": [...]}}, for a
    # tiny recipe driven in a simulator whose units are not ~N(0, 1) (PushT's pixels); features left out get
    # seeded ones.
    fabricate_stats: Dict[str, Any] = field(default_factory=dict)

    def validate(self, fail: Callable[[str, str], None]) -> None:
        steps, shift = self.num_inference_steps, self.sigma_shift
        if steps is not None and steps < 1:
            fail(f"unit.options.num_inference_steps={steps!r}", "give a whole number >= 1 (LeRobot's default is 10)")
        if shift is not None and not shift > 0:
            fail(f"unit.options.sigma_shift={shift!r}",
                 "give a number > 0, or leave it out to use the checkpoint's shift")
        for key, stats in self.fabricate_stats.items():
            if (not isinstance(stats, dict) or sorted(stats) != ["mean", "std"]
                    or not all(isinstance(stats[k], (list, tuple)) for k in stats)
                    or len(stats["mean"]) != len(stats["std"])):
                fail(f"unit.options.fabricate_stats.{key}={stats!r}",
                     "give {mean: [...], std: [...]} of the feature's size")
            elif not all(s > 0 for s in stats["std"]):
                fail(f"unit.options.fabricate_stats.{key}.std={stats['std']!r}", "every std must be > 0")
