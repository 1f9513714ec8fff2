"""Running a zoo artifact through ExecuTorch's own C++ runtime: the ``zoo_runner`` program (runtime/cpp).

Why and how: docs/runtime.md, "The Python session".
"""

from __future__ import annotations

import json
import os
import re
import selectors
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from zoo.core.errors import RuntimeCallFailed, RuntimeNotBuilt
from zoo.contract.releases import RuntimeRequirement
from zoo.contract.tensor_file import read_tensor, write_tensor

RUNNER_ENV = "ZOO_ET_RUNNER"
BUILD_HINT = ("build it with `scripts/build_runtime.sh v1.2.0 build/runtime` (clones ExecuTorch's tag; offline: "
              "`--tarball FILE` instead of the tag; about 2 minutes on 16 cores; docs/runtime.md) and point "
              "ZOO_ET_RUNNER at build/runtime/build/zoo_runner")
LOG_TAIL_LINES = 30
PathLike = Union[str, Path]
HANDOVER_ENV = "ZOO_HANDOVER_DIR"
RAM_FOLDER = Path("/dev/shm")
RAM_FOLDER_SPARE = 4 << 30  # left free in the RAM folder: a container's /dev/shm may be only 64 MiB
# The zoo_runner line protocol with named values ($NAME, keep:NAME, zeros/upload/fetch/drop): runtime/cpp.
PROTOCOL = 2
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def find_runner(executable: Optional[PathLike] = None) -> Path:
    """The zoo_runner to use: ``executable``, else ``$ZOO_ET_RUNNER``; RuntimeNotBuilt saying how to build one."""
    chosen = executable or os.environ.get(RUNNER_ENV)
    if not chosen:
        raise RuntimeNotBuilt(f"no ExecuTorch C++ runtime given: pass the zoo_runner executable or set {RUNNER_ENV}",
                              BUILD_HINT)
    path = Path(chosen)
    if not path.is_file() or not os.access(path, os.X_OK):
        raise RuntimeNotBuilt(f"{path} is not an executable zoo_runner"
                              + (f" (from ${RUNNER_ENV})" if not executable else ""), BUILD_HINT)
    return path


def runner_info(executable: Optional[PathLike] = None) -> Dict[str, Any]:
    """What a zoo_runner build is: ExecuTorch version, CUDA or not, registered backends, weight sharing."""
    exe = find_runner(executable)
    proc = subprocess.run([str(exe), "--info"], capture_output=True, text=True, timeout=60)
    info = _last_json(proc.stdout)
    if proc.returncode != 0 or info is None:
        raise RuntimeNotBuilt(f"{exe} --info failed (exit {proc.returncode}): {_tail(proc.stderr, 10)}", BUILD_HINT)
    return info


def describe(info: Dict[str, Any]) -> str:
    """One line for a report: which runtime ran the artifact."""
    cuda = "CUDA backend" if info.get("cuda") else "portable only, no CUDA backend"
    patches = f"; zoo's patches: {', '.join(info['patches'])}" if info.get("patches") else ""
    features = f"; zoo's additions: {', '.join(info['features'])}" if info.get("features") else ""
    return (f"ExecuTorch runtime {info.get('executorch_version', '?')} (zoo_runner, {cuda}; weight sharing across "
            f"methods: {info.get('weight_sharing_across_methods', '?')}{patches}{features})")


def require_protocol(info: Dict[str, Any], executable: Any, what: str) -> None:
    """RuntimeNotBuilt unless the runner speaks the named-value protocol (a build from before it does not)."""
    if int(info.get("protocol", 1)) < PROTOCOL:
        raise RuntimeNotBuilt(f"{executable} speaks zoo_runner protocol {info.get('protocol', 1)}; {what} needs "
                              f"protocol {PROTOCOL} (values held on the GPU between calls)",
                              "rebuild it from this checkout: " + BUILD_HINT)


