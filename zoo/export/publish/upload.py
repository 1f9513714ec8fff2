"""Publishing a verified run folder to the Hugging Face Hub (the command line is ``zoo.publish``).

Order of work: refuse an unverified run; re-hash every file against manifest.json; find the user's token
(before any network call); stage the exact folder that will be uploaded under ``RUN_DIR/publish/``; then,
through huggingface_hub's own API, create the repo (and branch) if needed and make one commit holding every
staged file. ``--dry-run`` stops after staging and prints the commit it would make.

``publish/`` is built beside itself and swapped into place whole (``zoo.core.atomic.atomic_folder``): a failed,
interrupted or killed staging leaves the one before as it was, and nothing else in the run folder is written.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from zoo.core import atomic
from zoo.core.errors import PublishRefused
from zoo.export.publish.manifest import build_manifest, check_files, public_section, read_manifest, sha256_file
from zoo.export.publish.card_results import audit_rows, row_output
from zoo.export.publish.model_card import human_size, render_card
from zoo.core.progress import say, steps, warn
from zoo.core.report import format_table
from zoo.contract.run_folder import MANIFEST_JSON, REPORT_JSON, RunFolder

README = "README.md"  # the Hub shows a repo's README.md as its model card


@dataclass
class StagedFile:
    path_in_repo: str
    local_path: Path
    size: int
    sha256: str


@dataclass
class PublishPlan:
    """What was staged and where it goes; after a push, also what the Hub answered."""

    run_dir: Path
    repo_id: str
    revision: Optional[str]
    private: bool
    staged_dir: Path
    files: List[StagedFile] = field(default_factory=list)
    commit_message: str = ""
    commit_description: str = ""
    dry_run: bool = False
    pushed: bool = False
    commit_url: Optional[str] = None

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def operations(self) -> list:
        """One ``CommitOperationAdd`` per staged file, reading the staged copy itself."""
        from huggingface_hub import CommitOperationAdd

        return [CommitOperationAdd(path_in_repo=f.path_in_repo, path_or_fileobj=str(f.local_path)) for f in self.files]

    def describe(self) -> str:
        head = "would commit" if self.dry_run else ("committed" if self.pushed else "commit")
        lines = [f"{head} to https://huggingface.co/{self.repo_id} (revision {self.revision or 'main'}, "
                 f"{'private' if self.private else 'public'} if created): {len(self.files)} files, "
                 f"{human_size(self.total_bytes)} ({self.total_bytes} bytes)",
                 f"message: {self.commit_message}",
                 f"staged folder: {self.staged_dir}", ""]
        rows = [["operation", "path_in_repo", "size", "bytes", "sha256"]]
        rows += [["add", f.path_in_repo, human_size(f.size), str(f.size), f.sha256] for f in self.files]
        lines.append(format_table(rows))
        if self.commit_url:
            lines += ["", f"commit: {self.commit_url}"]
        return "\n".join(lines)


# --- refusals before anything is staged -----------------------------------------------------------------


def check_verified(report: Mapping[str, Any], run_dir: Path) -> Dict[str, Any]:
    """Return the verification record, or refuse: it never ran, it failed, or it is not self-consistent."""
    ver = report.get("verification")
    hint = (f"run `python -m zoo lower {run_dir}` on a CUDA machine (it lowers, audits and verifies), and "
            "publish once verification passes")
    if not ver:
        raise PublishRefused(f"{run_dir}: verification never ran, so nothing shows the artifact computes what "
                             "the policy computes", hint)
    rows = ver.get("rows") or []
    failing = [r for r in rows if not r.get("ok")]
    if ver.get("passed") is not True or failing:
        shown = "".join(f"\n    {r.get('method', '?')} seed {r.get('seed', '?')} {row_output(r)}: "
                        f"{r.get('why') or 'not ok'}" for r in failing[:5])
        more = f"\n    ... and {len(failing) - 5} more" if len(failing) > 5 else ""
        raise PublishRefused(f"{run_dir}: verification failed ({len(failing)} of {len(rows)} comparisons out of "
                             f"tolerance){shown}{more}", "fix the export (see report.md) and verify again; "
                             "zoo never publishes an artifact that does not match eager PyTorch")
    if not rows:
        raise PublishRefused(f"{run_dir}: the verification record holds no comparisons", hint)
    return ver


def check_run(run_dir: Path) -> Dict[str, Any]:
    """Every refusal that needs no network: verification, manifest consistency, file hashes. Returns the manifest."""
    if not run_dir.is_dir():
        raise PublishRefused(f"{run_dir} is not a folder", "pass the run folder that `python -m zoo.export` wrote")
    run = RunFolder(run_dir)
    if not run.is_run():
        raise PublishRefused(f"{run_dir} has no {REPORT_JSON}: it is not a zoo run folder",
                             "pass the run folder that `python -m zoo.export` wrote")
    report = run.read_report().data
    check_verified(report, run_dir)
    manifest = read_manifest(run_dir)
    for section in ("verification", "audit", "rewrites"):
        if manifest.get(section) != public_section(report.get(section)):
            raise PublishRefused(f"{run_dir}/{MANIFEST_JSON} is stale: its {section} differs from {REPORT_JSON}'s",
                                 "re-run verification, which rewrites the manifest from the report")
    if not audit_rows(manifest.get("audit")):
        raise PublishRefused(f"{run_dir}: no runtime audit recorded, so the card cannot say which ExecuTorch "
                             "runtimes load the artifact", "re-run lowering, which audits the compiled kernels")
    check_files(run_dir, manifest)
    return manifest


def resolve_token() -> str:
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise PublishRefused("no Hugging Face token found: publishing needs one with write access",
                             "log in with `hf auth login` (or `huggingface-cli login` on older huggingface_hub), "
                             "or set HF_TOKEN to a write token from https://huggingface.co/settings/tokens")
    return token


def check_repo_id(repo_id: Optional[str]) -> str:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not repo_id:
        raise PublishRefused("no repo id to publish to", "pass --repo-id ORG/NAME or set publish.repo_id in the recipe")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise PublishRefused(f"bad repo id {repo_id!r}: {exc}", "use ORG/NAME, e.g. my-lab/lingbot-va-cuda") from None
    if repo_id.count("/") != 1:
        raise PublishRefused(f"bad repo id {repo_id!r}: expected ORG/NAME", "e.g. my-lab/lingbot-va-cuda")
    return repo_id


# --- staging --------------------------------------------------------------------------------------------


def _place(src: Path, dst: Path) -> None:
    """Hard-link when possible (weights blobs reach gigabytes), else copy."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def stage(run_dir: Path, manifest: Mapping[str, Any], repo_id: str) -> List[StagedFile]:
    """Build ``RUN_DIR/publish/`` (replacing an older one whole): artifact files, manifest.json, README.md."""
    run = RunFolder(run_dir)
    final = run.publish_dir
    say(f"staging {final} ({len(manifest['files'])} files, the model card and the manifest) ...")
    with atomic.atomic_folder(final) as tmp:
        for rel in steps(list(manifest["files"]), "stage publish/", unit="file"):
            _place(run.path / rel, tmp / rel)
        _place(run.manifest_file, tmp / MANIFEST_JSON)
        atomic.write_text(tmp / README, render_card(manifest, run.read_io_spec(), run.read_host_settings(), repo_id))
    staged = []
    files = sorted(p for p in final.rglob("*") if p.is_file())
    for path in steps(files, "hash staged files", label=lambda p: p.name, unit="file"):
        staged.append(StagedFile(path.relative_to(final).as_posix(), path, path.stat().st_size, sha256_file(path)))
    return staged


