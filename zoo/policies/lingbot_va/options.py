"""The lingbot_va family's ``unit.options`` (read by the recipe schema; imports nothing heavy)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict

from zoo.policies import FamilyOptions


@dataclass
class LingbotVaOptions(FamilyOptions):
    # LeRobot LingBotVAConfig fields. Tiny recipes fabricate their checkpoint from them; for every recipe
    # build_unit checks the checkpoint's config.json against them. Their names are checked against
    # LingBotVAConfig itself when the unit is built: that class is lerobot's, so it is not read here.
    policy_config: Dict[str, Any] = field(default_factory=dict)
