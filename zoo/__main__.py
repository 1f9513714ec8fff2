"""``python -m zoo COMMAND ...``: list recipes, export, lower, audit, and the other zoo commands.

Each command other than ``list`` belongs to its own module and is imported only when used, so a machine
that lacks an optional part (lerobot for export, a GPU stack for lower) can still run the rest.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from zoo.cli.common import guarded, report_error
from zoo.core.errors import EXIT_ERROR, EXIT_OK, ZooError, exit_status_help
from zoo.contract.recipes import load_recipe, recipe_names
from zoo.core.report import format_table

# command -> (module, function taking argv, one-line help)
DELEGATES: Dict[str, Tuple[str, str, str]] = {
    "export": ("zoo.cli.export", "main", "pull, export, rewrite, check (and lower/verify on a GPU): python -m zoo export RECIPE"),
    "lower": ("zoo.cli.lower", "main", "lower, audit and verify a saved run folder on a GPU (model.pte + .ptd)"),
    "audit": ("zoo.export.audit", "audit_main", "which ExecuTorch CUDA runtimes can load an artifact"),
    "publish": ("zoo.cli.publish", "main", "publish a verified run to the Hugging Face Hub"),
    "bench": ("zoo.bench", "main", "time a lowered artifact on the GPU"),
    "prompt": ("zoo.cli.deploy", "prompt_main", "embed a task text once for the policy runner (UMT5, eager; needs lerobot)"),
    "act": ("zoo.cli.deploy", "act_main", "print one action chunk for an observation file (zoo.runner)"),
    "bundle": ("zoo.cli.bundle", "main", "wheels and checkpoints for a machine without network"),
    "doctor": ("zoo.cli.doctor", "main", "what this machine can do; summarise run folders"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m zoo", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="zoo: export robot policies to verified ExecuTorch CUDA artifacts. "
                    "`python -m zoo COMMAND --help` for a command's options and exit codes.",
        epilog=exit_status_help([EXIT_OK, EXIT_ERROR], {
            EXIT_OK: "list: recipes printed (each command documents its own codes in its --help)",
            EXIT_ERROR: "no command, an unknown one, or no recipe matches the pattern"}))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    lister = sub.add_parser("list", help="every recipe with its Hub id and what it exports",
                            formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog=exit_status_help([EXIT_OK, EXIT_ERROR], {
                                EXIT_OK: "the recipes are listed",
                                EXIT_ERROR: "no recipe matches the pattern"}))
    lister.add_argument("pattern", nargs="?", default=None, help="fnmatch filter on names, e.g. 'lingbot*'")
    for name, (_, _, help_text) in DELEGATES.items():
        # The delegate parses its own arguments (and answers its own --help).
        p = sub.add_parser(name, help=help_text, add_help=False)
        p.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv:
        parser.print_help()
        return 2
    if argv[0] in DELEGATES:  # pass everything after the command through untouched (options included)
        return _delegate(argv[0], argv[1:])
    args = parser.parse_args(argv)
    if args.command == "list":
        return guarded(lambda: list_recipes(args.pattern))
    parser.print_help()
    return 2


METHODS_WIDTH = 32  # "vae_encode_first, vae_encode," fits on one line


def list_recipes(pattern: Optional[str] = None, out=None) -> int:
    out = out or sys.stdout
    names = recipe_names(pattern=pattern)
    if not names:
        raise ZooError(f"no recipe matches {pattern!r}" if pattern else "no recipes found",
                       "`python -m zoo list` without a pattern shows them all")
    rows: List[List[str]] = [["name", "family", "hub id", "methods", "dtype", "notes"]]
    for name in names:
        try:
            s = load_recipe(name).summary()
            rows.append([s["name"], s["family"], s["hub"], s["methods"], s["dtype"], s["notes"]])
        except ZooError as exc:  # one broken recipe file must not hide the others
            rows.append([name, "?", "?", "?", "?", f"BROKEN: {exc.message}"])
    # A long methods list wraps at METHODS_WIDTH; the notes wrap onto further lines within the terminal's width
    # (at least 30 columns). Nothing is cut.
    methods, notes = 3, len(rows[0]) - 1
    widths = [max(len(r[i]) for r in rows) for i in range(notes)]
    widths[methods] = min(widths[methods], METHODS_WIDTH)
    width = max(30, shutil.get_terminal_size((120, 24)).columns - sum(w + 2 for w in widths))
    print(format_table(rows, wrap={methods: METHODS_WIDTH, notes: width}), file=out)
    return 0


def _delegate(command: str, argv: List[str]) -> int:
    try:
        func = _load(command)
    except ZooError as exc:
        return report_error(exc)
    if command == "export":
        return guarded(lambda: func(argv, prog="python -m zoo export"))
    return guarded(lambda: func(argv))


def _load(command: str) -> Callable[..., int]:
    module_name, func_name, _ = DELEGATES[command]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:  # the command exists but one of its own imports is missing
            raise ZooError(f"`python -m zoo {command}` needs the package {exc.name}, which is not installed",
                           "install it, or use zoo's offline bundle (`python -m zoo bundle`)") from exc
        raise ZooError(f"`python -m zoo {command}` is not available in this zoo installation "
                       f"({module_name} is missing)", "update zoo") from exc
    return getattr(module, func_name)


if __name__ == "__main__":
    sys.exit(main())