def _commit_text(manifest: Mapping[str, Any]) -> Dict[str, str]:
    recipe = manifest.get("recipe") or {}
    source = manifest.get("source") or {}
    ver = manifest.get("verification") or {}
    rows = ver.get("rows") or []
    worst = max((r.get("rel_l2") or 0.0 for r in rows), default=0.0)
    return {
        "commit_message": f"zoo: {recipe.get('name', 'artifact')} from {source.get('repo_id')}@"
                          f"{str(source.get('commit') or '?')[:12]}",
        "commit_description": f"ExecuTorch CUDA artifact exported and verified by zoo: {len(rows)} comparisons "
                              f"against eager passed (worst relative L2 {worst:.3e}). "
                              f"See {README} and {MANIFEST_JSON}.",
    }


# --- the Hub --------------------------------------------------------------------------------------------


def _hub_refusal(exc: Exception, action: str, repo_id: str) -> PublishRefused:
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    said = (getattr(exc, "server_message", None) or str(exc)).strip()
    namespace = repo_id.split("/")[0]
    hints = {
        401: "the token was rejected: log in again with `hf auth login` or set HF_TOKEN to a valid token",
        403: f"your token cannot write to {namespace!r}: use a token with write access "
             "(https://huggingface.co/settings/tokens) and check that you may create repos in that organisation",
        404: f"the Hub does not know {repo_id!r} or {namespace!r}, or your token cannot see it: check --repo-id",
    }
    return PublishRefused(f"the Hub refused to {action} {repo_id} (HTTP {status}): {said}",
                          hints.get(status or 0, "read the Hub's answer above; retry later if it is a server error"))


