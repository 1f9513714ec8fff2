#!/usr/bin/env python3
"""``python scripts/bench.py RUN_DIR [options]`` is ``python -m zoo bench RUN_DIR [options]`` from a checkout
that is not installed: the artifact of a run folder against eager PyTorch and torch.compile, on a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from zoo.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
