"""Lowering each method in a fresh worker process, a bounded number at a time, then assembling one program.

Why and how: docs/ARCHITECTURE.md, "Lowering in worker processes".
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from zoo.core import atomic
from zoo.core import errors
from zoo.contract.artifact import PTE_NAME, ensure_flatc
from zoo.export.lower.admission import Gate, available_memory_bytes
from zoo.export.lower.assemble import AssembledProgram, ProgramPart, assemble_program
from zoo.core.errors import LoweringError
from zoo.core.progress import Progress
from zoo.core.progress import say as default_say
from zoo.contract.run_folder import read_program
from zoo.core.sampling_profiler import SamplingProfiler

ENV_MAX_WORKERS = "ZOO_LOWERING_WORKERS"
# A folder: each worker writes a sampled profile of its lowering there, <method>.profile.txt (zoo.core.sampling_profiler).
ENV_PROFILE_DIR = "ZOO_LOWERING_PROFILE_DIR"
# The size of each worker's Inductor compile pool (Inductor reads it; its own default is one process per core).
ENV_COMPILE_THREADS = "TORCHINDUCTOR_COMPILE_THREADS"
# The worker's command line. Not ``python -m zoo.export.lower.workers``: that would run a second copy of this module
# named __main__, whose LoweredMethod is another class than the one the lowering function returns.
_WORKER_ENTRY = "import sys; from zoo.export.lower.workers import main; sys.exit(main())"
_LOG_TAIL_LINES = 25
RESULT_JSON = "result.json"  # a part's record, written last: its presence means the part is whole
_STOP_GRACE_S = 10.0


@dataclass
class LoweredMethod:
    """What the injected lowering function returns for its one method."""

    program: Any  # an ExecutorchProgramManager: write_to_file(fh) and write_tensor_data_to_file(folder)
    record: Dict[str, Any] = field(default_factory=dict)  # JSON-able facts for the parent (I/O order, ...)


@dataclass
class MethodJob:
    method: str
    program: Any  # a torch.export .pt2 file holding this method's program (in this process also the program)
    options: Dict[str, Any] = field(default_factory=dict)  # JSON-able, handed to the lowering function
    # The bytes its lowering is expected to take at its peak: claimed machine-wide before it starts, so that
    # lowerings side by side wait for each other rather than exhaust memory (zoo.export.lower.admission).
    # None: started unclaimed.
    memory_bytes: Optional[int] = None


@dataclass
class MethodPart:
    """What one worker left: its program files, the function's record, its time and its log."""

    method: str
    pte: Path
    data_files: Dict[str, Path]
    record: Dict[str, Any]
    seconds: float
    log: Optional[Path]  # the worker's stdout and stderr; None when lowered in this process

    def as_program_part(self) -> ProgramPart:
        return ProgramPart(label=self.method, pte=self.pte, data_files=dict(self.data_files))


