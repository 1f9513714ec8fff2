"""The Python side of the ExecuTorch C++ runtime backend (zoo/runtimes/executorch.py, zoo/export/verify_runtimes.py), on the CPU.

A fake zoo_runner (tests/fixtures/fake_zoo_runner.py: the runner's command line and file format, executing the
run folder's exported programs eagerly) stands in for the built binary. The reference is always the eager
module called directly here. What is checked: inputs go over in the METHOD's order, with their dtypes (float32,
int64 indices, bool masks) intact; one process serves every call; state the host carries (an io KV pool) flows
over a sequence, by files or inside the runner (@STEP:OUTPUT); a missing or CPU-only runner, a program that does
not load and a runner that aborts mid-call each fail with a ZooError saying why; backend selection.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zoo.runtimes import executorch as et_runtime
from zoo.core.errors import RecipeError, RuntimeCallFailed, RuntimeNotBuilt
from zoo.export.verify_runtimes import executorch_caller, select_runtimes
from support.modules import PoolWrite  # noqa: E402


class Gather(nn.Module):
    """Mixed input dtypes whose order matters: float32 values, int64 indices, a bool mask."""

    def forward(self, x, idx, mask):
        picked = x[idx] * mask.unsqueeze(-1).to(x.dtype)
        return picked.sum(0) + 0.5, idx.flip(0)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    g = torch.Generator().manual_seed(0)
    x, idx, mask = torch.randn(6, 3, generator=g), torch.tensor([4, 0, 2, 2]), torch.tensor([True, False, True, True])
    torch.export.save(torch.export.export(Gather(), (x, idx, mask)), str(d / "exported.gather.pt2"))
    values, slots, pool = torch.randn(2, 4, generator=g), torch.tensor([1, 3]), torch.zeros(5, 4)
    for name, scale in (("video_step", 1.0), ("action_step", -2.0)):
        torch.export.save(torch.export.export(PoolWrite(scale), (values, slots, pool)), str(d / f"exported.{name}.pt2"))
    (d / "model.pte").write_bytes(b"stands in for the program; the fake runs exported.*.pt2")
    return d


@pytest.fixture(scope="module")
def fake_runner(fake_zoo_runner):
    return fake_zoo_runner


@pytest.fixture(autouse=True)
def _plain_mode(monkeypatch):
    monkeypatch.delenv("FAKE_ZOO_RUNNER_MODE", raising=False)


@pytest.fixture(scope="module")
def session(run_dir, fake_runner):
    """One session for the tests that expect success (each fake process imports torch: seconds on CI)."""
    with et_runtime.RuntimeSession(run_dir / "model.pte", executable=fake_runner) as s:
        yield s


def gather_inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(6, 3, generator=g), torch.randint(0, 6, (4,), generator=g), torch.rand(4, generator=g) > 0.3]


def test_call_matches_eager_with_inputs_in_method_order(session):
    pid = session._proc.pid
    for seed in range(3):
        inputs = gather_inputs(seed)
        got = session.call("gather", inputs)
        want = Gather()(*inputs)
        assert len(got) == 2 and got[1].dtype == torch.int64
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert session.ready["loaded"] == ["action_step", "gather", "video_step"]
    assert session._proc.pid == pid and session._proc.poll() is None  # one process serves every call
    assert not any((session.work_dir / "in").iterdir()) and not any((session.work_dir / "out").iterdir())


def test_method_runner_has_the_aoti_runner_calling_shape(session):
    runner = session.runner("gather")
    inputs = gather_inputs(1)
    assert runner.order == "method"
    assert torch.equal(runner.run(inputs)[0], Gather()(*inputs)[0])


def test_session_summary_on_close(run_dir, fake_runner):
    s = et_runtime.RuntimeSession(run_dir / "model.pte", executable=fake_runner, methods=["gather"])
    s.call("gather", gather_inputs(2))
    work = s.work_dir
    summary = s.close()
    assert summary["ok"] and summary["steps"] == 1 and not work.exists()


def _eager_sequence(steps):
    modules = {"video_step": PoolWrite(1.0), "action_step": PoolWrite(-2.0)}
    pool, outs = torch.zeros(5, 4), []
    for method, values, slots in steps:
        readout, pool = modules[method](values, slots, pool)
        outs.append((readout, pool))
    return outs


def _steps(n: int):
    g = torch.Generator().manual_seed(7)
    return [("video_step" if s % 2 == 0 else "action_step", torch.randn(2, 4, generator=g),
             torch.randperm(5, generator=g)[:2]) for s in range(n)]


def test_pool_carried_by_the_host_over_a_sequence(session):
    steps = _steps(4)
    want = _eager_sequence(steps)
    pool = torch.zeros(5, 4)
    for (method, values, slots), (readout, pool_want) in zip(steps, want):
        readout_got, pool = session.call(method, [values, slots, pool])
        assert torch.equal(readout_got, readout) and torch.equal(pool, pool_want)


def test_run_plan_feeds_outputs_inside_the_runner(run_dir, fake_runner):
    steps = _steps(4)
    want = _eager_sequence(steps)
    plan = [(m, [v, s, torch.zeros(5, 4) if i == 0 else (i - 1, 1)]) for i, (m, v, s) in enumerate(steps)]
    result = et_runtime.run_plan(run_dir / "model.pte", None, plan, executable=fake_runner)
    assert len(result.outputs) == 4 and result.summary["ok"]
    for (readout, pool), got in zip(want, result.outputs):
        assert torch.equal(got[0], readout) and torch.equal(got[1], pool)
    with pytest.raises(ValueError, match="does not come before"):
        et_runtime.run_plan(run_dir / "model.pte", None, [("video_step", [(0, 1)])], executable=fake_runner)


def test_executorch_caller_returns_method_order_outputs_on_the_device(run_dir, fake_runner):
    with executorch_caller(run_dir / "model.pte", run_dir / "absent.ptd", ["gather"], "cpu",
                           executable=fake_runner) as (loaded, call):
        inputs = gather_inputs(3)
        got = call("gather", inputs)
        assert torch.equal(got[1], Gather()(*inputs)[1])
    assert "ExecuTorch runtime 1.2.0-fake" in loaded["describe"] and "CUDA backend" in loaded["describe"]
    assert loaded["load_ms"] == 1.0 and loaded["executorch_version"] == "1.2.0-fake"  # the runner's own figures


def test_no_runner_says_how_to_build_one(run_dir, monkeypatch, tmp_path):
    monkeypatch.delenv(et_runtime.RUNNER_ENV, raising=False)
    with pytest.raises(RuntimeNotBuilt, match="ZOO_ET_RUNNER") as info:
        et_runtime.RuntimeSession(run_dir / "model.pte")
    assert "scripts/build_runtime.sh" in str(info.value)
    not_exe = tmp_path / "zoo_runner"
    not_exe.write_text("")
    monkeypatch.setenv(et_runtime.RUNNER_ENV, str(not_exe))
    with pytest.raises(RuntimeNotBuilt, match="not an executable zoo_runner.*ZOO_ET_RUNNER"):
        et_runtime.find_runner()


def test_the_environment_variable_finds_the_runner(fake_runner, monkeypatch):
    monkeypatch.setenv(et_runtime.RUNNER_ENV, str(fake_runner))
    assert et_runtime.find_runner() == fake_runner
    assert et_runtime.find_runner(fake_runner) == fake_runner


def test_a_portable_build_is_refused_for_cuda_artifacts(run_dir, fake_runner, monkeypatch):
    monkeypatch.setenv("FAKE_ZOO_RUNNER_MODE", "no-cuda")
    with pytest.raises(RuntimeNotBuilt, match="without the CUDA backend"):
        et_runtime.RuntimeSession(run_dir / "model.pte", executable=fake_runner)
    with pytest.raises(RuntimeNotBuilt, match="without the CUDA backend"):
        et_runtime.run_plan(run_dir / "model.pte", None, [], executable=fake_runner)
    assert "portable only" in et_runtime.describe(et_runtime.runner_info(fake_runner))


def test_a_program_that_does_not_load_is_a_clear_failure(run_dir, fake_runner, monkeypatch):
    monkeypatch.setenv("FAKE_ZOO_RUNNER_MODE", "fail-load")
    with pytest.raises(RuntimeCallFailed, match="loading the program: cannot load program") as info:
        et_runtime.RuntimeSession(run_dir / "model.pte", executable=fake_runner)
    assert "forward_so_blob" in str(info.value)  # the runtime's own log line is in the message


def test_a_runner_that_dies_while_loading_leaves_nothing_behind(run_dir, fake_runner, monkeypatch, tmp_path):
    monkeypatch.setenv("FAKE_ZOO_RUNNER_MODE", "abort-on-load")
    monkeypatch.setenv(et_runtime.HANDOVER_ENV, str(tmp_path))
    with pytest.raises(RuntimeCallFailed, match="died while loading the program .killed by signal 6") as info:
        et_runtime.RuntimeSession(run_dir / "model.pte", executable=fake_runner)
    assert "undefined symbol: aoti_torch_dtype_float64" in str(info.value)
    assert not list(tmp_path.glob("zoo-et-*"))


def test_a_runner_that_aborts_mid_call_is_reported_with_its_log(run_dir, fake_runner, monkeypatch):
    monkeypatch.setenv("FAKE_ZOO_RUNNER_MODE", "abort-on-call")
    session = et_runtime.RuntimeSession(run_dir / "model.pte", executable=fake_runner)
    with pytest.raises(RuntimeCallFailed, match="died while running gather") as info:
        session.call("gather", gather_inputs(0))
    assert "signal 6" in str(info.value) and "AOTInductorModelContainerRun failed" in str(info.value)
    session.close()
    assert not session.work_dir.exists()


class _Statvfs:
    def __init__(self, free_bytes):
        self.f_bavail, self.f_frsize = free_bytes // 4096, 4096


def test_hand_over_files_go_to_ram_only_with_room_to_spare(monkeypatch, tmp_path):
    monkeypatch.delenv(et_runtime.HANDOVER_ENV, raising=False)
    monkeypatch.setattr(et_runtime, "RAM_FOLDER", tmp_path)
    monkeypatch.setattr(et_runtime.os, "statvfs", lambda path: _Statvfs(64 << 20))  # a container's default /dev/shm
    assert et_runtime.handover_root() is None
    monkeypatch.setattr(et_runtime.os, "statvfs", lambda path: _Statvfs(8 << 30))
    assert et_runtime.handover_root() == str(tmp_path)
    assert et_runtime.handover_root(need_bytes=5 << 30) is None  # a plan's inputs would leave under 4 GiB free
    monkeypatch.setattr(et_runtime, "RAM_FOLDER", tmp_path / "absent")
    monkeypatch.setattr(et_runtime.os, "statvfs", lambda path: (_ for _ in ()).throw(FileNotFoundError(path)))
    assert et_runtime.handover_root() is None
    monkeypatch.setenv(et_runtime.HANDOVER_ENV, str(tmp_path / "chosen"))
    assert et_runtime.handover_root(need_bytes=1 << 40) == str(tmp_path / "chosen")


def test_a_session_writes_its_files_under_the_chosen_folder(run_dir, fake_runner, monkeypatch, tmp_path):
    monkeypatch.setenv(et_runtime.HANDOVER_ENV, str(tmp_path))
    with et_runtime.RuntimeSession(run_dir / "model.pte", executable=fake_runner) as s:
        assert s.work_dir.parent == tmp_path.resolve()
        x, idx, mask = gather_inputs(3)
        got, _ = s.call("gather", [x, idx, mask])
        torch.testing.assert_close(got, Gather()(x, idx, mask)[0])
    assert not list(tmp_path.iterdir())  # closed: its folder is gone


def test_a_missing_method_is_a_clear_failure(run_dir, fake_runner):
    with et_runtime.RuntimeSession(run_dir / "model.pte", executable=fake_runner, methods=["gather"]) as session:
        with pytest.raises(RuntimeCallFailed, match="video_step is not loaded"):
            session.call("video_step", [torch.zeros(2, 4), torch.tensor([0, 1]), torch.zeros(5, 4)])


def test_a_missing_program_file(tmp_path, fake_runner):
    with pytest.raises(RuntimeCallFailed, match="model.pte is missing"):
        et_runtime.RuntimeSession(tmp_path / "model.pte", executable=fake_runner)


@pytest.mark.parametrize("choice, want", [
    ("aoti", ("aoti",)), ("executorch", ("executorch",)), ("both", ("aoti", "executorch")),
    (["executorch", "aoti"], ("aoti", "executorch")), (["aoti", "aoti"], ("aoti",)),
])
def test_select_runtimes(choice, want):
    assert select_runtimes(choice) == want


@pytest.mark.parametrize("choice", ["tensorrt", [], ["aoti", "onnx"]])
def test_select_runtimes_refuses_unknown_names(choice):
    with pytest.raises(RecipeError):
        select_runtimes(choice)
