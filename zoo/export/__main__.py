"""``python -m zoo.export RECIPE ...``: the export line's command (``zoo.cli.export``)."""
import sys

from zoo.cli.export import main

if __name__ == "__main__":
    sys.exit(main())