def handover_root(need_bytes: int = 0) -> Optional[str]:
    """The folder a session's hand-over files go under: ``$ZOO_HANDOVER_DIR``, else /dev/shm when it is a writable
    folder with ``need_bytes`` plus 4 GiB free, else None (the system's temp folder). A file in RAM skips the
    disk's file system on both sides of every call: 0.15 ms of a DiT step's 0.9 ms round trip on a CPU machine
    (benchmarks/bench_session.py)."""
    chosen = os.environ.get(HANDOVER_ENV)
    if chosen:
        return chosen
    try:
        stat = os.statvfs(RAM_FOLDER)
    except OSError:
        return None
    if os.access(RAM_FOLDER, os.W_OK | os.X_OK) and stat.f_bavail * stat.f_frsize >= need_bytes + RAM_FOLDER_SPARE:
        return str(RAM_FOLDER)
    return None


def _last_json(text: str) -> Optional[Dict[str, Any]]:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def _tail(text: str, lines: int = LOG_TAIL_LINES) -> str:
    kept = [line for line in text.strip().splitlines() if line.strip()][-lines:]
    return "\n".join(kept) if kept else "(nothing on stderr)"


def _exit_text(code: Optional[int]) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by signal {-code}"
    if code == 134:
        return "exit 134 (abort)"
    if code == 127:
        return "exit 127 (a symbol lookup error: the runtime lacks a function the .so needs)"
    return f"exit {code}"


@dataclass
class PlanResult:
    """What ``run_plan`` returns: each call's outputs (CPU tensors, None for a None output) and the summary."""

    outputs: List[List[Optional[torch.Tensor]]]
    step_ms: List[float]
    summary: Dict[str, Any] = field(default_factory=dict)
    replies: List[Dict[str, Any]] = field(default_factory=list)  # each call's reply (rescued, host_copies, device)


@dataclass(frozen=True)
class CallTiming:
    """Where one ``RuntimeSession.call``'s time went, in ms: writing its host inputs' files (``write``), the runner
    executing the method up to a device synchronisation (``execute``, as zoo_runner reports it), the runner
    binding inputs and taking outputs (``runtime_io``: host-to-device copies, device-to-host copies of host
    outputs), everything else between the command and its reply (``pipe``: the pipe, the runner reading and
    writing the hand-over files, its JSON reply), and reading the output files back (``read``)."""

    write: float
    execute: float
    runtime_io: float
    pipe: float
    read: float

    @property
    def total(self) -> float:
        return self.write + self.execute + self.runtime_io + self.pipe + self.read


class DeviceValue:
    """A tensor a RuntimeSession's runner holds under a name (on the GPU when it has one): pass it as an input of a
    later call; ``fetch()`` copies it to a CPU tensor. Only the newest value of a name is valid."""

    def __init__(self, session: "RuntimeSession", name: str, version: int, shape: Sequence[int], dtype: str,
                 on_device: bool):
        self.session, self.name, self.version = session, name, version
        self.shape, self.dtype, self.on_device = tuple(int(d) for d in shape), dtype, bool(on_device)

    def fetch(self) -> torch.Tensor:
        return self.session.fetch(self)

    def __repr__(self) -> str:
        where = "GPU" if self.on_device else "host"
        return f"DeviceValue(${self.name} v{self.version}, {self.dtype} {list(self.shape)}, on the {where})"


Input = Union[torch.Tensor, DeviceValue]


