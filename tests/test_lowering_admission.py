"""zoo.export.lower.admission: lowering workers claim their memory in a ledger every zoo process of the machine
shares, and start only when their estimate fits in what the running workers have not been promised. The rule and
the ledger with hand-worked numbers; then two lowering processes side by side (the real ``lower_in_workers``)
where the machine holds one worker: the second waits, says so, and both finish with the single run's bytes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from zoo.core.errors import LoweringError
from zoo.export.lower import admission, workers
from zoo.export.lower.admission import Claim, Gate, Ledger, admits

from support.environment import FIXTURES
from support.two_methods import programs

G = 1 << 30
FUNCTION = "portable_lowering:lower_portable"
LINUX = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the ledger tells live pids by /proc")


def test_the_rule_with_hand_worked_numbers():
    # 100 GiB available; a worker claimed 40 GiB and uses 10 GiB of it: 30 GiB still to come, 70 GiB of room.
    assert admits(70 * G, 100 * G, [(40 * G, 10 * G)]) == (True, 70 * G)
    assert admits(71 * G, 100 * G, [(40 * G, 10 * G)]) == (False, 70 * G)
    # A worker past its estimate takes nothing more than MemAvailable already shows.
    assert admits(90 * G, 100 * G, [(40 * G, 55 * G)]) == (True, 100 * G)
    # Two claims: 100 - (30 + 20) = 50.
    assert admits(51 * G, 100 * G, [(40 * G, 10 * G), (20 * G, 0)]) == (False, 50 * G)
    # Alone, a worker starts whatever the machine has (as choose_workers starts at least one).
    assert admits(500 * G, 1 * G, []) == (True, 1 * G)
    # No figure for the machine: nothing to judge by.
    assert admits(500 * G, None, [(40 * G, 0)]) == (True, None)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _write_claim(folder: Path, **fields) -> Path:
    claim = Claim(**{"id": "other", "owner": os.getpid(), "owner_start": admission.process_start(os.getpid()),
                     "need": 40 * G, "method": "step", "run": "/runs/other", **fields})
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{claim.id}.json"
    path.write_text(json.dumps(claim.__dict__))
    return path


@LINUX
def test_the_ledger_counts_live_claims_less_what_their_workers_use(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        uses = {sleeper.pid: 10 * G}
        ledger = Ledger(tmp_path / "ledger", available=lambda: 100 * G, in_use=lambda pid: uses.get(pid, 0))
        first = ledger.try_claim("a", 40 * G, "/runs/one")
        assert first.admitted and first.held == []
        ledger.started(first.claim, sleeper.pid)
        assert not ledger.try_claim("b", 71 * G, "/runs/two").admitted  # 100 - (40 - 10) = 70
        second = ledger.try_claim("b", 70 * G, "/runs/two")
        assert second.admitted and second.room == 70 * G
        assert sorted(c.method for c in ledger.live_claims()) == ["a", "b"]
        ledger.release(second.claim)
        ledger.release(first.claim)
        assert ledger.live_claims() == [] and not list((tmp_path / "ledger").glob("*.json"))
    finally:
        sleeper.kill()
        sleeper.wait()


@LINUX
def test_a_stale_claim_is_ignored_and_removed_and_a_lone_worker_always_starts(tmp_path):
    folder = tmp_path / "ledger"
    dead = _write_claim(folder, id="dead", owner=_dead_pid(), owner_start=None, need=1000 * G)
    reused = _write_claim(folder, id="reused", owner_start=1)  # this pid, but a process that started at tick 1
    ledger = Ledger(folder, available=lambda: 1 * G, in_use=lambda pid: 0)
    verdict = ledger.try_claim("a", 50 * G, "/runs/one")  # 50 GiB on a 1 GiB machine: alone, it starts
    assert verdict.admitted and verdict.held == []
    assert not dead.exists() and not reused.exists()
    # A claim whose zoo process lives but whose worker has ended is not counted (its memory is free) nor removed.
    ended = _write_claim(folder, id="ended", worker=_dead_pid(), worker_start=None, need=1000 * G)
    assert [c.id for c in ledger.live_claims()] == [verdict.claim.id] and ended.exists()
    # The 50 GiB claim, not yet started, counts whole: 1 GiB more does not fit beside it.
    assert not ledger.try_claim("b", 1 * G, "/runs/two").admitted
    ledger.release(verdict.claim)
    assert ledger.try_claim("b", 1 * G, "/runs/two").admitted


@LINUX
def test_the_waiting_line_names_who_holds_what_and_what_is_needed(tmp_path):
    folder = tmp_path / "ledger"
    _write_claim(folder, worker=os.getpid(), worker_start=admission.process_start(os.getpid()))
    ledger = Ledger(folder, available=lambda: 48 * G, in_use=lambda pid: 8 * G)
    lines = []
    gate = Gate("/runs/two", lines.append, ledger=ledger, every_s=60, retry_s=0)
    assert not gate.enter("forward", 20 * G) and not gate.enter("forward", 20 * G)
    assert lines == [f"lowering forward waits for memory: it needs ~20.0 GiB and 16.0 GiB of the 48.0 GiB available "
                     f"are not promised to the lowering workers running: zoo process {os.getpid()} lowering step "
                     f"(worker {os.getpid()}) for /runs/other: 40.0 GiB claimed, 8.0 GiB in use. It starts when "
                     f"they have ended or freed enough"]  # once: the next line comes every_s later
    ledger._in_use = lambda pid: 30 * G  # the other worker now holds 30 GiB: 48 - 10 = 38 GiB of room
    assert gate.enter("forward", 20 * G)
    assert lines[-1].startswith("lowering forward: the memory it needs is free after ")
    assert gate.enter("encode", None) and len(ledger.live_claims()) == 2  # no estimate: no claim
    gate.leave_all()
    assert [c.id for c in ledger.live_claims()] == ["other"]


def test_the_memory_figure_and_the_folder_can_be_set(monkeypatch, tmp_path):
    monkeypatch.setenv(admission.ENV_MEMORY, str(12 * G))
    assert admission.available_memory_bytes() == workers.available_memory_bytes() == 12 * G
    monkeypatch.setenv(admission.ENV_MEMORY, "12G")
    with pytest.raises(LoweringError, match="not a whole number of bytes"):
        admission.available_memory_bytes()
    monkeypatch.setenv(admission.ENV_LEDGER_DIR, str(tmp_path / "mine"))
    assert admission.ledger_folder() == tmp_path / "mine"
    monkeypatch.delenv(admission.ENV_LEDGER_DIR)
    assert admission.ledger_folder().name.startswith("zoo-lowering-")


def test_a_ledger_folder_of_another_user_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(admission.os, "getuid", lambda: os.stat(tmp_path).st_uid + 1)
    with pytest.raises(LoweringError, match="belongs to another user") as info:
        Ledger(tmp_path).live_claims()
    assert admission.ENV_LEDGER_DIR in info.value.hint


def _saved_job(folder: Path, method: str, **options) -> workers.MethodJob:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{method}.pt2"
    torch.export.save(programs()[method], path)
    return workers.MethodJob(method, path, options, memory_bytes=8 * G)


@LINUX
def test_in_process_lowering_waits_for_another_lowering_and_a_killed_one_blocks_nothing(monkeypatch, tmp_path):
    # Another zoo process holds 8 GiB of a 12 GiB machine; it is killed (SIGKILL) part way: its claim is stale.
    monkeypatch.setenv(admission.ENV_LEDGER_DIR, str(tmp_path / "ledger"))
    monkeypatch.setenv(admission.ENV_MEMORY, str(12 * G))
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    _write_claim(tmp_path / "ledger", owner=other.pid, owner_start=admission.process_start(other.pid), need=8 * G)
    job = _saved_job(tmp_path / "programs", "b")  # before the clock starts: saving can take seconds on a busy CPU
    killed_at = []

    def kill():
        time.sleep(3.0)
        killed_at.append(time.time())
        other.send_signal(signal.SIGKILL)
        other.wait()

    killer = threading.Thread(target=kill)
    killer.start()
    lines = []
    try:
        parts = workers.lower_in_process([job], FUNCTION, tmp_path / "here",
                                         pythonpath=[str(FIXTURES)], say=lines.append, run=tmp_path / "run")
    finally:
        killer.join()
    assert lines[0].startswith("lowering b waits for memory: it needs ~8.0 GiB and 4.0 GiB of the 12.0 GiB")
    assert f"zoo process {other.pid} lowering step" in lines[0]
    assert parts["b"].record["began"] > killed_at[0] and parts["b"].pte.is_file()
    assert Ledger(tmp_path / "ledger").live_claims() == [] and not list((tmp_path / "ledger").glob("*.json"))


_LOWERING = """
import json, sys
from pathlib import Path
from zoo.export.lower import workers
method, program, options, work, fixtures = sys.argv[1:]
job = workers.MethodJob(method, Path(program), json.loads(options), memory_bytes=8 << 30)
parts = workers.lower_in_workers([job], "portable_lowering:lower_portable", Path(work), max_workers=1,
                                 env={"PYTHONPATH": fixtures}, say=lambda line: print(line, flush=True),
                                 poll_s=0.1, run=Path(work).parent)
