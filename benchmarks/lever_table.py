"""Each lever's before and after, from chunk-bench runs made side by side on one GPU.

    python benchmarks/lever_table.py --out OUT base=WORK/base buffer=WORK/buffer split_kv=WORK/split_kv

Each NAME=FOLDER is a ``benchmarks/bench_chunk.py --out FOLDER`` output (lowered, then timed with the same seed,
chunks and episodes; ``--only check`` adds its policy check). The first is the baseline. Prints, and writes to
OUT/levers.md and OUT/levers.json: per policy, the chunk and each method's median on each runner candidate,
each lever's ratio to the baseline, the floor, and each variant's agreement with LeRobot and its policy check.
Exit status: 0 written; 2 a folder without a bench, or runs timed with different settings.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional

from zoo.bench.levers import Variant, lever_rows, policies_of, verdict_rows
from zoo.core import atomic
from zoo.core.report import format_table, markdown_table

COMPARED_SETTINGS = ("chunks", "episodes", "seed", "tiny", "seeded", "layers")


def parse_variant(text: str) -> Variant:
    name, sep, folder = text.partition("=")
    if not sep or not name or not folder:
        raise SystemExit(f"lever_table: {text!r} is not NAME=FOLDER (e.g. buffer=WORK/buffer)")
    try:
        return Variant.read(name, Path(folder).expanduser())
    except (FileNotFoundError, ValueError) as exc:
        print(f"lever_table: {exc}", file=sys.stderr)
        raise SystemExit(2)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="where levers.md and levers.json go")
    parser.add_argument("variants", nargs="+", help="NAME=FOLDER, the baseline first")
    args = parser.parse_args(argv)
    if len(args.variants) < 2:
        parser.error("give the baseline and at least one lever")
    variants = [parse_variant(v) for v in args.variants]
    base = variants[0]
    for v in variants[1:]:
        differ = [k for k in COMPARED_SETTINGS
                  if v.results["settings"].get(k) != base.results["settings"].get(k)]
        if differ:
            print(f"lever_table: {v.name} was timed with other settings than {base.name} ({', '.join(differ)}); "
                  "time every variant with the same bench_chunk options", file=sys.stderr)
            return 2
    env = base.results.get("environment", {})
    md = ["# Levers: each against the baseline, side by side on one GPU", "",
          f"GPU: {env.get('gpu') or env.get('device')}; torch {env.get('torch')}; executorch {env.get('executorch')}.",
          "", "Commands:", ""] + [f"- {v.name}: `{v.results['command']}`" for v in variants] + [""]
    tables = {}
    for policy in policies_of(variants):
        rows, verdicts = lever_rows(variants, policy), verdict_rows(variants, policy)
        tables[policy] = {"levers": rows, "verdicts": verdicts}
        print(f"{policy}:\n{format_table(rows)}\n\n{format_table(verdicts)}\n")
        md += [f"## {policy}", "", markdown_table(rows), "", markdown_table(verdicts), ""]
    if not tables:
        print("lever_table: no policy was timed by every variant", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    atomic.write_json(args.out / "levers.json", {"variants": {v.name: v.results["command"] for v in variants},
                                                 "tables": tables})
    atomic.write_text(args.out / "levers.md", "\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
