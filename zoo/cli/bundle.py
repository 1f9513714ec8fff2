"""``python -m zoo bundle OUT_DIR``: everything an offline GPU box or a Jetson needs to run zoo, in one folder:
``wheels/`` (zoo's dependencies for the target Python and platform, resolved and downloaded by pip), ``hub/`` (the
recipes' checkpoints as a Hugging Face Hub cache) and ``manifest.json`` (every file's size and sha256, the target,
what was left out and why). What the target has is left out with ``--have``/``--have-file`` (README, "Offline
and Jetson").
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

from zoo.cli import common as cli
from zoo.core.atomic import write_json
from zoo.core.errors import ZooError
from zoo.export.pull import checkpoint_into_cache
from zoo.core.progress import bars_on, run_log, say, steps
from zoo.contract.recipes import load_recipe
from zoo.core.report import format_table

# Source-only distributions zoo needs, built into wheels before resolution (pip cannot resolve an sdist for a
# foreign platform).
SDIST_ONLY: Dict[str, str] = {"antlr4-python3-runtime": "4.9.3"}

PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_28_aarch64")

# Dependencies of zoo's dependencies that zoo never imports and that have no wheel for a platform: pip resolves
# against an empty stand-in wheel of that version, and neither it nor what only it needs travels. executorch 1.2.0
# requires coremltools 9.0 on Linux for its Core ML (Apple) backend; coremltools 9.0 ships Linux wheels for
# x86-64 only, so without this no aarch64 (Jetson) bundle resolves. The target installs with --no-deps.
STAND_INS: Dict[str, Dict[str, Tuple[str, str]]] = {
    "manylinux_2_28_aarch64": {"coremltools": ("9.0", "executorch's Core ML (Apple) backend, which zoo does not use; "
                                                      "no Linux aarch64 wheel exists")},
}
BUNDLE_MANIFEST = "manifest.json"  # the bundle's own file list (a bundle is not a run folder)
BUNDLE_LOG = "bundle.log"  # what the libraries printed while the checkpoints were added


class BundleError(ZooError):
    """The bundle could not be built: resolution, download or a bad argument."""


@dataclass
class ResolvedPackage:
    name: str  # canonical (lowercase, dashes)
    version: str
    requires: List[str] = field(default_factory=list)  # canonical names of its dependencies for the target


@dataclass
class BundleManifest:
    created: str
    python: str
    platform: str
    requirements: List[str]
    have: Dict[str, Optional[str]]
    left_out: Dict[str, str]  # package -> reason
    wheels: List[Dict[str, object]]
    hub: List[Dict[str, object]]
    total_bytes: int = 0


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def platform_tags(platform: str) -> List[str]:
    """All platform tags a system of this glibc accepts: manylinux_2_28 also runs manylinux_2_17 ... wheels."""
    if platform not in PLATFORMS:
        raise BundleError(f"unknown platform {platform!r}", f"use one of: {', '.join(PLATFORMS)}")
    glibc_minor = 28
    arch = "x86_64" if platform.endswith("x86_64") else "aarch64"
    tags = [f"manylinux_2_{n}_{arch}" for n in range(glibc_minor, 4, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    tags += [f"{alias}_{arch}" for n, alias in legacy.items() if n <= glibc_minor and (arch == "x86_64" or n >= 17)]
    return tags


def zoo_requirements(python: str, extras: Sequence[str] = ("policies",)) -> List[str]:
    """zoo's own requirements (from its installed metadata), markers evaluated for the target Python."""
    from importlib import metadata

    from packaging.requirements import Requirement

    try:
        raw = metadata.requires("zoo") or []
    except metadata.PackageNotFoundError:
        raise BundleError("zoo is not installed, so its requirements cannot be read",
                          "run scripts/setup.sh (it installs zoo into .venv) and use .venv/bin/python") from None
    wanted = []
    for text in raw:
        req = Requirement(text)
        env = {"python_version": python, "python_full_version": python + ".0", "extra": ""}
        if req.marker is not None:
            hits = [req.marker.evaluate(dict(env, extra=e)) for e in ("",) + tuple(extras)]
            if not any(hits):
                continue
        wanted.append(str(Requirement(f"{req.name}{'[' + ','.join(sorted(req.extras)) + ']' if req.extras else ''}"
                                      f"{req.specifier}")))
    return wanted


