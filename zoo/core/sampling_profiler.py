"""A wall-clock stack sampler for long CPU-side jobs (export, lowering), safe to be killed at any moment.

Why and how: docs/benchmarks.md, "The sampling profiler".
"""

from __future__ import annotations

import argparse
import contextlib
import os
import runpy
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Sequence, Tuple, Union

from zoo.core import atomic

PathLike = Union[str, Path]
_NO_SECTION = "-"


def frame_key(code) -> str:
    """``file:function`` of a code object, the file shortened to what identifies it: the part after
    ``site-packages/`` (``torch/_inductor/scheduler.py``), else after this checkout's root
    (``zoo/export/trace.py``), else the full path."""
    path = code.co_filename
    marker = "site-packages" + os.sep
    if marker in path:
        path = path.rsplit(marker, 1)[1]
    else:
        root = str(Path(__file__).resolve().parents[2]) + os.sep  # zoo/core/ -> the checkout
        if path.startswith(root):
            path = path[len(root):]
    return f"{path}:{code.co_name}"


class SamplingProfiler:
    """Sample one thread's stack (default: the thread that starts the profiler) until stopped."""

    def __init__(self, out: PathLike, *, interval: float = 0.5, flush_every: float = 15.0, top: int = 60,
                 thread_id: Optional[int] = None, title: str = "",
                 clock: Callable[[], float] = time.monotonic):
        if interval <= 0 or flush_every <= 0 or top < 1:
            raise ValueError("interval and flush_every must be > 0 and top >= 1")
        self.out = Path(out)
        self.interval, self.flush_every, self.top, self.title = interval, flush_every, top, title
        self.thread_id = thread_id
        self._clock = clock  # a test passes a fake one: the report's wall time must not depend on the test's speed
        self.samples = 0
        self.self_counts: Counter = Counter()
        self.cumulative: Counter = Counter()
        self.by_section: Counter = Counter()
        self.timeline: List[Tuple[float, float, float, float]] = []  # (elapsed, load1, own cpu, children cpu)
        self._section = _NO_SECTION
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._started = 0.0
        self._cpu0 = os.times()

    # -- control

    def start(self) -> "SamplingProfiler":
        if self._thread is not None:
            raise RuntimeError("this profiler is already running")
        if self.thread_id is None:
            self.thread_id = threading.get_ident()
        self._started = self._clock()
        self._cpu0 = os.times()
        self._thread = threading.Thread(target=self._run, name="zoo-sampling-profiler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self.write()

    def __enter__(self) -> "SamplingProfiler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Samples taken inside this block are also counted under ``name`` (the job's stages)."""
        previous, self._section = self._section, name
        try:
            yield
        finally:
            self._section = previous

    # -- sampling

    def _run(self) -> None:
        last_flush = self._clock()
        while not self._stop.wait(self.interval):
            self.sample()
            if self._clock() - last_flush >= self.flush_every:
                self._timeline_point()
                self.write()
                last_flush = self._clock()

    def sample(self) -> None:
        """Take one sample of the watched thread now (the thread calls this; a test may too)."""
        frame = sys._current_frames().get(self.thread_id)
        if frame is None:  # the watched thread has ended
            return
        keys = []
        while frame is not None:
            keys.append(frame_key(frame.f_code))
            frame = frame.f_back
        del frame
        with self._lock:
            self.samples += 1
            self.self_counts[keys[0]] += 1
            self.cumulative.update(set(keys))
            self.by_section[self._section] += 1

    def _timeline_point(self) -> None:
        now = os.times()
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        self.timeline.append((self._clock() - self._started, load,
                              (now.user + now.system) - (self._cpu0.user + self._cpu0.system),
                              (now.children_user + now.children_system)
                              - (self._cpu0.children_user + self._cpu0.children_system)))

    # -- report

    def report(self) -> str:
        with self._lock:
            samples = self.samples
            self_counts, cumulative, sections = Counter(self.self_counts), Counter(self.cumulative), \
                Counter(self.by_section)
        elapsed = self._clock() - self._started if self._started else 0.0
        # The sampler thread needs the GIL to wake, so under a job that holds it the samples come late (0.57-0.62 s
        # apart at 0.5 s on the H200's lowering workers): a sample stands for the wall time it covered, not for
        # the interval asked, and "~seconds" is the share of the wall time (set against Inductor's exact timers,
        # counting by the interval read 10-20% low).
        per_sample = elapsed / samples if elapsed > 0 and samples else self.interval
        lines = [f"# sampling profile{': ' + self.title if self.title else ''}",
                 f"# {samples} samples every {self.interval:g} s over {elapsed:.1f} s of wall time, one per "
                 f"{per_sample:.3f} s (pid {os.getpid()}, written {time.strftime('%Y-%m-%d %H:%M:%S')})", ""]
        if self.timeline:
            lines += ["elapsed s   load1   own cpu s   children cpu s"]
            lines += [f"{t:9.0f} {load:7.2f} {own:11.1f} {kids:16.1f}" for t, load, own, kids in self.timeline]
            lines.append("")
        if len(sections) > 1 or _NO_SECTION not in sections:
            lines.append(_table("section", sections, samples, per_sample, self.top))
        lines.append(_table("cumulative (on the stack)", cumulative, samples, per_sample, self.top))
        lines.append(_table("self (innermost frame)", self_counts, samples, per_sample, self.top))
        phases = compile_phase_times()
        if phases:
            lines.append(phases)
        return "\n".join(lines)

    def write(self) -> None:
        atomic.write_text(self.out, self.report())


def compile_phase_times(top: int = 40) -> str:
    """Inductor's phase timers so far (``dynamo_timed`` records every phase's duration in
    ``torch._dynamo.utils.compilation_time_metrics``), summed per phase: "" where torch was not imported."""
    utils = sys.modules.get("torch._dynamo.utils")
    metrics = getattr(utils, "compilation_time_metrics", None) if utils is not None else None
    if not metrics:
        return ""
    rows = sorted(((sum(v), len(v), k) for k, v in list(metrics.items()) if v), reverse=True)[:top]
    out = ["## compile phases (torch._dynamo.utils.compilation_time_metrics; phases nest, so shares overlap)",
           f"{'seconds':>9} {'calls':>6}  phase"]
    out += [f"{total:9.1f} {calls:6d}  {key}" for total, calls, key in rows]
    return "\n".join(out) + "\n"


def _table(title: str, counts: Counter, samples: int, per_sample: float, top: int) -> str:
    rows = [f"## {title}", f"{'share':>7} {'~seconds':>9}  where"]
    for key, n in counts.most_common(top):
        rows.append(f"{100.0 * n / max(samples, 1):6.1f}% {n * per_sample:9.1f}  {key}")
    return "\n".join(rows) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run a Python script (``runpy``, as ``python SCRIPT ARGS`` would) under the sampler."""
    parser = argparse.ArgumentParser(
        prog="python -m zoo.core.sampling_profiler", description=main.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="exit status:\n  the script's own (its SystemExit code; 0 when it returns)\n"
               "  2   bad arguments to the profiler\n"
               "  143 ended by SIGTERM (a time limit): the profile sampled so far is written first")
    parser.add_argument("--out", type=Path, required=True, help="the profile text file (rewritten every flush)")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between samples (default 0.5)")
    parser.add_argument("--flush-every", type=float, default=15.0, help="seconds between rewrites (default 15)")
    parser.add_argument("script", help="the Python script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    opts = parser.parse_args(argv)
    profiler = SamplingProfiler(opts.out, interval=opts.interval, flush_every=opts.flush_every,
                                title=" ".join([opts.script, *opts.args]))

    def terminated(signum, _frame):  # a time limit's SIGTERM: write what was sampled, then end as killed
        profiler.stop()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, terminated)
    sys.argv = [opts.script, *opts.args]
    sys.path.insert(0, str(Path(opts.script).resolve().parent))  # as `python SCRIPT` puts its folder first
    code = 0
    with profiler:
        try:
            runpy.run_path(opts.script, run_name="__main__")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return code


if __name__ == "__main__":
    sys.exit(main())