class RuntimeSession:
    """One loaded program in one zoo_runner process; ``call(method, inputs)`` in the method's signature order."""

    def __init__(self, pte: PathLike, ptd: Optional[PathLike] = None, *, executable: Optional[PathLike] = None,
                 require_cuda: bool = True, weight_sharing: bool = True, methods: Sequence[str] = (),
                 work_dir: Optional[PathLike] = None, timeout_s: float = 600.0,
                 requirement: Optional[RuntimeRequirement] = None):
        self.executable = find_runner(executable)
        self.pte = Path(pte).resolve()
        self.ptd = Path(ptd).resolve() if ptd else None
        self.timeout_s = timeout_s
        self.weight_sharing = bool(weight_sharing)  # asked of the runner: --no-weight-sharing when False
        if not self.pte.is_file():
            raise RuntimeCallFailed(f"{self.pte} is missing", "lower the run first (`python -m zoo lower RUN_DIR`)")
        self.build = runner_info(self.executable)
        if require_cuda and not self.build.get("cuda"):
            raise RuntimeNotBuilt(f"{self.executable} was built without the CUDA backend (portable runtime only); "
                                  "it cannot run a CUDA artifact", "build without --cpu: " + BUILD_HINT)
        if requirement is not None:
            requirement.check(self.build, self.executable)
        self.requirement = requirement
        self._own_dir = work_dir is None
        folder = work_dir or tempfile.mkdtemp(prefix="zoo-et-", dir=handover_root())
        self.work_dir = Path(folder).resolve()
        (self.work_dir / "in").mkdir(parents=True, exist_ok=True)
        (self.work_dir / "out").mkdir(parents=True, exist_ok=True)
        self.log_path = self.work_dir / "zoo_runner.log"
        self._calls = 0
        self._versions: Dict[str, int] = {}  # name -> the newest version the runner holds
        self.stats = {"calls": 0, "rescued": 0, "host_copies": 0}
        self.last_call: Optional[CallTiming] = None
        self.summary: Dict[str, Any] = {}
        cmd = [str(self.executable), "--model", str(self.pte), "--plan", "-", "--outputs", str(self.work_dir / "out")]
        if self.ptd is not None:
            cmd += ["--data", str(self.ptd)]
        if methods:
            cmd += ["--load", ",".join(methods)]
        if not weight_sharing:
            cmd.append("--no-weight-sharing")
        self.command = cmd
        self._log = open(self.log_path, "wb")
        # stderr (ExecuTorch's log) goes to a file: a chatty runtime can never fill a pipe and stall the runner.
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                      bufsize=0)
        self._buffer = b""
        try:
            self.ready = self._read_reply("loading the program")
        except RuntimeCallFailed:
            self.close()  # a runner that died while loading leaves no process, log handle or files behind
            raise
        if not self.ready.get("ready"):
            self._fail("loading the program", self.ready)

    # --- the pipe ---------------------------------------------------------------------------------------------------

    def _read_reply(self, what: str) -> Dict[str, Any]:
        """The next JSON line from the runner, waiting at most ``timeout_s``; RuntimeCallFailed if it dies."""
        deadline = time.monotonic() + self.timeout_s
        selector = selectors.DefaultSelector()
        selector.register(self._proc.stdout, selectors.EVENT_READ)
        try:
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._proc.kill()
                    self._proc.wait()
                    raise RuntimeCallFailed(f"zoo_runner did not answer within {self.timeout_s:.0f} s while "
                                            f"{what}; killed it. Its log:\n{self.log_tail()}",
                                            "a hung GPU kernel or a far too slow call; see the log above")
                if not selector.select(timeout=min(left, 1.0)):
                    continue
                chunk = os.read(self._proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    code = self._proc.wait()
                    summary = _last_json(self._buffer.decode(errors="replace"))
                    if summary is not None and not summary.get("ok", True):
                        self._fail(what, summary)
                    raise RuntimeCallFailed(f"zoo_runner died while {what} ({_exit_text(code)}); its log:\n"
                                            f"{self.log_tail()}",
                                            "the log above is ExecuTorch's own (logging is compiled in)")
                self._buffer += chunk
        finally:
            selector.close()
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            return json.loads(line)
        except json.JSONDecodeError as exc:
            raise RuntimeCallFailed(f"zoo_runner answered {line[:200]!r} while {what}, not a JSON line",
                                    "is the executable really zoo_runner?") from exc

    def _fail(self, what: str, reply: Dict[str, Any]) -> None:
        message = (f"ExecuTorch's runtime failed {what}: {reply.get('error', reply)}\n"
                   f"zoo_runner's log:\n{self.log_tail()}")
        self.close()  # the runner stops at a failed call; its files go (the log is in the message)
        raise RuntimeCallFailed(message, "an artifact the audit calls loadable that fails here is a finding: record "
                                         "it, and fix the audit or the artifact")

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            return _tail(self.log_path.read_text(errors="replace"), lines)
        except OSError:
            return "(no log)"

    # --- calls ---------------------------------------------------------------------------------------------------------

    def _send(self, line: str, what: str) -> Dict[str, Any]:
        """One command line down the pipe, its JSON reply back; RuntimeCallFailed when the runner fails it."""
        if self._proc.poll() is not None:
            raise RuntimeCallFailed(f"zoo_runner is not running ({_exit_text(self._proc.returncode)})",
                                    "open a new session")
        try:
            self._proc.stdin.write((line + "\n").encode())
            self._proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died: the reply read below says how
        reply = self._read_reply(what)
        if not reply.get("ok"):
            self._fail(what, reply)
        return reply

    def _token(self, value: Input, path: Path) -> str:
        if isinstance(value, DeviceValue):
            if value.session is not self:
                raise RuntimeCallFailed(f"{value!r} belongs to another session", "pass values of this session only")
            if self._versions.get(value.name) != value.version:
                raise RuntimeCallFailed(f"{value!r} was replaced by a later value of {value.name} (or dropped)",
                                        "pass the newest value the session returned for that name")
            return "$" + value.name
        return str(write_tensor(path, value, handover=True))

    def call(self, method: str, inputs: Sequence[Input], keep: Optional[Mapping[int, str]] = None
             ) -> List[Union[torch.Tensor, DeviceValue]]:
        """Run ``method`` once on ``inputs`` (tensors on any device, or values this session holds; signature order).
        Returns its outputs but None ones: CPU tensors, except outputs ``keep`` names (output position -> name),
        which stay in the runner, on the GPU, and come back as ``DeviceValue``s."""
        n = self._calls
        self._calls += 1
        if keep or any(isinstance(v, DeviceValue) for v in inputs):
            require_protocol(self.build, self.executable, "keeping values in the runner")
        for name in (keep or {}).values():
            if not _NAME.fullmatch(name):
                raise RuntimeCallFailed(f"{name!r} is not a name the runner takes ([A-Za-z0-9_.-]+)", "rename it")
        files = [self.work_dir / "in" / f"{n}.{i}.zt" for i in range(len(inputs))]
        started = time.perf_counter()
        tokens = [self._token(v, path) for v, path in zip(inputs, files)]
        line = " ".join([method] + tokens)
        if keep:
            count = len(self.ready_outputs(method)) or (max(keep) + 1)
            line += " -> " + " ".join(f"keep:{keep[k]}" if k in keep else "host" for k in range(count))
        sent = time.perf_counter()
        reply = self._send(line, f"running {method} (call {n})")
        answered = time.perf_counter()
        for path in files:
            path.unlink(missing_ok=True)  # values held by name wrote no file
        self.stats["calls"] += 1
        self.stats["rescued"] += len(reply.get("rescued", []))
        self.stats["host_copies"] += int(reply.get("host_copies", 0))
        outputs: List[Union[torch.Tensor, DeviceValue]] = []
        for k, path in enumerate(reply.get("outputs", [])):
            if keep and k in keep:
                outputs.append(self._held(keep[k], reply["shapes"][k], reply["dtypes"][k],
                                          (reply.get("device") or [False] * (k + 1))[k]))
            elif path is not None:
                outputs.append(read_tensor(path))
                Path(path).unlink()
        self.last_call = _timing(reply, started, sent, answered, time.perf_counter())
        return outputs

    def ready_outputs(self, method: str) -> List[bool]:
        """Whether each output of ``method`` is memory-planned, as the runner read the loaded program (empty when
        the runner does not say: protocol 1)."""
        return list(((self.ready.get("memory_planned") or {}).get(method) or {}).get("outputs") or [])

    def _held(self, name: str, shape: Sequence[int], dtype: str, on_device: bool) -> DeviceValue:
        version = self._versions.get(name, 0) + 1
        self._versions[name] = version
        return DeviceValue(self, name, version, shape, dtype, on_device)

    def zeros(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> DeviceValue:
        """A zero tensor the runner holds under ``name`` (on the GPU: nothing crosses from the host); the memory of
        the value ``name`` held, when it has this shape and dtype, is zeroed in place."""
        require_protocol(self.build, self.executable, "zeros")
        dt = str(dtype).replace("torch.", "")
        reply = self._send(f"zeros {name} {dt} [{','.join(str(int(d)) for d in shape)}]", f"zeros {name}")
        return self._held(name, reply["shape"], reply["dtype"], reply.get("device", False))

    def upload(self, name: str, tensor: torch.Tensor) -> DeviceValue:
        require_protocol(self.build, self.executable, "upload")
        path = write_tensor(self.work_dir / "in" / f"upload.{name}.zt", tensor, handover=True)
        reply = self._send(f"upload {name} {path}", f"upload {name}")
        path.unlink()
        return self._held(name, reply["shape"], reply["dtype"], reply.get("device", False))

    def fetch(self, value: DeviceValue) -> torch.Tensor:
        """The value's data as a CPU tensor (a copy from the GPU)."""
        path = self.work_dir / "out" / f"fetch.{value.name}.zt"
        self._send(f"fetch {self._token(value, path)[1:]} {path}", f"fetch {value.name}")
        tensor = read_tensor(path)
        path.unlink()
        return tensor

    def drop(self, *names: str) -> None:
        """Release the values held under ``names`` (their DeviceValues become invalid)."""
        held = [n for n in names if n in self._versions]
        if held:
            self._send("drop " + " ".join(held), "drop")
        for n in held:
            del self._versions[n]

    def runner(self, method: str) -> "MethodRunner":
        return MethodRunner(self, method)

    def close(self) -> Dict[str, Any]:
        """End the runner (its summary line is kept in ``summary``) and remove the session's files."""
        if self._proc.poll() is None:
            try:
                self._proc.stdin.write(b"quit\n")
                self._proc.stdin.close()
            except (BrokenPipeError, ValueError):
                pass
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if not self._proc.stdin.closed:
            try:
                self._proc.stdin.close()
            except BrokenPipeError:
                pass
        if not self._proc.stdout.closed:
            self._buffer += self._proc.stdout.read() or b""  # the summary line; the process has exited
            self._proc.stdout.close()
        self.summary = _last_json(self._buffer.decode(errors="replace")) or self.summary
        self._log.close()
        if self._own_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)
        return self.summary

    def __enter__(self) -> "RuntimeSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _timing(reply: Mapping[str, Any], started: float, sent: float, answered: float, done: float) -> CallTiming:
    execute, runtime_io = float(reply.get("ms") or 0.0), float(reply.get("io_ms") or 0.0)
    round_trip = (answered - sent) * 1e3
    return CallTiming(write=(sent - started) * 1e3, execute=execute, runtime_io=runtime_io,
                      pipe=max(0.0, round_trip - execute - runtime_io), read=(done - answered) * 1e3)


class MethodRunner:
    """One method of a session, with the calling shape of zoo.runtimes.aoti.AotiRunner: ``run(inputs) -> outputs``.

    Unlike AotiRunner, inputs and outputs are in the METHOD's signature order (the runtime reorders for the .so),
    so verification must not apply the delegate's order to this runner."""

    order = "method"

    def __init__(self, session: RuntimeSession, method: str):
        self.session, self.method = session, method

    def run(self, inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        return self.session.call(self.method, inputs)


# --- a whole sequence in one process -----------------------------------------------------------------------------------

Ref = Tuple[int, int]  # (earlier call, its output index): fed inside the runner, never through Python


def _plan_lines(steps: Sequence[Tuple[str, Sequence[Union[torch.Tensor, Ref]]]], work: Path) -> List[str]:
    """The plan file: each referenced output kept under a name of its own (``r<step>_<output>``), fetched to a file
    after its call (the caller gets every output), and dropped after its last use, so that no value is still
    named when its method runs again (the runner would have to copy it)."""
    last_use: Dict[Ref, int] = {}
    for s, (_, inputs) in enumerate(steps):
        for i, item in enumerate(inputs):
            if not isinstance(item, torch.Tensor):
                step, output = item
                if not 0 <= step < s:
                    raise ValueError(f"step {s} input {i} refers to step {step}, which does not come before it")
                last_use[(step, output)] = s
    lines = ["# zoo_runner plan: METHOD IN ... [-> OUT ...] (docs/runtime.md)"]
    for s, (method, inputs) in enumerate(steps):
        words = [method] + [str(write_tensor(work / "in" / f"{s}.{i}.zt", item, handover=True))
                            if isinstance(item, torch.Tensor) else f"$r{item[0]}_{item[1]}"
                            for i, item in enumerate(inputs)]
        kept = sorted(k for (step, k) in last_use if step == s)
        if kept:
            words += ["->"] + [f"keep:r{s}_{k}" if k in kept else "host" for k in range(max(kept) + 1)]
        lines.append(" ".join(words))
        lines += [f"fetch r{s}_{k} {work / 'out' / f'step{s}.kept{k}.zt'}" for k in kept]
        done = sorted(ref for ref, last in last_use.items() if last == s)
        if done:
            lines.append("drop " + " ".join(f"r{step}_{k}" for step, k in done))
    return lines


def run_plan(pte: PathLike, ptd: Optional[PathLike], steps: Sequence[Tuple[str, Sequence[Union[torch.Tensor, Ref]]]],
             *, executable: Optional[PathLike] = None, require_cuda: bool = True, weight_sharing: bool = True,
             timeout_s: float = 600.0, keep_dir: Optional[PathLike] = None,
             requirement: Optional[RuntimeRequirement] = None) -> PlanResult:
    """Run ``steps`` (method, inputs) in one zoo_runner process, one loaded program. An input is a tensor or
    ``(step, output)``: that earlier call's output, held by the runner (on the GPU) and handed over there (the KV
    pool of the "io" layout goes from one call to the next this way). Every output comes back on the CPU.
    ``keep_dir`` keeps the plan, the files and the log."""
    exe = find_runner(executable)
    build = runner_info(exe)
    if require_cuda and not build.get("cuda"):
        raise RuntimeNotBuilt(f"{exe} was built without the CUDA backend", "build without --cpu: " + BUILD_HINT)
    if requirement is not None:
        requirement.check(build, exe)
    if any(not isinstance(item, torch.Tensor) for _, inputs in steps for item in inputs):
        require_protocol(build, exe, "a plan that hands outputs to later calls")
    need = sum(t.numel() * t.element_size() for _, inputs in steps for t in inputs if isinstance(t, torch.Tensor))
    work = (Path(keep_dir) if keep_dir else
            Path(tempfile.mkdtemp(prefix="zoo-et-plan-", dir=handover_root(need)))).resolve()
    (work / "in").mkdir(parents=True, exist_ok=True)
    (work / "out").mkdir(parents=True, exist_ok=True)
    try:
        plan = work / "plan.txt"
        plan.write_text("\n".join(_plan_lines(steps, work)) + "\n")
        cmd = [str(exe), "--model", str(pte), "--plan", str(plan), "--outputs", str(work / "out")]
        if ptd:
            cmd += ["--data", str(ptd)]
        if not weight_sharing:
            cmd.append("--no-weight-sharing")
        with open(work / "zoo_runner.log", "wb") as log:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, timeout=timeout_s)
        replies = [json.loads(line) for line in proc.stdout.decode(errors="replace").splitlines()
                   if line.startswith("{")]
        summary = replies[-1] if replies else {}
        if proc.returncode != 0 or not summary.get("ok"):
            raise RuntimeCallFailed(f"ExecuTorch's runtime failed the plan ({_exit_text(proc.returncode)}): "
                                    f"{summary.get('error', 'no summary')}\nzoo_runner's log:\n"
                                    f"{_tail((work / 'zoo_runner.log').read_text(errors='replace'))}",
                                    "the log above is ExecuTorch's own (logging is compiled in)")
        calls = [r for r in replies if "step" in r and "method" in r]
        outputs = []
        for s, reply in enumerate(calls):
            got = [read_tensor(p) if p else None for p in reply["outputs"]]
            for k in range(len(got)):
                fetched = work / "out" / f"step{s}.kept{k}.zt"
                if got[k] is None and fetched.is_file():
                    got[k] = read_tensor(fetched)
            outputs.append(got)
        return PlanResult(outputs=outputs, step_ms=[r["ms"] for r in calls], summary=summary, replies=calls)
    finally:
        if keep_dir is None:
            shutil.rmtree(work, ignore_errors=True)
