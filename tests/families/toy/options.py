"""The toy family's ``unit.options`` (tests only: tests/support/environment.py puts tests/families on
zoo.policies' path)."""

from __future__ import annotations

from dataclasses import dataclass

from zoo.policies import FamilyOptions


@dataclass
class ToyOptions(FamilyOptions):
    kind: str = "rope"  # "rope": complex-rotary attention; "pool": two methods sharing a pool buffer
    dim: int = 16
    heads: int = 2
    slots: int = 6  # pool rows ("pool" kind)
    load_aux: bool = False  # build_unit also reads the auxiliary repo by Hub id, as Fast-WAM loads its VAE

    def validate(self, fail) -> None:
        if self.kind not in ("rope", "pool"):
            fail(f"unit.options.kind={self.kind!r} is not a toy kind", "use rope or pool")
