"""scripts/build_runtime.sh's sources, on the CPU in seconds: an ExecuTorch tag cloned the way a user clones it, a
source tarball for an offline machine, and the refusals. CMake and ninja are stand-ins that record how they were
called and leave a runner that answers ``--info``: what is checked is which tree the build is pointed at, what the
stamp says it was built from, and that a second call reuses the first; the real build is
tests/test_runtime_cpp.py's (a runner named by $ZOO_ET_RUNNER)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "build_runtime.sh"

FAKE_CMAKE = r"""#!/usr/bin/env bash
echo "$*" >> "$FAKE_CMAKE_LOG"
case "$1" in
  --version) echo "cmake version 3.31.0" ;;
  -S) mkdir -p "$4" ;;
  --build)
    printf '#!/bin/sh\necho "{\\"ok\\": true, \\"executorch_version\\": \\"%s\\", \\"backends\\": []}"\n' \
      "$(cat "$FAKE_ET_VERSION_FILE")" > "$2/zoo_runner"
    chmod +x "$2/zoo_runner"; : > "$2/libzoo_session.so"; echo "[1/1] Linking CXX executable zoo_runner" ;;
esac
"""

pytestmark = pytest.mark.skipif(shutil.which("git") is None or shutil.which("bash") is None,
                                reason="needs git and bash")


def executorch_tree(folder: Path, version: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "CMakeLists.txt").write_text("project(executorch)\n")
    (folder / "version.txt").write_text(version + "\n")
    return folder


@pytest.fixture
def tools(tmp_path):
    """A PATH with stand-in cmake and ninja, and the environment the script reads."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "cmake").write_text(FAKE_CMAKE)
    (bin_dir / "ninja").write_text("#!/bin/sh\nexit 0\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "CMAKE": str(bin_dir / "cmake"),
           "PYTHON": sys.executable, "FAKE_CMAKE_LOG": str(tmp_path / "cmake.log"), "JOBS": "1"}
    env.pop("ZOO_EXECUTORCH_GIT", None)
    return env


def build(env, *args, version_file: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *map(str, args), "--cpu"], capture_output=True, text=True,
                          env={**env, "FAKE_ET_VERSION_FILE": str(version_file)}, timeout=120)


def git(*args, cwd: Path) -> None:
    subprocess.run(["git", "-c", "user.name=zoo", "-c", "user.email=zoo@example.com", *args], cwd=cwd, check=True,
                   capture_output=True)


def test_a_tag_is_cloned_once_as_a_user_clones_it_and_the_build_points_at_the_clone(tmp_path, tools):
    remote = executorch_tree(tmp_path / "remote", "9.9.9")
    git("init", "-q", cwd=remote)
    git("add", ".", cwd=remote)
    git("commit", "-q", "-m", "release", cwd=remote)
    git("tag", "v9.9.9", cwd=remote)
    env = {**tools, "ZOO_EXECUTORCH_GIT": str(remote)}
    out = tmp_path / "out"
    first = build(env, "v9.9.9", out, version_file=remote / "version.txt")
    assert first.returncode == 0, first.stderr
    clone = out / "src" / "executorch"
    assert (clone / "version.txt").read_text() == "9.9.9\n" and (clone / ".git").exists()
    assert "git clone --branch v9.9.9 --recursive" in first.stderr
    configure = [line for line in (tmp_path / "cmake.log").read_text().splitlines() if line.startswith("-S ")]
    assert len(configure) == 1 and f"-DEXECUTORCH_SOURCE_DIR={clone}" in configure[0].split()
    stamp = json.loads((out / "stamp.json").read_text())
    assert stamp["executorch_version"] == "9.9.9" and stamp["source"] == "v9.9.9"
    assert stamp["source_hash"].startswith("git:")
    assert first.stdout.strip().splitlines()[-1] == str(out / "build" / "zoo_runner")
    assert (out / "status").read_text().startswith("ok: built")

    again = build(env, "v9.9.9", out, version_file=remote / "version.txt")
    assert again.returncode == 0, again.stderr
    assert "git clone" not in again.stderr and "reusing" in again.stderr  # no second clone, no second configure
    assert len([line for line in (tmp_path / "cmake.log").read_text().splitlines() if line.startswith("-S ")]) == 1


def stand_in_tarball(tmp_path: Path, version: str):
    """A source tarball of a stand-in ExecuTorch tree at ``version``, as a user makes one for an offline machine."""
    tree = executorch_tree(tmp_path / "pack" / "executorch", version)
    tarball = tmp_path / f"executorch-v{version}-src.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(tree, arcname="executorch")
    return tree, tarball


def test_a_source_tarball_is_unpacked_for_an_offline_machine(tmp_path, tools):
    tree, tarball = stand_in_tarball(tmp_path, "1.2.0")
    out = tmp_path / "out"
    # This stand-in tree lacks the files zoo's 1.2 patch changes: unpacking is what is checked here.
    done = build({**tools, "ZOO_RUNTIME_PATCHES": "none"}, "--tarball", tarball, out,
                 version_file=tree / "version.txt")
    assert done.returncode == 0, done.stderr
    assert (out / "src" / "executorch" / "version.txt").read_text() == "1.2.0\n"
    stamp = json.loads((out / "stamp.json").read_text())
    assert stamp["source_hash"] == "sha256:" + hashlib.sha256(tarball.read_bytes()).hexdigest() + " patches:none"
    assert stamp["executorch_version"] == "1.2.0" and stamp["patches"] == []


def test_a_release_source_its_patch_does_not_fit_is_refused_and_leaves_no_source(tmp_path, tools):
    tree, tarball = stand_in_tarball(tmp_path, "1.2.0")
    out = tmp_path / "out"
    done = build(tools, "--tarball", tarball, out, version_file=tree / "version.txt")
    assert done.returncode == 2
    assert "executorch-1.2-output-leak.patch does not apply" in done.stderr  # the first, in sorted order
    assert not (out / "src").exists() and not (out / "src.tmp").exists()


def test_what_is_not_a_source_is_refused_with_the_ways_to_give_one(tmp_path, tools):
    version = tmp_path / "version.txt"
    version.write_text("0\n")
    missing = build(tools, "--tarball", tmp_path / "nope.tar.xz", tmp_path / "out", version_file=version)
    assert missing.returncode == 2 and "no such file" in missing.stderr
    neither = build(tools, tmp_path / "not-a-tree", tmp_path / "out", version_file=version)
    assert neither.returncode == 2 and "a tag (v1.2.0)" in neither.stderr and "--tarball FILE" in neither.stderr
    extra = build(tools, "--tarball", tmp_path / "nope.tar.xz", "v1.2.0", tmp_path / "out", version_file=version)
    assert extra.returncode == 2 and "usage:" in extra.stderr
    offline = build({**tools, "ZOO_EXECUTORCH_GIT": str(tmp_path / "no-remote")}, "v1.2.0", tmp_path / "out2",
                    version_file=version)
    assert offline.returncode == 2 and "git clone of v1.2.0" in offline.stderr
    assert not (tmp_path / "out2" / "src").exists()  # a failed clone leaves nothing that looks like a source
