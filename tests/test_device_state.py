"""State kept in ExecuTorch's runtime between calls (zoo_runner protocol 2), the Python side, on the CPU.

The fake zoo_runner (tests/fixtures/fake_zoo_runner.py) follows the runner's ownership rule: an output kept under a
name belongs to the call that made it, which ExecuTorch 1.2 frees when the same method runs again (the fake fills
freed outputs with NaN); before such a call a named value it would free and does not replace is copied
("rescued"). The reference is the eager modules chained by hand. Checked: a pool kept under the name it comes back
in goes from call to call with no copy; a value the next call would free is copied first and keeps its value; a
stale handle, a runner without the protocol and a runner of another release are refused; run_plan writes named
values, not file round trips; the runtime requirement is read, inferred for older runs, and validated.
"""

from __future__ import annotations

import json

import pytest
import torch

from zoo.runtimes import executorch as et_runtime
from zoo.core.errors import RuntimeCallFailed, RuntimeMismatch, RuntimeNotBuilt, ZooError
from zoo.contract.run_folder import RunFolder
from zoo.contract.releases import RuntimeRequirement, lowering_requirement, requirement_for
from support.modules import PoolWrite

SCALES = {"video_step": 1.0, "action_step": -2.0}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("state-run")
    values, slots, pool = torch.randn(2, 4), torch.tensor([1, 3]), torch.zeros(5, 4)
    for name, scale in SCALES.items():
        torch.export.save(torch.export.export(PoolWrite(scale), (values, slots, pool)), str(d / f"exported.{name}.pt2"))
    (d / "model.pte").write_bytes(b"stands in for the program; the fake runs exported.*.pt2")
    return d


@pytest.fixture(autouse=True)
def _plain(monkeypatch):
    monkeypatch.delenv("FAKE_ZOO_RUNNER_MODE", raising=False)
    monkeypatch.delenv("FAKE_ZOO_RUNNER_VERSION", raising=False)


NEED = RuntimeRequirement("1.2", "1.2.0", {m: {"inputs": [False] * 3, "outputs": [False] * 2} for m in SCALES})


@pytest.fixture(scope="module")
def session(run_dir, fake_zoo_runner):
    with et_runtime.RuntimeSession(run_dir / "model.pte", executable=fake_zoo_runner, requirement=NEED) as s:
        yield s


