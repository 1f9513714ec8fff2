"""The bundle's wheel resolution, leave-out rule and manifest, built from a local index of fixture packages.

No network: pip resolves and downloads from a folder of wheels and one source distribution made here.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
import zipfile
from pathlib import Path

import pytest

from zoo.cli.bundle import build_bundle, leave_out, parse_have, platform_tags, ResolvedPackage, BundleError


def make_wheel(folder: Path, name: str, version: str, requires=()) -> Path:
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    meta += [f"Requires-Dist: {r}" for r in requires]
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name.replace('-', '_')}/__init__.py", f"VERSION = {version!r}\n")
        zf.writestr(f"{dist}.dist-info/METADATA", "\n".join(meta) + "\n")
        zf.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{dist}.dist-info/RECORD", "")
    return path


def make_sdist(folder: Path, name: str, version: str) -> Path:
    """A setuptools source distribution with no wheel, like antlr4-python3-runtime 4.9.3 on PyPI."""
    base = f"{name.replace('-', '_')}-{version}"
    files = {
        f"{base}/setup.py": f"from setuptools import setup\nsetup(name={name!r}, version={version!r}, py_modules=['zoofix_src'])\n",
        f"{base}/zoofix_src.py": "X = 1\n",
        f"{base}/PKG-INFO": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
    }
    path = folder / f"{base}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for arc, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(arc)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture(scope="module")
def local_index(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("index")
    make_wheel(folder, "zoofix-root", "1.0", ["zoofix-dep>=1", "zoofix-heavy", "zoofix-src==1.0", "zoofix-shared"])
    make_wheel(folder, "zoofix-dep", "1.2", ["zoofix-shared"])
    make_wheel(folder, "zoofix-dep", "0.9")
    make_wheel(folder, "zoofix-heavy", "2.0", ["zoofix-heavydep", "zoofix-shared"])
    make_wheel(folder, "zoofix-heavydep", "3.1")
    make_wheel(folder, "zoofix-shared", "1.0")
    make_wheel(folder, "zoofix-unused", "1.0")
    make_sdist(folder, "zoofix-src", "1.0")
    return folder


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_bundle_from_local_index_leaves_out_what_the_target_has(local_index, tmp_path):
    out = tmp_path / "bundle"
    manifest = build_bundle(out, recipes=(), python="3.12", platform="manylinux_2_28_x86_64",
                            have=parse_have(["zoofix-heavy"], None), weights=False,
                            requirements=["zoofix-root"], find_links=[str(local_index)], no_index=True,
                            sdist_only={"zoofix-src": "1.0"})
    names = sorted(Path(w["file"]).name.split("-")[0] for w in manifest.wheels)
    # heavy is on the target; heavydep is needed only by heavy; shared is also needed by dep, so it travels.
    assert names == ["zoofix_dep", "zoofix_root", "zoofix_shared", "zoofix_src"]
    assert manifest.left_out == {"zoofix-heavy": "the target has it",
                                 "zoofix-heavydep": "needed only by packages the target has"}
    assert any(w["file"] == "wheels/zoofix_dep-1.2-py3-none-any.whl" for w in manifest.wheels)  # newest allowed
    for record in manifest.wheels:
        path = out / record["file"]
        assert record["bytes"] == path.stat().st_size and record["sha256"] == sha256(path)
    on_disk = sorted(p.name for p in (out / "wheels").iterdir())
    assert on_disk == sorted(Path(w["file"]).name for w in manifest.wheels)
    assert manifest.total_bytes == sum(w["bytes"] for w in manifest.wheels)
    assert (out / "manifest.json").exists()


def test_have_with_another_version_still_bundles_the_package(local_index, tmp_path):
    manifest = build_bundle(tmp_path / "b", python="3.12", have={"zoofix-heavy": "1.0"}, weights=False,
                            requirements=["zoofix-root"], find_links=[str(local_index)], no_index=True,
                            sdist_only={"zoofix-src": "1.0"})
    assert any("zoofix_heavy-2.0" in w["file"] for w in manifest.wheels)
    assert manifest.left_out == {}


def test_missing_package_is_a_clear_error(local_index, tmp_path):
    with pytest.raises(BundleError, match="resolving dependencies"):
        build_bundle(tmp_path / "b", python="3.12", weights=False, requirements=["zoofix-absent"],
                     find_links=[str(local_index)], no_index=True, sdist_only={})


def test_leave_out_rule_on_a_hand_made_graph():
    pkgs = [ResolvedPackage("a", "1", ["b", "t"]), ResolvedPackage("t", "2", ["n", "s"]),
            ResolvedPackage("n", "1"), ResolvedPackage("s", "1"), ResolvedPackage("b", "1", ["s"])]
    kept, left = leave_out(pkgs, ["a"], {"t": None})
    assert [p.name for p in kept] == ["a", "b", "s"]
    assert left == {"t": "the target has it", "n": "needed only by packages the target has"}


def test_platform_tags_cover_older_glibc_and_legacy_aliases():
    tags = platform_tags("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in tags and "manylinux2014_x86_64" in tags
    assert "manylinux_2_29_x86_64" not in tags
    arm = platform_tags("manylinux_2_28_aarch64")
    assert "manylinux2014_aarch64" in arm and "manylinux1_aarch64" not in arm
    with pytest.raises(BundleError):
        platform_tags("win_amd64")


def test_bundle_hub_cache_loads_offline_through_the_real_pull(local_index, tmp_path):
    """A bundle with llama-rope-tiny's checkpoint: its cache is huggingface_hub's layout, the manifest lists
    each file with its hash, and with HF_HUB_OFFLINE=1 the real pull code finds the checkpoint there."""
    from zoo.export import pull as hub
    from zoo.export.hub_cache import hub_environment
    from zoo.policies.llama import unit as llama
    from zoo.contract.recipes import load_recipe

    out = tmp_path / "bundle"
    manifest = build_bundle(out, recipes=["llama-rope-tiny"], python="3.12", weights=True,
                            requirements=["zoofix-dep"], find_links=[str(local_index)], no_index=True, sdist_only={})
    (entry,) = manifest.hub
    assert entry["repo_id"] == "zoo-tiny/llama-rope-tiny" and len(entry["commit"]) == 40
    repo = out / "hub" / "models--zoo-tiny--llama-rope-tiny"
    assert (repo / "refs" / "main").read_text() == entry["commit"]
    names = {Path(f["file"]).name for f in entry["files"]}
    assert {"config.json", "model.safetensors"} <= names
    for record in entry["files"]:
        assert record["sha256"] == sha256(out / record["file"])

    # Pulled as a plain Hub checkpoint (not fabricated), offline, from the bundle's cache only.
    recipe = load_recipe("llama-rope-tiny", ["source.fabricate=false"])
    with hub_environment(out / "hub", offline=True):
        checkpoint = hub.pull(recipe)
        unit = llama.build_unit(checkpoint.path, recipe)
    assert checkpoint.commit == entry["commit"] and checkpoint.offline
    assert checkpoint.path == repo / "snapshots" / entry["commit"]
    assert list(unit.methods) == ["forward"]
    # ...and the same pull against an empty cache is refused, naming the repo and what to do.
    from zoo.core.errors import PullError

    with hub_environment(tmp_path / "empty-cache", offline=True), pytest.raises(PullError, match="llama-rope-tiny"):
        hub.pull(recipe)


def test_tiny_recipes_hub_cache_leaves_room_for_the_wheels_under_60_mb(tmp_path):
    """The three tiny recipes' checkpoints, as a bundle carries them, stay under 9 MB: with the 50.2 MB of
    wheels the H200's CUDA image needs, the bundle stays under its 60 MB budget."""
    from safetensors import safe_open

    from zoo.cli.bundle import add_checkpoints

    hub_dir = tmp_path / "hub"
    entries = add_checkpoints(["llama-rope-tiny", "lingbot-va-tiny", "fast-wam-tiny"], hub_dir)
    total = sum(p.stat().st_size for p in hub_dir.rglob("*") if p.is_file() and not p.is_symlink())
    assert total < 9_000_000, f"tiny Hub cache is {total / 1e6:.1f} MB"
    mains = [e for e in entries if e["repo_id"].startswith("zoo-tiny/")]
    assert len(mains) == 3
    for entry in mains:  # stored bf16, as real checkpoints are (source.fabricate_dtype)
        folder = hub_dir / f"models--{entry['repo_id'].replace('/', '--')}" / "snapshots" / entry["commit"]
        for path in folder.rglob("*.safetensors"):
            with safe_open(str(path), framework="pt") as f:
                dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
            assert dtypes <= {"BF16", "I64", "BOOL"}, (path, dtypes)