def resolve_function(spec: str) -> Callable[..., LoweredMethod]:
    """The function named ``"package.module:function"``; a clear error when it cannot be imported."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise LoweringError(f"lowering function {spec!r} is not of the form 'package.module:function'",
                            "name the per-method lowering function by its module and name")
    try:
        function = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise LoweringError(f"lowering function {spec!r} cannot be imported: {exc}",
                            "check the module is importable from the worker (PYTHONPATH) and the name") from exc
    if not callable(function):
        raise LoweringError(f"lowering function {spec!r} is not callable", "name a function")
    return function


def choose_workers(jobs: int, *, requested: Optional[int] = None, configured: Optional[int] = None,
                   per_worker_bytes: Union[None, int, Sequence[int]] = None) -> Tuple[int, str]:
    """How many methods to lower at once, and why: ``requested`` (the caller's), else ``ZOO_LOWERING_WORKERS``
    (this machine's operator), else ``configured`` (the recipe's ``lowering.workers``), else one per method,
    at most one per four cores (each worker's Inductor starts its own pool of compile processes) and at most
    as many as the available memory holds: ``per_worker_bytes`` each, or, given one estimate per job in the
    order they start (the largest first), as many of the first as fit together. Never more than ``jobs``.
    The available memory is MemAvailable now, or ``ZOO_LOWERING_MEMORY_BYTES``; other lowerings running on the
    machine are not counted here: each worker waits for them when it starts (``zoo.export.lower.admission``)."""
    jobs = max(jobs, 1)
    env = os.environ.get(ENV_MAX_WORKERS)
    if requested is not None:
        value, why = requested, "asked for"
    elif env:
        try:
            value = int(env)
        except ValueError:
            raise LoweringError(f"{ENV_MAX_WORKERS}={env!r} is not a whole number",
                                f"set {ENV_MAX_WORKERS} to how many methods may lower at once") from None
        why = f"{ENV_MAX_WORKERS}={env}"
    elif configured is not None:
        value, why = configured, f"recipe lowering.workers={configured}"
    else:
        cores = os.cpu_count() or 1
        value, why = min(jobs, max(1, cores // 4)), f"one per method, at most one per 4 of {cores} cores"
        available = available_memory_bytes()
        if per_worker_bytes and available is not None:
            estimates = ([int(per_worker_bytes)] * jobs if isinstance(per_worker_bytes, int)
                         else [int(b) for b in per_worker_bytes])
            fits, total = 0, 0
            for estimate in estimates:
                if total + estimate > available:
                    break
                fits, total = fits + 1, total + estimate
            fits = max(1, fits)
            if fits < value:
                each = (f"~{estimates[0] / 2**30:.1f} GiB each" if len(set(estimates)) == 1 else
                        f"~{', '.join(f'{e / 2**30:.1f}' for e in estimates[:fits + 1])} GiB, the largest first")
                value, why = fits, f"as many as {available / 2**30:.0f} GiB of available memory holds at {each}"
    if value < 1:
        raise LoweringError(f"{why}: {value} workers; at least 1 is needed",
                            f"set {ENV_MAX_WORKERS} (or lowering.workers) to 1 or more, or leave it unset")
    return min(value, jobs), why


def threads_per_worker(cores: int, workers: int) -> int:
    """Each of ``workers`` lowering processes gets an equal share of ``cores`` for its compile pool (at least 1):
    two workers with a 16-process pool each on 16 cores would only fight over them."""
    return max(1, cores // max(1, workers))


def default_max_workers(jobs: int) -> int:
    """``ZOO_LOWERING_WORKERS`` if set, else one worker per four cores, at most one per method."""
    return choose_workers(jobs)[0]


# --- the parent --------------------------------------------------------------------------------------------


@dataclass
class _Running:
    job: MethodJob
    folder: Path
    log: Optional[Path]  # None: lowered in this process, its output went to this process's
    process: Optional[subprocess.Popen]  # None: lowered in this process
    started: float


def lower_in_workers(jobs: Sequence[MethodJob], function: str, work_dir: Path, *,
                     max_workers: Optional[int] = None, env: Optional[Mapping[str, str]] = None,
                     say: Callable[[str], None] = default_say, heartbeat_s: float = 60.0,
                     poll_s: float = 0.2, bar: Optional[Progress] = None,
                     on_part: Optional[Callable[[MethodPart], None]] = None,
                     run: Optional[Path] = None) -> Dict[str, MethodPart]:
    """Lower every job's method in its own worker process, at most ``max_workers`` at a time.

    A job with ``memory_bytes`` starts only once the machine's other lowering workers leave it room
    (``zoo.export.lower.admission``; its claim names ``run``, default ``work_dir``), saying so while it waits.
    ``bar`` (a ``zoo.core.progress.Progress`` over the methods) names the methods running and counts each one done.
    Returns the parts in job order. Raises the failed method's error (after stopping the other workers) if any
    worker fails; nothing is assembled then.
    """
    worker_env = _checked_worker_env(jobs, function, env)
    workers = max_workers if max_workers is not None else default_max_workers(len(jobs))
    if workers < 1:
        raise LoweringError(f"max_workers={workers} must be at least 1", "lower at least one method at a time")
    # Each worker's Inductor compile pool gets its share of the cores, unless the operator chose a size.
    worker_env.setdefault(ENV_COMPILE_THREADS, str(threads_per_worker(os.cpu_count() or 1, min(workers, len(jobs)))))
    work_dir = Path(work_dir)

    gate = Gate(str(run if run is not None else work_dir), say, every_s=heartbeat_s)
    pending = list(jobs)
    running: Dict[str, _Running] = {}
    parts: Dict[str, MethodPart] = {}
    last_beat = time.monotonic()
    try:
        while pending or running:
            while pending and len(running) < workers and gate.enter(pending[0].method, pending[0].memory_bytes):
                job = pending.pop(0)
                running[job.method] = _start(job, function, work_dir, worker_env)
                gate.started(job.method, running[job.method].process.pid)
                say(f"lowering {job.method}: worker {running[job.method].process.pid} started "
                    f"(log {running[job.method].log})")
                if bar is not None:
                    bar.begin(", ".join(running))
            _collect_finished(running, parts, say=say, bar=bar, on_part=on_part, gate=gate)
            if running and time.monotonic() - last_beat >= heartbeat_s:
                now = time.monotonic()
                say("lowering: " + ", ".join(f"{m} running {now - r.started:.0f} s" for m, r in running.items())
                    + (f"; {len(pending)} waiting" if pending else ""))
                last_beat = now
            if running or pending:  # pending with nothing running: waiting for another lowering's memory
                time.sleep(poll_s)
    finally:
        for started in running.values():  # a failure, an interrupt: the workers still running are stopped
            _stop(started.process)
            say(f"lowering {started.job.method}: stopped")
        gate.leave_all()  # after the stop: their memory is free only once they have ended
    return {job.method: parts[job.method] for job in jobs}


def _checked_worker_env(jobs: Sequence[MethodJob], function: str,
                        env: Optional[Mapping[str, str]]) -> Dict[str, str]:
    """The workers' environment, once the jobs are known to be lowerable: at least one, each method once, the
    function importable as a worker will import it, every program saved."""
    if not jobs:
        raise LoweringError("no methods to lower", "the unit names its methods in unit.methods")
    names = [job.method for job in jobs]
    if len(set(names)) != len(names):
        raise LoweringError(f"a method is named twice in {names}", "give each job a different method")
    worker_env = _worker_env(env)
    _resolve_as_worker(function, worker_env)  # refuse a bad name here, not once per worker
    for job in jobs:
        if not isinstance(job.program, (str, Path)) or not Path(job.program).is_file():
            raise LoweringError(f"the program of method {job.method!r} is missing: {job.program}",
                                "save each method's exported program (torch.export.save) before lowering")
    return worker_env


def _collect_finished(running: Dict[str, "_Running"], parts: Dict[str, MethodPart], *,
                      say: Callable[[str], None], bar: Optional[Progress],
                      on_part: Optional[Callable[[MethodPart], None]] = None, gate: Optional[Gate] = None) -> None:
    """Move each worker that has exited from ``running`` to ``parts``; a failed one raises its error."""
    for method, run in list(running.items()):
        code = run.process.poll()
        if code is None:
            continue
        del running[method]
        if gate is not None:
            gate.leave(method)
        seconds = time.monotonic() - run.started
        if code != 0:
            say(f"lowering {method}: FAILED after {seconds:.1f} s (exit {code})")
            raise _worker_error(run, code)
        parts[method] = _collect(run, seconds)
        if on_part is not None:  # kept at once: the next method may fail, or this process be killed
            on_part(parts[method])
        say(f"lowering {method}: done in {seconds:.1f} s")
        if bar is not None:
            bar.advance()
            bar.begin(", ".join(running))


def lower_and_assemble(jobs: Sequence[MethodJob], function: str, work_dir: Path, out_dir: Path, *,
                       pte_name: str = PTE_NAME, **worker_options: Any
                       ) -> Tuple[AssembledProgram, Dict[str, MethodPart]]:
    """``lower_in_workers`` then ``zoo.export.lower.assemble.assemble_program`` of the parts into ``out_dir`` (atomically)."""
    parts = lower_in_workers(jobs, function, work_dir, **worker_options)
    assembled = assemble_program([part.as_program_part() for part in parts.values()], out_dir, pte_name=pte_name)
    return assembled, parts


def lower_in_process(jobs: Sequence[MethodJob], function: str, work_dir: Path, *,
                     pythonpath: Sequence[str] = (), say: Callable[[str], None] = default_say,
                     bar: Optional[Progress] = None,
                     on_part: Optional[Callable[[MethodPart], None]] = None,
                     run: Optional[Path] = None) -> Dict[str, MethodPart]:
    """The same lowering in this process, one method after another, leaving the same parts as the workers.

    For debugging (a breakpoint in the lowering, one traceback) and for one method. A job's ``program`` may be
    the program itself (it is handed to the function as it is: the caller copies it first if it must stay
    unchanged) or a ``.pt2`` file, loaded when its turn comes. An error propagates as it is raised. A job with
    ``memory_bytes`` claims it for this process as a worker does, and waits its turn the same way.
    """
    if not jobs:
        raise LoweringError("no methods to lower", "the unit names its methods in unit.methods")
    ensure_flatc()  # writing a .pte with external data runs flatc, as in a worker
    saved = list(sys.path)
    sys.path[:0] = [p for p in pythonpath if p]  # resolved as a worker with this PYTHONPATH would resolve it
    try:
        lower = resolve_function(function)
    finally:
        sys.path[:] = saved
    gate = Gate(str(run if run is not None else work_dir), say)
    parts: Dict[str, MethodPart] = {}
    for job in jobs:
        folder = _fresh_folder(Path(work_dir), job.method)
        gate.wait(job.method, job.memory_bytes)
        start = time.monotonic()
        say(f"lowering {job.method} in this process")
        if bar is not None:
            bar.begin(job.method)
        try:
            gate.started(job.method, os.getpid())
            program = read_program(Path(job.program)) if isinstance(job.program, (str, Path)) else job.program
            lowered = lower(job.method, program, dict(job.options))
            del program
            _write_part(folder, job.method, lowered, job_function=function, seconds=time.monotonic() - start)
            del lowered
        finally:
            gate.leave(job.method)
        parts[job.method] = _collect(_Running(job=job, folder=folder, log=None, process=None, started=start),
                                     time.monotonic() - start)
        if on_part is not None:
            on_part(parts[job.method])
        say(f"lowering {job.method}: done in {parts[job.method].seconds:.1f} s")
        if bar is not None:
            bar.advance()
    return parts


def _worker_env(extra: Optional[Mapping[str, str]]) -> Dict[str, str]:
    """The parent's environment updated with ``extra``, and the folder holding this ``zoo`` first on PYTHONPATH
    (the worker imports the same zoo as the parent)."""
    env = {**os.environ, **(extra or {})}
    zoo_root = str(Path(__file__).resolve().parents[3])
    paths = [zoo_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != zoo_root]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def _resolve_as_worker(function: str, env: Mapping[str, str]) -> None:
    """Resolve ``function`` here with the worker's PYTHONPATH in front of ``sys.path``, as the worker will."""
    saved = list(sys.path)
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    try:
        resolve_function(function)
    finally:
        sys.path[:] = saved


def _fresh_folder(work_dir: Path, method: str) -> Path:
    folder = work_dir / method
    if folder.exists():
        shutil.rmtree(folder)  # an earlier run's files must not be taken for this run's
    folder.mkdir(parents=True)
    return folder


def _start(job: MethodJob, function: str, work_dir: Path, env: Dict[str, str]) -> _Running:
    folder = _fresh_folder(work_dir, job.method)
    job_path = folder / "job.json"
    atomic.write_json(job_path, {"method": job.method, "program": str(Path(job.program).resolve()),
                                 "function": function, "options": job.options, "parent": os.getpid()})
    log = folder / "worker.log"
    with open(log, "wb") as log_fh:
        # Its own session: the worker and everything it starts (compile subprocesses) are one process group,
        # stopped together if another method fails.
        process = subprocess.Popen([sys.executable, "-c", _WORKER_ENTRY, str(job_path)],
                                   stdout=log_fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=env, start_new_session=True)
    return _Running(job=job, folder=folder, log=log, process=process, started=time.monotonic())


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, _STOP_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, sig)  # the worker's own process group (start_new_session)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _collect(run: _Running, seconds: float) -> MethodPart:
    result_path = run.folder / RESULT_JSON
    pte = run.folder / f"{run.job.method}.pte"
    if not result_path.is_file() or not pte.is_file():
        raise LoweringError(f"the worker lowering method {run.job.method!r} exited cleanly but left no "
                            f"{RESULT_JSON if not result_path.is_file() else pte.name}",
                            f"see its log {run.log}:\n{_log_tail(run.log)}")
    result = json.loads(result_path.read_text())
    return MethodPart(method=run.job.method, pte=pte,
                      data_files={p.name: p for p in sorted(run.folder.glob("*.ptd"))},
                      record=result.get("record", {}), seconds=seconds, log=run.log)


def _worker_error(run: _Running, code: int) -> errors.ZooError:
    """The failed method's own error: its zoo error type, message and hint, or its exit and the log's end."""
    method = run.job.method
    error_path = run.folder / "error.json"
    tail = _log_tail(run.log)
    if error_path.is_file():
        info = json.loads(error_path.read_text())
        cls = getattr(errors, info.get("type", ""), None) if info.get("module") == errors.__name__ else None
        if isinstance(cls, type) and issubclass(cls, errors.ZooError):
            return cls(f"method {method!r}: {info['message']}", info.get("hint") or f"see the worker log {run.log}")
        return LoweringError(f"lowering method {method!r} failed in its worker: {info.get('type')}: "
                             f"{info.get('message')}",
                             f"the worker's traceback is in {run.log}; its last lines:\n{tail}")
    how = f"signal {-code}" if code < 0 else f"exit status {code}"
    return LoweringError(f"the worker lowering method {method!r} died ({how}) without reporting an error",
                         f"see its log {run.log} (killed for memory? a crash in native code?); its last lines:\n"
                         f"{tail}")


def _log_tail(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-_LOG_TAIL_LINES:]) or "(empty log)"


