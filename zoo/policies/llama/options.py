"""The llama family's ``unit.options`` (read by the recipe schema; imports nothing heavy)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from zoo.policies import FamilyOptions


@dataclass
class LlamaOptions(FamilyOptions):
    # LlamaConfig fields zoo fabricates a checkpoint of that size from (tiny recipes). A pulled checkpoint's own
    # config.json decides the architecture. zoo.policies.llama.unit checks the field names when it fabricates.
    fabricate_config: Optional[Dict[str, Any]] = None