def test_a_dependency_with_no_wheel_for_the_target_is_stood_in_and_left_out(tmp_path):
    # Like executorch 1.2.0's coremltools==9.0 on Linux aarch64: required, never imported by zoo, no wheel there.
    index = tmp_path / "index"
    index.mkdir()
    make_wheel(index, "zoofix-runtime", "1.0", ["zoofix-apple==9.0", "zoofix-shared"])
    make_wheel(index, "zoofix-shared", "1.0")
    with pytest.raises(BundleError, match="zoofix-apple"):
        build_bundle(tmp_path / "plain", weights=False, requirements=["zoofix-runtime"], find_links=[str(index)],
                     no_index=True, sdist_only={}, stand_ins={})
    manifest = build_bundle(tmp_path / "bundle", weights=False, requirements=["zoofix-runtime"],
                            find_links=[str(index)], no_index=True, sdist_only={},
                            stand_ins={"zoofix-apple": ("9.0", "its Apple backend")})
    assert sorted(Path(w["file"]).name for w in manifest.wheels) == ["zoofix_runtime-1.0-py3-none-any.whl",
                                                                     "zoofix_shared-1.0-py3-none-any.whl"]
    assert manifest.left_out == {"zoofix-apple": "not used on the target (its Apple backend): resolved against an "
                                                 "empty stand-in of 9.0"}