def _calls(n: int, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [("video_step" if i % 2 == 0 else "action_step", torch.randn(2, 4, generator=g),
             torch.randperm(5, generator=g)[:2]) for i in range(n)]


def _by_hand(calls):
    """Each call's readout and pool, worked from the definition: rows of the pool at ``slots`` replaced."""
    pool, out = torch.zeros(5, 4), []
    for method, values, slots in calls:
        pool = pool.clone()
        pool[slots] = values * SCALES[method]
        out.append((pool.sum(1), pool))
    return out


def test_a_pool_kept_under_its_input_name_goes_from_call_to_call_without_a_copy(session):
    before = dict(session.stats)
    calls = _calls(5)
    pool = session.zeros("pool", (5, 4), torch.float32)
    assert pool.on_device and pool.shape == (5, 4) and pool.dtype == "float32"
    for (method, values, slots), (readout, want) in zip(calls, _by_hand(calls)):
        got, pool = session.call(method, [values, slots, pool], keep={1: "pool"})
        assert isinstance(pool, et_runtime.DeviceValue) and pool.name == "pool"
        assert torch.equal(got, readout)  # the readout came back, the pool did not
    assert torch.equal(pool.fetch(), _by_hand(calls)[-1][1])
    assert session.stats["calls"] - before["calls"] == 5
    assert session.stats["rescued"] == before["rescued"] and session.stats["host_copies"] == before["host_copies"]
    # zeros again on a held value of that shape: zero, and still usable
    pool = session.zeros("pool", (5, 4), torch.float32)
    assert torch.equal(pool.fetch(), torch.zeros(5, 4))


def test_a_call_says_where_its_time_went(session):
    (method, values, slots), = _calls(1, seed=3)
    pool = session.zeros("pool", (5, 4), torch.float32)
    session.call(method, [values, slots, pool], keep={1: "pool"})
    split = session.last_call
    # The fake runner reports 1.0 ms executing and 0.0 ms binding; the rest was measured around the pipe.
    assert (split.execute, split.runtime_io) == (1.0, 0.0)
    assert min(split.write, split.pipe, split.read) >= 0.0
    assert split.total == pytest.approx(split.write + 1.0 + split.pipe + split.read)


def test_the_pipe_is_the_round_trip_less_what_the_runner_reports():
    # Sent at 10 ms, answered at 14.5 ms, of which the runner executed 3.0 ms and bound and copied 0.5 ms.
    split = et_runtime._timing({"ms": 3.0, "io_ms": 0.5}, started=0.009, sent=0.010, answered=0.0145, done=0.0150)
    assert split.write == pytest.approx(1.0) and split.read == pytest.approx(0.5)
    assert (split.execute, split.runtime_io) == (3.0, 0.5) and split.pipe == pytest.approx(1.0)
    # A runner that reports more than the round trip (clocks of two processes) gives no negative pipe.
    assert et_runtime._timing({"ms": 5.0}, 0.0, 0.0, 0.001, 0.001).pipe == 0.0


def test_a_value_the_next_call_would_free_is_copied_first(session):
    (m, v1, s1), (_, v2, s2) = _calls(2, seed=9)
    start = session.zeros("start", (5, 4), torch.float32)
    _, first = session.call("video_step", [v1, s1, start], keep={1: "first"})
    rescued = session.stats["rescued"]
    # a second video_step frees the first one's outputs; "first" is still held and not replaced by this call
    _, second = session.call("video_step", [v2, s2, first], keep={1: "second"})
    assert session.stats["rescued"] == rescued + 1
    want_first = torch.zeros(5, 4)
    want_first[s1] = v1
    want_second = want_first.clone()
    want_second[s2] = v2
    assert torch.equal(first.fetch(), want_first) and torch.equal(second.fetch(), want_second)
    # replaced by the call that frees it (or dropped before it): nothing to copy
    session.drop("first", "start")
    session.call("video_step", [v1, s1, second], keep={1: "second"})
    assert session.stats["rescued"] == rescued + 1
    session.drop("second")


def test_a_replaced_value_is_refused(session):
    (m, v, s), = _calls(1)
    old = session.zeros("slot", (5, 4), torch.float32)
    session.zeros("slot", (5, 4), torch.float32)
    with pytest.raises(RuntimeCallFailed, match=r"replaced by a later value of slot"):
        session.call(m, [v, s, old], keep={1: "slot"})
    with pytest.raises(RuntimeCallFailed, match="is not a name the runner takes"):
        session.call(m, [v, s, torch.zeros(5, 4)], keep={1: "two words"})


def test_an_input_the_artifact_plans_crosses_to_the_host_and_is_counted(run_dir, fake_zoo_runner, monkeypatch):
    monkeypatch.setenv("FAKE_ZOO_RUNNER_MODE", "planned")
    calls = _calls(3)
    with et_runtime.RuntimeSession(run_dir / "model.pte", executable=fake_zoo_runner) as s:
        assert s.ready["memory_planned"]["video_step"]["inputs"] == [True, True, True]
        pool = s.zeros("pool", (5, 4), torch.float32)
        for (method, values, slots), (readout, _) in zip(calls, _by_hand(calls)):
            got, pool = s.call(method, [values, slots, pool], keep={1: "pool"})
            assert torch.equal(got, readout)
        assert s.stats["host_copies"] == 3


def test_a_runner_without_named_values_is_refused_for_them(run_dir, fake_zoo_runner, monkeypatch):
    monkeypatch.setenv("FAKE_ZOO_RUNNER_MODE", "protocol1")
    (m, v, sl), = _calls(1)
    with pytest.raises(RuntimeNotBuilt, match="protocol 1; a plan that hands outputs to later calls needs protocol 2"):
        et_runtime.run_plan(run_dir / "model.pte", None, [(m, [v, sl, torch.zeros(5, 4)]), (m, [v, sl, (0, 1)])],
                            executable=fake_zoo_runner)


def test_a_runner_of_another_release_is_refused(run_dir, fake_zoo_runner, monkeypatch):
    monkeypatch.setenv("FAKE_ZOO_RUNNER_VERSION", "1.4.0")
    with pytest.raises(RuntimeMismatch, match=r"needs ExecuTorch's runtime 1.2 .*zoo_runner is ExecuTorch 1.4.0") as e:
        et_runtime.RuntimeSession(run_dir / "model.pte", executable=fake_zoo_runner, requirement=NEED)
    assert "scripts/build_runtime.sh v1.2.0 build/runtime" in e.value.hint
    assert isinstance(e.value, RuntimeNotBuilt)  # a caller that handles "no runtime" handles this one too
    with pytest.raises(RuntimeMismatch):
        et_runtime.run_plan(run_dir / "model.pte", None, [], executable=fake_zoo_runner, requirement=NEED)
    NEED.check({"executorch_version": "1.2.1"})  # another patch release of the line is the same runtime


def test_run_plan_hands_outputs_over_as_named_values(run_dir, fake_zoo_runner, tmp_path):
    calls = _calls(4)
    plan = [(m, [v, s, torch.zeros(5, 4) if i == 0 else (i - 1, 1)]) for i, (m, v, s) in enumerate(calls)]
    result = et_runtime.run_plan(run_dir / "model.pte", None, plan, executable=fake_zoo_runner,
                                 keep_dir=tmp_path / "plan")
    for (readout, pool), got in zip(_by_hand(calls), result.outputs):
        assert torch.equal(got[0], readout) and torch.equal(got[1], pool)
    text = (tmp_path / "plan" / "plan.txt").read_text()
    assert "$r2_1" in text and "keep:r2_1" in text and "drop r1_1" in text and "@" not in text
    assert result.summary["rescued"] == 0 and result.summary["host_copies"] == 0
    assert [r["device"][1] for r in result.replies[:-1]] == [True, True, True]  # each handed-over pool stayed


def test_the_requirement_round_trips_and_a_damaged_one_is_refused(tmp_path):
    need = lowering_requirement("1.2.0+cu130", {"m": {"inputs": [False, False], "outputs": [False]}})
    assert need.release == "1.2" and need.lowered_with == "1.2.0" and need.device_io
    assert RuntimeRequirement.from_dict(json.loads(json.dumps(need.as_dict()))) == need
    planned = lowering_requirement("1.2.0", {"m": {"inputs": [True, False], "outputs": [False]}})
    assert not planned.device_io and planned.planned_inputs("m") == [True, False]
    with pytest.raises(ZooError, match="runtime.json is not a runtime requirement"):
        RuntimeRequirement.from_dict({"release": "1.2"})


def test_the_requirement_of_a_run_lowered_before_runtime_json_is_inferred(tmp_path):
    run = RunFolder(tmp_path)
    (tmp_path / "model.pte").write_bytes(b"x")
    (tmp_path / "report.json").write_text(json.dumps({"status": "passed", "stages": [],
                                                      "lowering": {"options": {"executorch": "1.2.0"}}}))
    seen = []
    need = requirement_for(run, lambda pte: seen.append(pte) or {"m": {"inputs": [True], "outputs": [True]}})
    assert need.inferred and need.release == "1.2" and not need.device_io and seen == [run.pte]
    run.write_runtime_requirement(lowering_requirement("1.4.0", {}).as_dict())
    assert requirement_for(run, None) == RuntimeRequirement("1.4", "1.4.0", {}, False)


def test_a_held_input_is_uploaded_once_while_its_content_stays_the_same(session, monkeypatch):
    """``ExecuTorchBackend.hold``: a host loop's fixed input (a prompt's embedding) goes to the runner once and is
    passed by name while equal; changed content is uploaded again, another shape is held under another name."""
    from zoo.runner.backends import ExecuTorchBackend

    uploads = []
    upload = session.upload
    monkeypatch.setattr(session, "upload", lambda name, tensor: uploads.append(name) or upload(name, tensor))
    backend = ExecuTorchBackend.__new__(ExecuTorchBackend)  # the hold logic alone, over the module's session
    backend.session, backend._held = session, {}
    try:
        emb = torch.randn(2, 4)
        first = backend.hold("emb", emb)
        assert backend.hold("emb", emb.clone()) is first and len(uploads) == 1
        changed = backend.hold("emb", emb + 1)
        assert len(uploads) == 2 and torch.equal(changed.fetch(), emb + 1)
        other = backend.hold("emb", torch.ones(1, 4))
        assert len(uploads) == 3 and other.name != changed.name and torch.equal(changed.fetch(), emb + 1)
    finally:
        backend.session = None  # the session belongs to the fixture
