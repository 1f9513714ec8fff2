"""Finding the ``flatc`` executable that ExecuTorch's (de)serializers shell out to for .pte and .ptd files.

Kept apart from ``zoo.lowering`` so that the assembler (which lowering calls) can use it without an import circle.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import stat
import sys
from pathlib import Path

from .errors import LoweringError


def ensure_flatc() -> str:
    """Point FLATC_EXECUTABLE at a flatc (writing or reading a .pte needs it) unless it is already set."""
    current = os.environ.get("FLATC_EXECUTABLE")
    if current and Path(current).is_file():
        return current
    candidates = [Path(sys.executable).parent / "flatc"]
    spec = importlib.util.find_spec("executorch")  # a namespace package: no __file__
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidates.append(Path(location) / "data" / "bin" / "flatc")
    on_path = shutil.which("flatc")
    if on_path:
        candidates.append(Path(on_path))
    for path in candidates:
        if path.is_file():
            if not os.access(path, os.X_OK):  # wheels unpacked with --target can lose the run bit
                with contextlib.suppress(OSError):
                    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
            if os.access(path, os.X_OK):
                os.environ["FLATC_EXECUTABLE"] = str(path)
                return str(path)
    raise LoweringError("no flatc executable found: writing and reading .pte files needs it",
                        "install executorch (it ships executorch/data/bin/flatc) or set FLATC_EXECUTABLE")
