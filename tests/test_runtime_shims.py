"""Which runtime serves the compiled code's aoti_torch_* names in a process (zoo.runtimes.shims), and the
in-process runtime's refusals that need no built library: hand-worked cases, no GPU."""

from __future__ import annotations

import pytest

from zoo.core.errors import RunnerError, RuntimeCallFailed, RuntimeConflict, RuntimeNotBuilt
from zoo.runner.backends import InProcessBackend
from zoo.runtimes import inprocess, shims


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(shims, "_owner", None)
    monkeypatch.setattr(shims, "_global_has", lambda symbol: False)
    return monkeypatch


def test_each_runtime_claims_once_and_the_other_is_refused(fresh):
    shims.claim(shims.LIBTORCH)
    shims.claim(shims.LIBTORCH)  # again: the same owner
    with pytest.raises(RuntimeConflict) as e:
        shims.claim(shims.EXECUTORCH)
    assert "already serves the aoti_torch_* names from libtorch" in str(e.value)
    assert "zoo_runner, a process of its own" in e.value.hint
    fresh.setattr(shims, "_owner", None)
    shims.claim(shims.EXECUTORCH)
    with pytest.raises(RuntimeConflict, match="from ExecuTorch's CUDA shims"):
        shims.claim(shims.LIBTORCH)


def test_names_made_global_before_zoo_was_asked_are_libtorchs(fresh):
    fresh.setattr(shims, "_global_has", lambda symbol: symbol == shims.PROBE)
    with pytest.raises(RuntimeConflict, match="from libtorch"):
        shims.claim(shims.EXECUTORCH)
    assert shims.owner() == shims.LIBTORCH


def test_a_library_that_fails_to_load_leaves_the_names_unclaimed(fresh, tmp_path):
    fake = tmp_path / inprocess.LIBRARY_NAME
    fake.write_bytes(b"not an ELF file")
    fresh.setattr(inprocess, "_lib", None)
    with pytest.raises(RuntimeNotBuilt, match="does not load"):
        inprocess.load_library(fake)
    assert shims.owner() is None


def test_a_second_library_in_one_process_is_refused(monkeypatch, tmp_path):
    loaded, other = tmp_path / "a" / inprocess.LIBRARY_NAME, tmp_path / "b" / inprocess.LIBRARY_NAME
    held = object()  # stands for the CDLL: the refusal comes before anything is loaded
    monkeypatch.setattr(inprocess, "_lib", held)
    monkeypatch.setattr(inprocess, "_lib_path", loaded.resolve())
    with pytest.raises(RuntimeConflict) as e:
        inprocess.load_library(other)
    assert f"already loaded {loaded}" in str(e.value) and "another process" in e.value.hint
    assert inprocess.load_library(loaded) is held
    assert inprocess.load_library() is held


def test_finding_the_library(monkeypatch, tmp_path):
    monkeypatch.delenv(inprocess.LIBRARY_ENV, raising=False)
    monkeypatch.delenv("ZOO_ET_RUNNER", raising=False)
    with pytest.raises(RuntimeNotBuilt, match=f"set {inprocess.LIBRARY_ENV}"):
        inprocess.find_library()
    monkeypatch.setenv("ZOO_ET_RUNNER", str(tmp_path / "zoo_runner"))
    with pytest.raises(RuntimeNotBuilt, match=f"{tmp_path / inprocess.LIBRARY_NAME} is not a built"):
        inprocess.find_library()
    (tmp_path / inprocess.LIBRARY_NAME).write_bytes(b"")
    assert inprocess.find_library() == tmp_path / inprocess.LIBRARY_NAME


def test_the_in_process_backend_needs_a_gpu():
    with pytest.raises(RunnerError, match="runs the compiled CUDA kernels; device 'cpu' cannot"):
        InProcessBackend(None, "cpu", [])


def test_the_in_process_runtime_runs_on_device_0(monkeypatch, tmp_path):
    monkeypatch.setattr(inprocess, "load_library", lambda library=None: None)
    monkeypatch.setattr(inprocess, "library_build", lambda library=None: {"cuda": True})
    with pytest.raises(RuntimeCallFailed, match="runs on cuda:0, not cuda:1") as e:
        inprocess.InProcessSession(tmp_path / "model.pte", device="cuda:1")
    assert "CUDA_VISIBLE_DEVICES" in e.value.hint


def test_an_artifact_of_another_release_is_refused_before_loading(monkeypatch, tmp_path):
    from zoo.contract.releases import RuntimeRequirement
    from zoo.core.errors import RuntimeMismatch

    library = tmp_path / inprocess.LIBRARY_NAME
    library.write_bytes(b"")
    monkeypatch.setattr(inprocess, "load_library", lambda library=None: None)
    monkeypatch.setattr(inprocess, "library_build", lambda library=None: {"executorch_version": "1.2.0"})
    with pytest.raises(RuntimeMismatch, match=r"needs ExecuTorch's runtime 1\.4 .* is ExecuTorch 1\.2\.0"):
        inprocess.InProcessSession(tmp_path / "model.pte", library=library, device="cpu",
                                   requirement=RuntimeRequirement(release="1.4", lowered_with="1.4.0"))
