"""Publish a verified run folder to the Hugging Face Hub: ``python -m zoo publish RUN_DIR --repo-id ORG/NAME``.

Refuses an unverified run or one whose files changed since verification; ``--dry-run`` stages the exact
folder (``RUN_DIR/publish/``) and prints the commit it would make. The work is ``zoo.export.publish.upload``'s.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from zoo.cli import common as cli
from zoo.contract.artifact import PTD_NAME, PTE_NAME
from zoo.export.publish.upload import publish_run
from zoo.contract.run_folder import MANIFEST_JSON, REPORT_JSON


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = cli.parser("python -m zoo publish", "Publish a verified zoo run folder to the Hugging Face Hub.",
                        [cli.EXIT_OK, cli.EXIT_ERROR, cli.EXIT_INTERRUPTED],
                        {cli.EXIT_OK: "published (or, with --dry-run, staged in RUN_DIR/publish/)",
                         cli.EXIT_ERROR: "refused: the run is not verified, a file changed since verification "
                                         "(damaged, truncated or swapped), no token, or the Hub said no; "
                                         "the run folder and an earlier publish/ are unchanged",
                         cli.EXIT_INTERRUPTED: "interrupted: the run folder and an earlier publish/ are unchanged"})
    parser.add_argument("run_dir", help=f"the run folder ({PTE_NAME}, {PTD_NAME}, {REPORT_JSON}, {MANIFEST_JSON})")
    parser.add_argument("--repo-id", help="ORG/NAME on the Hub (default: the recipe's publish.repo_id)")
    parser.add_argument("--revision", help="branch to commit to (created if missing; default main)")
    parser.add_argument("--private", action="store_true", help="create the repo private (an existing repo keeps "
                                                               "its visibility)")
    parser.add_argument("--dry-run", action="store_true", help="stage the folder and print the commit; send nothing")
    args = parser.parse_args(argv)

    def command() -> int:
        plan = publish_run(args.run_dir, args.repo_id, revision=args.revision, private=args.private,
                           dry_run=args.dry_run)
        print(plan.describe())
        return 0

    return cli.guarded(command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
