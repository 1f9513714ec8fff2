"""Policy families, one module each. A family module provides:

    build_unit(checkpoint_dir: Path, recipe: Recipe) -> ExportUnit
    fabricate_checkpoint(recipe: Recipe, work_dir: Path) -> Dict[str, Path]
        seeded random weights in the checkpoint's real file layout; {repo_id: folder} for the recipe's repo
        and every auxiliary repo the policy loads by Hub id (VAE, text encoder, tokenizer)

Modules are imported only when a unit is built, so lerobot (which they import) stays out of the core.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ..errors import ExportError

FAMILY_MODULES = {
    "llama": "zoo.policies.llama",
    "lingbot_va": "zoo.policies.lingbot_va",
    "fast_wam": "zoo.policies.fast_wam",
}


def load_family(name: str) -> ModuleType:
    if name not in FAMILY_MODULES:
        raise ExportError(f"unknown policy family {name!r}", f"families: {', '.join(FAMILY_MODULES)}")
    try:
        return importlib.import_module(FAMILY_MODULES[name])
    except ImportError as exc:
        raise ExportError(
            f"policy family {name!r} cannot be imported: {exc}",
            "building export units needs the policies extra: pip install 'zoo[policies]' (Python >= 3.12); "
            "lowering and verifying a saved run (`python -m zoo.lower RUN_DIR`) does not",
        ) from exc