def _pip(args: List[str], what: str, show: bool = False) -> subprocess.CompletedProcess:
    """Run pip; ``show`` lets it draw its own per-file progress on the terminal (its errors go there too)."""
    cmd = [sys.executable, "-m", "pip", *args]
    proc = subprocess.run(cmd, capture_output=not show, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout or "see pip's output above").strip().splitlines()[-8:])
        raise BundleError(f"pip failed while {what}:\n{tail}",
                          "check the network or the index (--index-url / --find-links), and the target "
                          "--python/--platform; packages with no wheel for the target cannot be bundled")
    return proc


def _target_args(python: str, platform: str) -> List[str]:
    args = ["--only-binary=:all:", "--python-version", python, "--implementation", "cp"]
    for tag in platform_tags(platform):
        args += ["--platform", tag]
    return args


def _index_args(index_url: Optional[str], find_links: Sequence[str], no_index: bool = False) -> List[str]:
    args = ["--no-index"] if no_index else (["--index-url", index_url] if index_url else [])
    for link in find_links:
        args += ["--find-links", str(link)]
    return args


def stand_in_wheel(folder: Path, name: str, version: str) -> Path:
    """An empty wheel of ``name`` ``version`` with no dependencies: what pip resolves in place of a package the
    target never imports (``STAND_INS``). It is never part of a bundle."""
    import zipfile

    dist = f"{canonical(name).replace('-', '_')}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        zf.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: zoo\nRoot-Is-Purelib: true\n"
                                               "Tag: py3-none-any\n")
        zf.writestr(f"{dist}.dist-info/RECORD", "")
    return path


