"""zoo.export.lower.workers: methods lowered in separate worker processes (side by side) and assembled give the
outputs of the sequential program and of eager PyTorch; a worker's failure fails the lowering with its method's
error. The injected lowering is ExecuTorch's portable flow (tests/fixtures/portable_lowering.py)."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

from zoo.export.lower import workers
from zoo.core.errors import LoweringError, StorageError
from zoo.export.lower.workers import MethodJob

from support.environment import FIXTURES
from support.two_methods import CALLS, eager_calls, programs, run_calls, write

FUNCTION = "portable_lowering:lower_portable"
ENV = {"PYTHONPATH": str(FIXTURES)}


def saved_jobs(folder: Path, options_for):
    folder.mkdir(parents=True, exist_ok=True)
    jobs = []
    for method, ep in programs().items():
        path = folder / f"rewritten.{method}.pt2"
        torch.export.save(ep, path)
        jobs.append(MethodJob(method=method, program=path, options=options_for(method)))
    return jobs


@pytest.fixture(scope="module")
def parallel(tmp_path_factory):
    """Both methods lowered at once (each worker waits to see the other start) and assembled."""
    root = tmp_path_factory.mktemp("workers")
    (root / "rendezvous").mkdir()
    lines = []

    def options(method):
        return {"init_buffers": ["count"], "external_constants": True, "rendezvous": str(root / "rendezvous"),
                "rendezvous_with": [m for m in ("a", "b") if m != method]}

    assembled, parts = workers.lower_and_assemble(saved_jobs(root / "programs", options), FUNCTION, root / "work",
                                                  root / "out", max_workers=2, env=ENV, say=lines.append)
    return {"root": root, "assembled": assembled, "parts": parts, "lines": lines}


def test_methods_lower_side_by_side_in_separate_processes(parallel):
    parts = parallel["parts"]
    assert list(parts) == ["a", "b"]
    assert parts["a"].record["saw"] == ["b"] and parts["b"].record["saw"] == ["a"]
    assert parts["a"].record["pid"] != parts["b"].record["pid"]


@pytest.mark.parametrize("cores, workers_at_once, share", [(16, 2, 8), (16, 4, 4), (16, 1, 16), (2, 4, 1), (16, 0, 16)])
def test_the_cores_are_shared_equally_between_workers(cores, workers_at_once, share):
    assert workers.threads_per_worker(cores, workers_at_once) == share


def test_each_worker_gets_its_share_of_the_cores_for_its_compile_pool(parallel):
    # Two workers at once: each Inductor compile pool gets half the cores (at least one), not all of them.
    share = str(max(1, (os.cpu_count() or 1) // 2))
    assert [parallel["parts"][m].record["compile_threads"] for m in ("a", "b")] == [share, share]


def test_a_compile_pool_size_the_operator_chose_is_kept(tmp_path):
    jobs = saved_jobs(tmp_path / "programs", lambda m: {})[:1]
    parts = workers.lower_in_workers(jobs, FUNCTION, tmp_path / "work", max_workers=1,
                                     env={**ENV, "TORCHINDUCTOR_COMPILE_THREADS": "3"})
    assert parts[jobs[0].method].record["compile_threads"] == "3"


def test_parallel_assembly_gives_the_sequential_outputs_and_eager(parallel, tmp_path):
    from portable_lowering import lower_program

    options = {"init_buffers": ["count"], "external_constants": True}
    sequential = write(lower_program(copy.deepcopy(programs()), options), tmp_path / "sequential", "model")
    out = parallel["assembled"].pte.parent
    ptd = out / "_default_external_constant.ptd"
    assert ptd.read_bytes() == sequential.data_files[ptd.name].read_bytes()
    got = run_calls(parallel["assembled"].pte, [ptd], CALLS)
    want = run_calls(sequential.pte, list(sequential.data_files.values()), CALLS)
    for g, w, e in zip(got, want, eager_calls(CALLS)):
        torch.testing.assert_close(g, e)
        assert torch.equal(g, w)


def test_progress_names_each_method_and_each_worker_has_its_log(parallel):
    lines = parallel["lines"]
    for method in ("a", "b"):
        assert any(line.startswith(f"lowering {method}: worker ") and "started" in line for line in lines)
        assert any(line.startswith(f"lowering {method}: done in ") for line in lines)
        assert parallel["parts"][method].log.is_file()
        assert f"{method}: lowered in" in parallel["parts"][method].log.read_text()


class RecordingBar:
    """Stands in for zoo.core.progress.Progress: what the bar was told, in order."""

    def __init__(self):
        self.calls = []

    def begin(self, label):
        self.calls.append(("begin", label))

    def advance(self, n=1):
        self.calls.append(("advance", n))


def test_one_worker_at_a_time_when_so_bounded_and_the_bar_names_each_one(tmp_path):
    # One lowering serves both checks (each pair of workers costs two fresh Python processes).
    (tmp_path / "rendezvous").mkdir()

    def options(method):  # each waits briefly for the other: with one worker at a time it never comes
        return {"rendezvous": str(tmp_path / "rendezvous"), "rendezvous_s": 3,
                "rendezvous_with": [m for m in ("a", "b") if m != method]}

    bar = RecordingBar()
    parts = workers.lower_in_workers(saved_jobs(tmp_path / "programs", options), FUNCTION, tmp_path / "work",
                                     max_workers=1, env=ENV, say=lambda line: None, bar=bar)
    assert parts["a"].record["saw"] == [] and parts["b"].record["saw"] == ["a"]
    # The bar names the running method and counts each one done.
    assert bar.calls == [("begin", "a"), ("advance", 1), ("begin", ""), ("begin", "b"), ("advance", 1),
                         ("begin", "")]


def test_the_in_process_bar_names_the_running_methods_and_counts_each_one_done(tmp_path):
    bar = RecordingBar()
    workers.lower_in_process(saved_jobs(tmp_path / "programs2", lambda m: {}), FUNCTION, tmp_path / "here",
                             pythonpath=[str(FIXTURES)], say=lambda line: None, bar=bar)
    assert bar.calls == [("begin", "a"), ("advance", 1), ("begin", "b"), ("advance", 1)]


def test_a_full_disk_in_a_worker_is_a_storage_error(tmp_path):
    def options(method):
        return {"disk_full": "a.pte"} if method == "a" else {}

    with pytest.raises(StorageError, match=r"method 'a': the machine could not write a file: \[Errno 28\]") as info:
        workers.lower_in_workers(saved_jobs(tmp_path / "programs", options), FUNCTION, tmp_path / "work",
                                 max_workers=1, env=ENV, say=lambda line: None)
    assert "free disk space" in info.value.hint


def test_a_failing_method_fails_the_lowering_with_its_own_error(tmp_path):
    lines = []

    def options(method):
        return {"fail": "the kernel preflight refused aten.polar"} if method == "b" else {}

    with pytest.raises(LoweringError) as info:
        workers.lower_and_assemble(saved_jobs(tmp_path / "programs", options), FUNCTION, tmp_path / "work",
                                   tmp_path / "out", max_workers=2, env=ENV, say=lines.append)
    assert str(info.value.message) == "method 'b': the kernel preflight refused aten.polar"
    assert info.value.hint == "the test asked for this failure"
    assert any(line.startswith("lowering b: FAILED") for line in lines)
    assert not (tmp_path / "out" / "model.pte").exists()
    assert "LoweringError" in (tmp_path / "work" / "b" / "worker.log").read_text()  # the traceback is kept


def test_a_worker_that_dies_silently_is_reported_with_its_exit_and_log(tmp_path):
    def options(method):
        return {"crash": 7} if method == "a" else {}

    with pytest.raises(LoweringError, match=r"the worker lowering method 'a' died \(exit status 7\)") as info:
        workers.lower_in_workers(saved_jobs(tmp_path / "programs", options), FUNCTION, tmp_path / "work",
                                 max_workers=1, env=ENV, say=lambda line: None)
    assert str(tmp_path / "work" / "a" / "worker.log") in info.value.hint
    assert not (tmp_path / "work" / "b").exists()  # the waiting method never started


def test_a_function_that_cannot_be_imported_is_refused_before_any_worker(tmp_path):
    with pytest.raises(LoweringError, match="cannot be imported"):
        workers.lower_in_workers(saved_jobs(tmp_path / "programs", lambda m: {}), "portable_lowering:nope",
                                 tmp_path / "work", env=ENV)
    with pytest.raises(LoweringError, match="'package.module:function'"):
        workers.lower_in_workers(saved_jobs(tmp_path / "programs", lambda m: {}), "no_colon", tmp_path / "work")
    assert not (tmp_path / "work").exists()


def test_max_workers_from_the_environment(monkeypatch):
    monkeypatch.setenv(workers.ENV_MAX_WORKERS, "3")
    assert workers.default_max_workers(2) == 2 and workers.default_max_workers(5) == 3
    monkeypatch.setenv(workers.ENV_MAX_WORKERS, "many")
    with pytest.raises(LoweringError, match="not a whole number"):
        workers.default_max_workers(2)


def test_workers_come_from_the_caller_then_the_environment_then_the_recipe_then_the_machine(monkeypatch):
    monkeypatch.delenv(workers.ENV_MAX_WORKERS, raising=False)
    monkeypatch.setattr(workers.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(workers, "available_memory_bytes", lambda: 100 << 30)
    assert workers.choose_workers(2, requested=1, configured=2)[0] == 1
    assert workers.choose_workers(3, configured=2) == (2, "recipe lowering.workers=2")
    assert workers.choose_workers(2)[0] == 2  # one per method: 16 cores allow 4
    assert workers.choose_workers(8)[0] == 4
    count, why = workers.choose_workers(2, per_worker_bytes=60 << 30)  # 100 GiB hold one 60 GiB worker
    assert count == 1 and "available memory" in why
    # One estimate per job, the largest first (LingBot-VA: two 31 GiB transformer steps, two 3 GiB encodes):
    # as many of the first as fit together.
    gib = 1 << 30
    assert workers.choose_workers(4, per_worker_bytes=[31 * gib, 31 * gib, 3 * gib, 3 * gib])[0] == 4
    count, why = workers.choose_workers(4, per_worker_bytes=[45 * gib, 45 * gib, 20 * gib, 3 * gib])
    assert count == 2 and "45.0, 45.0, 20.0 GiB, the largest first" in why
    assert workers.choose_workers(4, per_worker_bytes=[200 * gib] * 4)[0] == 1  # at least one, always
    monkeypatch.setenv(workers.ENV_MAX_WORKERS, "2")
    assert workers.choose_workers(3, configured=1) == (2, f"{workers.ENV_MAX_WORKERS}=2")
    with pytest.raises(LoweringError, match="at least 1"):
        workers.choose_workers(3, requested=0)


def test_in_process_lowering_leaves_the_same_parts_as_the_workers(parallel, tmp_path):
    jobs = saved_jobs(tmp_path / "programs", lambda m: {"init_buffers": ["count"], "external_constants": True})
    in_process = workers.lower_in_process(jobs, FUNCTION, tmp_path / "here", pythonpath=[str(FIXTURES)],
                                          say=lambda line: None)
    assert [p.log for p in in_process.values()] == [None, None]
    for method, part in in_process.items():  # each method's part, byte for byte what its worker wrote
        assert part.pte.read_bytes() == parallel["parts"][method].pte.read_bytes()
        assert sorted(part.data_files) == sorted(parallel["parts"][method].data_files)
        for name, path in part.data_files.items():
            assert path.read_bytes() == parallel["parts"][method].data_files[name].read_bytes()
    assembled = workers.assemble_program([p.as_program_part() for p in in_process.values()], tmp_path / "out")
    assert assembled.pte.read_bytes() == parallel["assembled"].pte.read_bytes()


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, dead but not yet reaped, counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="PR_SET_PDEATHSIG and /proc are Linux's")
def test_a_worker_ends_when_its_parent_is_killed(tmp_path):
    # SIGKILL gives the parent no chance to stop its workers; the worker must not go on lowering alone.
    import os
    import signal
    import subprocess
    import sys
    import time

    job = saved_jobs(tmp_path / "programs", lambda m: {})[0]
    rendezvous = tmp_path / "rendezvous"
    rendezvous.mkdir()
    parent = subprocess.Popen([sys.executable, "-c", f"""
from pathlib import Path
from zoo.export.lower import workers as w
job = w.MethodJob(method={job.method!r}, program=Path({str(job.program)!r}),
                  options={{"rendezvous": {str(rendezvous)!r}, "rendezvous_with": ["never"], "rendezvous_s": 600}})
w.lower_in_workers([job], {FUNCTION!r}, Path({str(tmp_path / 'work')!r}), max_workers=1, env={ENV!r},
                   say=lambda line: None)
"""])
    marker = rendezvous / job.method  # the worker writes its pid here, then waits for a method that never comes
    deadline = time.monotonic() + 120
    while not marker.exists() and time.monotonic() < deadline and parent.poll() is None:
        time.sleep(0.2)
    assert marker.exists(), "the worker never started"
    worker = int(marker.read_text())
    assert _running(worker)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 60
    while _running(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _running(worker), "the worker outlived its killed parent"