def push(plan: PublishPlan, token: str, api: Any = None) -> None:
    """Create the repo (and branch) if missing, then one commit with every staged file."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    api = api if api is not None else HfApi()
    action = "create or reach"
    try:
        api.create_repo(repo_id=plan.repo_id, token=token, private=plan.private, repo_type="model", exist_ok=True)
        if plan.revision and plan.revision != "main":
            action = f"create branch {plan.revision!r} in"
            api.create_branch(repo_id=plan.repo_id, branch=plan.revision, token=token, repo_type="model",
                              exist_ok=True)
        action = "commit to"
        info = api.create_commit(repo_id=plan.repo_id, operations=plan.operations(),
                                 commit_message=plan.commit_message, commit_description=plan.commit_description,
                                 token=token, repo_type="model", revision=plan.revision)
    except HfHubHTTPError as exc:
        raise _hub_refusal(exc, action, plan.repo_id) from None
    except OfflineModeIsEnabled:
        raise PublishRefused("HF_HUB_OFFLINE is set, so huggingface_hub will not reach the Hub",
                             "unset HF_HUB_OFFLINE to publish, or use --dry-run to stage only") from None
    plan.pushed = True
    plan.commit_url = getattr(info, "commit_url", None)


def publish_run(run_dir, repo_id: Optional[str], revision: Optional[str] = None, private: bool = False,
                dry_run: bool = False, api: Any = None) -> PublishPlan:
    """Check, stage and (unless ``dry_run``) push a run folder. ``repo_id`` None takes the recipe's
    ``publish.repo_id``; the recipe's ``publish.private`` also makes the repo private."""
    run_dir = Path(run_dir)
    if dry_run and _unverified(run_dir):
        return preview_run(run_dir, repo_id, revision, private)
    manifest = check_run(run_dir)
    publish_cfg = (manifest.get("recipe") or {}).get("publish") or {}
    repo_id = check_repo_id(repo_id or publish_cfg.get("repo_id"))
    token = None if dry_run else resolve_token()
    plan = PublishPlan(run_dir=run_dir, repo_id=repo_id, revision=revision,
                       private=bool(private or publish_cfg.get("private")), staged_dir=RunFolder(run_dir).publish_dir,
                       dry_run=dry_run, **_commit_text(manifest))
    plan.files = stage(run_dir, manifest, repo_id)
    if not dry_run:
        say(f"committing {len(plan.files)} files to {repo_id} ...")
        push(plan, token, api)  # type: ignore[arg-type]
    return plan


def _unverified(run_dir: Path) -> bool:
    """A run folder whose verification never ran or failed (a CPU-only export): a dry run previews its card."""
    run = RunFolder(run_dir)
    if not run_dir.is_dir() or not run.is_run():
        return False  # check_run says what is wrong
    try:
        check_verified(run.read_report().data, run_dir)
    except PublishRefused:
        return True
    return False


def preview_run(run_dir: Path, repo_id: Optional[str], revision: Optional[str], private: bool) -> PublishPlan:
    """The card of an unverified run, marked as such, staged in ``RUN_DIR/publish/`` so that a machine without a
    GPU can read what would be published; the files a push would need are not there, and a push is refused."""
    run = RunFolder(run_dir)
    manifest = build_manifest(run, run.read_report(), files={})
    publish_cfg = (manifest.get("recipe") or {}).get("publish") or {}
    repo_id = check_repo_id(repo_id or publish_cfg.get("repo_id") or "ORG/NAME")
    warn(f"{run_dir} is not verified: staging an unverified preview of its model card only; a push is refused "
         f"until `python -m zoo lower {run_dir}` has verified it on a GPU")
    with atomic.atomic_folder(run.publish_dir) as tmp:
        atomic.write_text(tmp / README, render_card(manifest, run.read_io_spec(), run.read_host_settings(), repo_id))
    card = run.publish_dir / README
    plan = PublishPlan(run_dir=run_dir, repo_id=repo_id, revision=revision,
                       private=bool(private or publish_cfg.get("private")), staged_dir=run.publish_dir,
                       dry_run=True, commit_message="(unverified preview: nothing would be committed)")
    plan.files = [StagedFile(README, card, card.stat().st_size, sha256_file(card))]
    return plan
