"""The toy family (tests only), found like a shipped one: conftest puts tests/families on zoo.policies' path,
so ``family: toy`` recipes load, validate and build through the same convention (zoo.policies.toy)."""

from __future__ import annotations

from conftest import ToyFamily

build_unit = ToyFamily.build_unit
fabricate_checkpoint = ToyFamily.fabricate_checkpoint
check_recipe = ToyFamily.check_recipe