print("PART " + json.dumps({"pte": str(parts[method].pte), "record": parts[method].record}), flush=True)
"""


class Lowering:
    """A zoo process lowering one method with the real ``lower_in_workers``; its stdout lines, as they come."""

    def __init__(self, tmp: Path, method: str, options: dict, env: dict):
        program = tmp / "programs" / f"{method}.pt2"
        self.process = subprocess.Popen(
            [sys.executable, "-c", _LOWERING, method, str(program), json.dumps(options), str(tmp / method / "work"),
             str(FIXTURES)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines = []
        self._reader = threading.Thread(target=self._read)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)

    def wait_for(self, check, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not check() and time.monotonic() < deadline and self.process.poll() is None:
            time.sleep(0.1)
        assert check(), f"{what} never came:\n" + "".join(self.lines)

    def finish(self, timeout: float = 120) -> dict:
        assert self.process.wait(timeout) == 0, "".join(self.lines)
        self._reader.join()
        return json.loads(next(line for line in self.lines if line.startswith("PART "))[5:])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._reader.join()


@LINUX
def test_two_lowerings_side_by_side_the_second_waits_for_the_first_and_both_finish(tmp_path):
    # 12 GiB for lowerings, 8 GiB per worker: one fits. The first worker holds on until the test has seen the
    # second lowering wait (it waits for a file named "go"), so the second must find it running.
    for method in ("a", "b"):
        _saved_job(tmp_path / "programs", method)
    reference = workers.lower_in_process([_saved_job(tmp_path / "ref-programs", m) for m in ("a", "b")], FUNCTION,
                                         tmp_path / "reference", pythonpath=[str(FIXTURES)], say=lambda line: None)
    rendezvous = tmp_path / "rendezvous"
    rendezvous.mkdir()
    env = {**os.environ, admission.ENV_LEDGER_DIR: str(tmp_path / "ledger"), admission.ENV_MEMORY: str(12 * G)}
    first = Lowering(tmp_path, "a", {"rendezvous": str(rendezvous), "rendezvous_with": ["go"]}, env)
    second = None
    try:
        first.wait_for(lambda: (rendezvous / "a").exists(), 90, "the first lowering's worker")
        second = Lowering(tmp_path, "b", {}, env)
        second.wait_for(lambda: any("waits for memory" in line for line in second.lines), 90, "the waiting line")
        (rendezvous / "go").write_text("")
        got_a, got_b = first.finish(), second.finish()
    finally:
        first.stop()
        if second is not None:
            second.stop()
    waiting = next(line for line in second.lines if "waits for memory" in line)
    assert "lowering b waits for memory: it needs ~8.0 GiB" in waiting
    assert f"zoo process {first.process.pid} lowering a (worker {int((rendezvous / 'a').read_text())})" in waiting
    assert f"for {tmp_path / 'a'}: 8.0 GiB claimed" in waiting
    assert any(line.startswith("lowering b: the memory it needs is free after") for line in second.lines)
    assert not any("waits for memory" in line for line in first.lines)
    # The second worker started after the first had ended: no two lowered at once.
    assert got_a["record"]["saw"] == ["go"] and got_b["record"]["began"] > got_a["record"]["ended"]
    for method, got in (("a", got_a), ("b", got_b)):
        assert Path(got["pte"]).read_bytes() == reference[method].pte.read_bytes()
    assert Ledger(tmp_path / "ledger").live_claims() == []


class _Captured(Exception):
    """Raised by the stand-in lowering once it has the jobs: nothing is lowered."""


@pytest.mark.parametrize("count", [2, 1])
def test_lower_to_pte_claims_each_method_s_estimate_for_its_run(monkeypatch, tmp_path, count):
    # Side by side (2) and in this process (1): every job carries its method's estimate, and names the run.
    from types import SimpleNamespace

    from aoti_cpu_probe import PROBE_LOWERING
    from zoo.export.lower import lowering

    seen = {}

    def capture(jobs, function, work_dir, **kwargs):
        seen.update(jobs={job.method: job.memory_bytes for job in jobs}, run=kwargs.get("run"))
        raise _Captured

    monkeypatch.setattr(lowering, "lower_in_workers", capture)
    monkeypatch.setattr(lowering, "lower_in_process", capture)
    recipe = SimpleNamespace(lowering=SimpleNamespace(target=None, workers=None, triton_kernel_mode="OFF",
                                                      max_mm_configs=None, runtime=None, gemm="triton"))
    with pytest.raises(_Captured):
        lowering.lower_to_pte(programs(), tmp_path / "run", recipe, workers=count, method_lowering=PROBE_LOWERING,
                              run_preflight=False, say=lambda line: None)
    carried = lowering.plan_tables(programs()).carried
    assert seen["jobs"] == {m: 4 * carried[m] + (2 << 30) for m in ("a", "b")} and min(carried.values()) > 0
    assert seen["run"] == tmp_path / "run"
