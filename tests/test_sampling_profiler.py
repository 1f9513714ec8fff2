"""zoo.core.sampling_profiler: what a sample counts, what the report says, and that a killed job leaves one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from zoo.core.sampling_profiler import SamplingProfiler, frame_key

HERE = "tests/test_sampling_profiler.py"


def parked(release: threading.Event, depth: int) -> None:
    """Recurse ``depth`` times, then wait: a stack of known shape for the sampler to read."""
    if depth:
        parked(release, depth - 1)
    else:
        release.wait()


def outer(release: threading.Event) -> None:
    parked(release, 3)


def waiting_in_parked(thread: threading.Thread) -> bool:
    frame = sys._current_frames().get(thread.ident)
    names = []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return names.count("parked") == 4 and names[0] == "wait"


def test_a_sample_counts_the_innermost_frame_as_self_and_each_function_once_as_cumulative(tmp_path):
    release = threading.Event()
    worker = threading.Thread(target=outer, args=(release,))
    worker.start()
    try:
        while not waiting_in_parked(worker):
            time.sleep(0.01)  # until the worker is parked (not a timed assertion: it waits for a state)
        profiler = SamplingProfiler(tmp_path / "p.txt", thread_id=worker.ident)
        with profiler.section("stage-a"):
            profiler.sample()
            profiler.sample()
        profiler.sample()
    finally:
        release.set()
        worker.join()
    assert profiler.samples == 3
    # Four nested parked() frames on every sample, counted once per sample.
    assert profiler.cumulative[f"{HERE}:parked"] == 3
    assert profiler.cumulative[f"{HERE}:outer"] == 3
    (innermost, n), = profiler.self_counts.items()
    assert innermost.endswith("threading.py:wait") and n == 3
    assert profiler.by_section == {"stage-a": 2, "-": 1}
    profiler.write()
    text = (tmp_path / "p.txt").read_text()
    assert "3 samples every 0.5 s" in text
    assert f"100.0%       1.5  {HERE}:parked" in text  # share and seconds (3 x 0.5 s: never started, no wall time)
    assert " 66.7%       1.0  stage-a" in text


def test_seconds_are_the_share_of_the_wall_time_when_samples_come_late(tmp_path):
    # A job holding the GIL delays the sampler: 4 samples over 10 s of wall time stand for 2.5 s each, not 0.5 s.
    now = [100.0]
    profiler = SamplingProfiler(tmp_path / "p.txt", thread_id=threading.get_ident(), clock=lambda: now[0])
    profiler._started = now[0]  # started at 100 s on the fake clock, without the sampler thread
    for _ in range(4):
        now[0] += 2.5
        profiler.sample()
    text = profiler.report()
    assert "4 samples every 0.5 s over 10.0 s of wall time, one per 2.500 s" in text
    key = f"{HERE}:test_seconds_are_the_share_of_the_wall_time_when_samples_come_late"
    assert f"100.0%      10.0  {key}" in text


def test_frame_key_names_site_packages_files_by_their_package_path():
    import json.decoder

    assert frame_key(json.decoder.JSONDecoder.decode.__code__).endswith("/json/decoder.py:decode")  # stdlib: full path
    import torch.nn.modules.linear as linear

    assert frame_key(linear.Linear.forward.__code__) == "torch/nn/modules/linear.py:forward"
    assert frame_key(outer.__code__) == f"{HERE}:outer"


def test_a_killed_job_leaves_the_profile_of_its_last_flush(tmp_path):
    out = tmp_path / "killed.txt"
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        def spin_here():
            while True:
                sum(range(1000))

        spin_here()
    """))
    proc = subprocess.Popen([sys.executable, "-m", "zoo.core.sampling_profiler", "--out", str(out), "--interval", "0.01",
                             "--flush-every", "0.2", str(script)], env=dict(os.environ))
    try:
        deadline = time.monotonic() + 120
        while not out.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    text = out.read_text()
    assert "job.py:spin_here" in text and "## cumulative" in text


def test_sigterm_writes_the_profile_and_ends_as_terminated(tmp_path):
    out = tmp_path / "term.txt"
    script = tmp_path / "job.py"
    ready = tmp_path / "ready"
    script.write_text(textwrap.dedent(f"""
        import pathlib, time
        def wait_here():
            pathlib.Path({str(ready)!r}).touch()
            while True:
                time.sleep(0.01)
        wait_here()
    """))
    proc = subprocess.Popen([sys.executable, "-m", "zoo.core.sampling_profiler", "--out", str(out), "--interval", "0.01",
                             "--flush-every", "600", str(script)], env=dict(os.environ))
    deadline = time.monotonic() + 120
    while not ready.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(0.1)  # a few samples inside wait_here
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert "job.py:wait_here" in out.read_text()  # written at SIGTERM: the 600 s flush never came


def test_the_script_runs_with_its_arguments_and_exit_code(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import sys\nprint('args', sys.argv[1:])\nsys.exit(int(sys.argv[1]))\n")
    out = tmp_path / "p.txt"
    done = subprocess.run([sys.executable, "-m", "zoo.core.sampling_profiler", "--out", str(out), str(script), "3", "x"],
                          capture_output=True, text=True, env=dict(os.environ))
    assert done.returncode == 3
    assert "args ['3', 'x']" in done.stdout
    assert out.read_text().startswith(f"# sampling profile: {script} 3 x")


@pytest.mark.parametrize("kwargs", [{"interval": 0}, {"flush_every": -1}, {"top": 0}])
def test_bad_settings_are_refused(tmp_path, kwargs):
    with pytest.raises(ValueError):
        SamplingProfiler(Path(tmp_path / "x"), **kwargs)


def test_the_report_ends_with_inductor_phase_timers_once_torch_recorded_some(tmp_path):
    from torch._dynamo.utils import compilation_time_metrics, dynamo_timed

    # Only this test's phase: earlier tests' compiles (longer phases) would push it out of the report's top rows.
    earlier = dict(compilation_time_metrics)
    compilation_time_metrics.clear()
    with dynamo_timed("zoo_test_phase"):
        pass
    with dynamo_timed("zoo_test_phase"):
        pass
    try:
        profiler = SamplingProfiler(tmp_path / "p.txt")
        profiler.write()
        text = (tmp_path / "p.txt").read_text()
        assert "## compile phases" in text
        line = next(ln for ln in text.splitlines() if ln.endswith("zoo_test_phase"))
        assert line.split()[1] == "2"  # two calls, summed
    finally:
        compilation_time_metrics.clear()
        compilation_time_metrics.update(earlier)