# --- the worker --------------------------------------------------------------------------------------------


def end_with_parent(parent_pid: Optional[int]) -> None:
    """Make this worker end when the zoo process that started it dies. A parent killed by SIGKILL cannot stop its
    workers (they run in their own session, so a Ctrl-C reaches them only through the parent's ``_stop``);
    without this they would go on lowering into a dead attempt's scratch folder. Linux sends the worker SIGTERM
    when its parent dies (``prctl(PR_SET_PDEATHSIG)``); elsewhere nothing is set."""
    if parent_pid is None or not sys.platform.startswith("linux"):
        return
    import ctypes  # stdlib; only a Linux worker needs it

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM))
    if os.getppid() != parent_pid:  # the parent died before the line above took effect
        os.kill(os.getpid(), signal.SIGTERM)


def run_worker(job_path: Path) -> int:
    """Lower the job's one method and write its program files and result.json, or error.json on failure."""
    folder = Path(job_path).parent
    job = json.loads(Path(job_path).read_text())
    end_with_parent(job.get("parent"))
    method = job["method"]
    start = time.perf_counter()
    profile_dir = os.environ.get(ENV_PROFILE_DIR)
    # A sampled profile of this method's lowering (with Inductor's phase timers), kept where the parent asked.
    profiling = (SamplingProfiler(Path(profile_dir) / f"{method}.profile.txt", title=f"lowering {method}")
                 if profile_dir else contextlib.nullcontext())
    try:
        ensure_flatc()
        function = resolve_function(job["function"])
        with profiling:
            program = read_program(Path(job["program"]))
            lowered = function(method, program, dict(job.get("options") or {}))
            del program
            _write_part(folder, method, lowered, job_function=job["function"], seconds=time.perf_counter() - start)
        print(f"[zoo worker] {method}: lowered in {time.perf_counter() - start:.1f} s", flush=True)
        return 0
    except BaseException as exc:  # every failure, KeyboardInterrupt included, is reported to the parent
        traceback.print_exc()
        exc = errors.storage_error(exc) or exc  # a full disk is the user's to fix: the parent says so plainly
        atomic.write_json(folder / "error.json", {
            "method": method, "type": type(exc).__name__, "module": type(exc).__module__,
            "message": getattr(exc, "message", None) or str(exc) or type(exc).__name__,
            "hint": getattr(exc, "hint", None), "traceback": traceback.format_exc()})
        return 1


def _write_part(folder: Path, method: str, lowered: Any, *, job_function: str, seconds: float) -> None:
    """What a lowering function returned, as the files the parent collects: ``<method>.pte``, the ``.ptd``
    files, and ``result.json`` last."""
    if not isinstance(lowered, LoweredMethod):
        raise LoweringError(f"{job_function} returned {type(lowered).__name__}, not a LoweredMethod",
                            "return zoo.export.lower.workers.LoweredMethod(program=..., record=...)")
    with open(folder / f"{method}.pte", "wb") as fh:
        lowered.program.write_to_file(fh)
        fh.flush()
        os.fsync(fh.fileno())
    lowered.program.write_tensor_data_to_file(str(folder))  # the .ptd files, if the program has any
    atomic.write_json(folder / RESULT_JSON, {"method": method, "seconds": seconds, "record": lowered.record})


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -c 'import sys; from zoo.export.lower.workers import main; sys.exit(main())' JOB.json "
              "(started by zoo.export.lower.workers.lower_in_workers)", file=sys.stderr)
        return 2
    return run_worker(Path(args[0]))