def build_sdist_wheels(packages: Dict[str, str], wheels_dir: Path, index: List[str]) -> List[Path]:
    built = []
    for name, version in packages.items():
        say(f"building a wheel for {name}=={version} (source only on the index)")
        _pip(["wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels_dir), *index,
              f"{name}=={version}"], f"building {name}")
        built += sorted(wheels_dir.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
    return built


def resolve(requirements: Sequence[str], python: str, platform: str, index: List[str]) -> List[ResolvedPackage]:
    """What pip would install for the target, with each package's dependencies (markers evaluated by pip)."""
    from packaging.requirements import Requirement

    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "pip-report.json"
        _pip(["install", "--dry-run", "--ignore-installed", "-q", "--report", str(report),
              "--target", str(Path(tmp) / "target"), *_target_args(python, platform), *index, *requirements],
             "resolving dependencies")
        data = json.loads(report.read_text())
    chosen = {canonical(item["metadata"]["name"]): item for item in data["install"]}
    resolved = []
    for name, item in chosen.items():
        extras = set(item.get("requested_extras") or [])
        requires = []
        for text in item["metadata"].get("requires_dist") or []:
            req = Requirement(text)
            env = {"python_version": python, "python_full_version": python + ".0"}
            if req.marker is not None and not any(req.marker.evaluate(dict(env, extra=e)) for e in extras | {""}):
                continue
            if canonical(req.name) in chosen:
                requires.append(canonical(req.name))
        resolved.append(ResolvedPackage(name, item["metadata"]["version"], sorted(set(requires))))
    return sorted(resolved, key=lambda p: p.name)


def leave_out(resolved: List[ResolvedPackage], roots: Iterable[str], have: Dict[str, Optional[str]]):
    """Split into (kept, left_out): a package the target has (at the same version, if one was given) is
    left out, and so is every package reachable only through left-out ones."""
    by_name = {p.name: p for p in resolved}
    have_now = {n for n, v in have.items() if n in by_name and (v is None or v == by_name[n].version)}
    kept: Set[str] = set()
    stack = [canonical(r) for r in roots if canonical(r) in by_name and canonical(r) not in have_now]
    while stack:
        name = stack.pop()
        if name in kept:
            continue
        kept.add(name)
        stack += [d for d in by_name[name].requires if d not in have_now and d not in kept]
    left = {}
    for p in resolved:
        if p.name in kept:
            continue
        left[p.name] = "the target has it" if p.name in have_now else "needed only by packages the target has"
    return [by_name[n] for n in sorted(kept)], left


def download(packages: List[ResolvedPackage], wheels_dir: Path, python: str, platform: str, index: List[str]) -> None:
    pins = [f"{p.name}=={p.version}" for p in packages
            if not any(canonical(w.name.split("-")[0]) == p.name for w in wheels_dir.glob("*.whl"))]
    if pins:
        say(f"downloading {len(pins)} wheels for Python {python} on {platform}")
        show = bars_on()  # pip's own per-file bars on a terminal; quiet in a log
        _pip(["download", "--no-deps", *([] if show else ["-q"]), "-d", str(wheels_dir),
              *_target_args(python, platform), *index, *pins], "downloading wheels", show=show)


def parse_have(items: Sequence[str], have_file: Optional[Path]) -> Dict[str, Optional[str]]:
    lines = list(items)
    if have_file is not None:
        if not have_file.exists():
            raise BundleError(f"--have-file {have_file} does not exist",
                              "write it on the target with: python3 -m pip list --format=freeze > have.txt")
        lines += [ln.strip() for ln in have_file.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    have: Dict[str, Optional[str]] = {}
    for line in lines:
        name, _, version = line.partition("==")
        have[canonical(name.strip())] = version.strip() or None
    return have


def file_record(path: Path, root: Path) -> Dict[str, object]:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return {"file": path.relative_to(root).as_posix(), "bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def add_checkpoints(recipes: Sequence[str], hub_dir: Path) -> List[Dict[str, object]]:
    """Put each recipe's checkpoint (and the auxiliary repos its policy loads by id) into ``hub_dir``."""
    entries = []
    for name in recipes:
        recipe = load_recipe(name)
        say(f"adding the checkpoint of {name} ({recipe.source.repo_id}) to the bundle's Hub cache")
        for repo_id, commit in checkpoint_into_cache(recipe, hub_dir).items():
            entries.append({"recipe": name, "repo_id": repo_id, "commit": commit})
    return entries


def build_bundle(out_dir: Path, recipes: Sequence[str] = (), python: str = "3.12",
                 platform: str = "manylinux_2_28_x86_64", have: Optional[Dict[str, Optional[str]]] = None,
                 weights: bool = True, requirements: Optional[Sequence[str]] = None,
                 index_url: Optional[str] = None, find_links: Sequence[str] = (), no_index: bool = False,
                 sdist_only: Optional[Dict[str, str]] = None,
                 stand_ins: Optional[Dict[str, Tuple[str, str]]] = None) -> BundleManifest:
    out_dir = Path(out_dir)
    wheels_dir, hub_dir = out_dir / "wheels", out_dir / "hub"
    wheels_dir.mkdir(parents=True, exist_ok=True)
    have = dict(have or {})
    requirements = list(requirements) if requirements is not None else zoo_requirements(python)
    sdist_only = SDIST_ONLY if sdist_only is None else sdist_only

    index = _index_args(index_url, find_links, no_index)
    build_sdist_wheels({n: v for n, v in sdist_only.items() if canonical(n) not in have}, wheels_dir, index)
    stand_ins = {canonical(n): (v, why) for n, (v, why) in (STAND_INS.get(platform, {}) if stand_ins is None
                                                            else stand_ins).items() if canonical(n) not in have}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (version, _) in stand_ins.items():
            stand_in_wheel(Path(tmp), name, version)
        links = ["--find-links", tmp] if stand_ins else []
        resolved = resolve(requirements, python, platform, index + ["--find-links", str(wheels_dir)] + links)
    roots = [_req_name(r) for r in requirements]
    # A stood-in package is left out like one the target has: it and what only it needs stay behind.
    kept, left = leave_out(resolved, roots, {**have, **{n: None for n in stand_ins}})
    for name, (version, why) in stand_ins.items():
        if name in left:
            left[name] = f"not used on the target ({why}): resolved against an empty stand-in of {version}"
    # A wheel built here for a package the resolver did not need, or the target has, does not travel.
    for wheel in wheels_dir.glob("*.whl"):
        if canonical(wheel.name.split("-")[0]) not in {p.name for p in kept}:
            wheel.unlink()
    download(kept, wheels_dir, python, platform, index + ["--find-links", str(wheels_dir)])

    hub_entries = []
    if weights and recipes:
        # Fabricating or pulling a checkpoint prints the libraries' own lines (shard writers, warnings): they go
        # to the bundle's log, not the terminal.
        with run_log(out_dir / BUNDLE_LOG):
            hub_entries = add_checkpoints(recipes, hub_dir)
    say("hashing the bundle's files for manifest.json ...")
    wheels = [file_record(p, out_dir) for p in steps(sorted(wheels_dir.glob("*.whl")), "hash wheels",
                                                        label=lambda p: p.name, unit="file")]
    hub_paths = sorted(p for p in hub_dir.rglob("*") if p.is_file()) if hub_dir.exists() else []
    hub_files = [file_record(p, out_dir) for p in steps(hub_paths, "hash Hub cache", label=lambda p: p.name,
                                                        unit="file")]
    manifest = BundleManifest(
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), python=python, platform=platform,
        requirements=list(requirements), have=have, left_out=left, wheels=wheels,
        hub=[dict(e, files=[f for f in hub_files if _in_repo(f["file"], e["repo_id"])]) for e in hub_entries])
    manifest.total_bytes = sum(int(w["bytes"]) for w in wheels) + sum(int(f["bytes"]) for f in hub_files)
    write_json(out_dir / BUNDLE_MANIFEST, asdict(manifest))
    return manifest


def _req_name(requirement: str) -> str:
    from packaging.requirements import Requirement

    return Requirement(requirement).name


def _in_repo(relpath: str, repo_id: str) -> bool:
    return relpath.startswith("hub/models--" + repo_id.replace("/", "--") + "/")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = cli.parser("python -m zoo bundle", __doc__.split("\n\n")[0],
                        [cli.EXIT_OK, cli.EXIT_ERROR, cli.EXIT_INTERRUPTED],
                        {cli.EXIT_OK: "the bundle is written (its manifest.json lists every file with its sha256)",
                         cli.EXIT_ERROR: "pip could not resolve or download for the target, a recipe's checkpoint "
                                         "could not be pulled, or a --have-file is missing",
                         cli.EXIT_INTERRUPTED: "interrupted: the bundle folder is incomplete; run it again"})
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--recipe", action="append", default=[], help="add this recipe's checkpoint (repeatable)")
    parser.add_argument("--python", default="3.12", help="target Python (JetPack 6: 3.10)")
    parser.add_argument("--platform", default="manylinux_2_28_x86_64", choices=PLATFORMS)
    parser.add_argument("--have", action="append", default=[], metavar="NAME[==VERSION]",
                        help="a package the target already has (repeatable), e.g. --have torch")
    parser.add_argument("--have-file", type=Path, help="the target's `pip list --format=freeze`")
    parser.add_argument("--no-weights", action="store_true", help="wheels only, no checkpoints")
    parser.add_argument("--index-url", help="a package index other than pip's configured one")
    parser.add_argument("--find-links", action="append", default=[], help="extra local wheel folders")
    parser.add_argument("--no-index", action="store_true", help="use only --find-links folders (no index at all)")
    args = parser.parse_args(argv)
    manifest = build_bundle(args.out_dir, args.recipe, args.python, args.platform,
                            parse_have(args.have, args.have_file), weights=not args.no_weights,
                            index_url=args.index_url, find_links=args.find_links, no_index=args.no_index)
    rows = [["part", "files", "MB"],
            ["wheels", len(manifest.wheels), f"{sum(int(w['bytes']) for w in manifest.wheels) / 1e6:.1f}"],
            ["hub cache", sum(len(h["files"]) for h in manifest.hub),  # type: ignore[arg-type]
             f"{sum(int(f['bytes']) for h in manifest.hub for f in h['files']) / 1e6:.1f}"],  # type: ignore[union-attr]
            ["total", "", f"{manifest.total_bytes / 1e6:.1f}"]]
    print(format_table(rows))
    if manifest.left_out:
        print(f"left out (the target has them or only they need them): {', '.join(sorted(manifest.left_out))}")
    print(f"bundle: {args.out_dir}  (on the target: tools/gpu_check.sh {args.out_dir} [RECIPE ...])")
    return 0
