"""Fault injection for zoo's command lines: each case runs a real zoo command in a child process over
a copy of a good, verified run, with one fault injected from outside zoo's code, and reports what the user saw
and whether the earlier run is byte for byte as it was.

Faults are injected by this wrapper, never by hooks in zoo:
  - SIGINT / SIGKILL at a stage: ``timed_stage`` is wrapped in the modules that use it; when the stage named by
    the case starts (its start line is printed), the child signals itself.
  - ENOSPC at a stage: from that stage's start on, zoo's atomic writer (``zoo.core.atomic.atomic_path``) raises
    ``OSError(ENOSPC)``, as a full disk would (it stays full).
  - a damaged file: the copy of the run (or a checkpoint) is truncated or has bytes flipped before the command.
Publishing has no stage recorder: its "stage" hook is the first file it places into ``publish/``.

The GPU steps run on the CPU with only the GPU parts faked (tests/fixtures/fake_cuda.py): AOTInductor's compile
stores a real ELF library as each method's ``.so``, and the ``.so`` is "run" by the rewritten program it was
compiled from, fed in the delegate's input order, after checking that the bytes handed over are the compiled
ones (a damaged library fails to load, as dlopen would).

Children are forked from a server that has imported torch, executorch and zoo once and built one good run of
its own (``multiprocessing``'s forkserver; tests/support/fault_warmup.py): each case costs only its own work, which
keeps the whole table CI-cheap.
"""

from __future__ import annotations

# First: the sandbox and the toy family, in the fork server and its children too.
from support.environment import FIXTURES, TEST_RECIPES, TESTS  # noqa: I001

import contextlib
import errno
import hashlib
import importlib.util
import json
import multiprocessing
import multiprocessing.forkserver
import os
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest
import torch

import zoo.core.atomic
import zoo.cli.export
import zoo.export.stages
import zoo.cli.lower
import zoo.export.lower.method_lowering
import zoo.export.pipeline
import zoo.cli.publish
import zoo.export.publish.upload
import zoo.core.report
import zoo.export.verify
from zoo.__main__ import main as zoo_main
from zoo.contract.run_folder import ATTEMPTS_DIR, RunFolder

TOY_RECIPE = TEST_RECIPES / "toy-rope.yaml"
REPO_ID = "zoo-test/toy-rope-cuda"  # what publish --dry-run stages for
TIMEOUT = 300

_spec = importlib.util.spec_from_file_location("zoo_test_fake_cuda", FIXTURES / "fake_cuda.py")
fake_cuda = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake_cuda)

EXPORT_STAGES = ("fabricate", "pull", "build", "export", "rewrite", "cpu_check", "save", "preflight")
LOWER_STAGES = ("preflight", "lower", "audit", "verify")
SIGNALS = {"SIGINT": signal.SIGINT, "SIGKILL": signal.SIGKILL}


# --------------------------------------------------------------------------------------------------------
# Cases


@dataclass(frozen=True)
class Case:
    command: str  # export | lower | verify (lower --verify-only) | publish | audit | audit-so
    stage: str  # where the fault is injected ("" for a damaged file)
    fault: str  # SIGINT | SIGKILL | ENOSPC | "truncated model.pte" | ...
    exit_code: int  # the documented exit code the user must get (-9: killed)
    words: Tuple[str, ...] = ()  # what the message must say
    intact: bool = True  # the earlier run must be byte for byte as it was (False: the attempt replaced it)

    @property
    def recorded_stage(self) -> str:
        """The stage the attempt's report names: where a GPU lowers (faked here), the kernel preflight runs inside
        each method's lowering, so a fault there is the "lower" stage's."""
        return "lower" if (self.command, self.stage) == ("lower", "preflight") else self.stage

    @property
    def id(self) -> str:
        return f"{self.command}-{self.stage or 'files'}-{self.fault}".replace(" ", "_").replace("/", "_")


def signal_cases() -> List[Case]:
    cases = []
    for command, stages in (("export", EXPORT_STAGES), ("lower", LOWER_STAGES), ("publish", ("publish",))):
        for stage in stages:
            cases.append(Case(command, stage, "SIGINT", 130, ("interrupted during",) if command != "publish"
                              else ("interrupted",)))
            cases.append(Case(command, stage, "SIGKILL", -signal.SIGKILL))
            cases.append(Case(command, stage, "ENOSPC", 2, ("No space left on device",)))
    return cases


def file_cases() -> List[Case]:
    """Damaged files given to the commands that read them."""
    return [
        Case("export", "", "truncated model.safetensors", 2, ("model.safetensors is truncated",)),
        Case("lower", "", "truncated rewritten.forward.pt2", 2, ("rewritten.forward.pt2 cannot be read",)),
        Case("lower", "", "truncated model.pte", 0, (), intact=False),  # lowering makes a new one: it replaces
        Case("verify", "", "truncated model.pte", 2, ("model.pte is not a readable ExecuTorch program",)),
        Case("verify", "", "corrupt model.pte", 2, ("is not an ELF shared library",)),  # the audit reads it first
        Case("verify", "", "truncated aoti_cuda_blob.ptd", 2, ("aoti_cuda_blob.ptd",)),
        Case("verify", "", "corrupt aoti_cuda_blob.ptd", 3, ("cannot be loaded",)),
        # The .so that runs is the one inside model.pte: verified again, the attempt replaces the run.
        Case("verify", "", "truncated so/forward.so", 0, (), intact=False),
        Case("verify", "", "truncated exported.forward.pt2", 2, ("exported.forward.pt2 cannot be read",)),
        Case("audit", "", "truncated model.pte", 2, ("model.pte is not a readable ExecuTorch program",)),
        Case("audit", "", "corrupt model.pte", 2, ("is not an ELF shared library",)),
        # The audit reads the .ptd's index too (what each runtime does with the weights): a damaged one is named.
        Case("audit", "", "truncated aoti_cuda_blob.ptd", 2, ("aoti_cuda_blob.ptd",)),
        Case("audit-so", "", "truncated so/forward.so", 2, ("is not an ELF shared library",)),
        Case("publish", "", "truncated model.pte", 2, ("model.pte: sha256",)),
        Case("publish", "", "truncated aoti_cuda_blob.ptd", 2, ("aoti_cuda_blob.ptd: sha256",)),
        Case("publish", "", "corrupt model.pte", 2, ("model.pte: sha256",)),
        Case("publish", "", "truncated so/forward.so", 0, ()),  # so/ is derived from model.pte and not shipped
    ]


def all_cases() -> List[Case]:
    return signal_cases() + file_cases()


# The default run's cases (``pytest -q``): one per command and kind of fault (SIGINT, SIGKILL, a full disk, a
# truncated file, a corrupt file), where (the stage, or the damaged file) chosen so that every outcome of the
# table is still met: an attempt kept beside the run, a staging folder left by a kill, a fault in the preflight
# recorded under "lower", a report that cannot be written, an attempt that replaces the run (exit 0), an artifact
# that computes wrong numbers (exit 3). The other cases are marked e2e (``pytest -m e2e``).
DEFAULT = {
    ("export", "SIGINT"): "cpu_check", ("export", "SIGKILL"): "save", ("export", "ENOSPC"): "save",
    ("lower", "SIGINT"): "preflight", ("lower", "SIGKILL"): "lower", ("lower", "ENOSPC"): "verify",
    ("publish", "SIGINT"): "publish", ("publish", "SIGKILL"): "publish", ("publish", "ENOSPC"): "publish",
    ("export", "truncated"): "model.safetensors", ("lower", "truncated"): "model.pte",
    ("verify", "truncated"): "exported.forward.pt2", ("verify", "corrupt"): "aoti_cuda_blob.ptd",
    ("audit", "truncated"): "model.pte", ("audit", "corrupt"): "model.pte", ("audit-so", "truncated"): "so/forward.so",
    ("publish", "truncated"): "aoti_cuda_blob.ptd", ("publish", "corrupt"): "model.pte",
}


def kind_of(case: Case) -> Tuple[str, str]:
    """(command, kind of fault): a signal or a full disk at any stage, or how a file was damaged."""
    return case.command, case.fault if case.stage else case.fault.split(" ", 1)[0]


def is_default(case: Case) -> bool:
    where = case.stage or case.fault.split(" ", 1)[1]
    return DEFAULT.get(kind_of(case)) == where


# --------------------------------------------------------------------------------------------------------
# The good run every case starts from


def good_run(folder: Path) -> Path:
    """A verified toy run with publish/ staged: export on the CPU, then lower, audit and verify with the GPU
    compile faked, then ``publish --dry-run``. Built once; every case works on a copy."""
    run = folder / "toy-rope"
    assert zoo.cli.export.main([str(TOY_RECIPE), "--output-dir", str(run)]) == 0
    with pytest.MonkeyPatch.context() as patch:
        install_fake_gpu(patch)
        assert zoo.cli.lower.main([str(run)]) == 0
    assert zoo.cli.publish.main([str(run), "--repo-id", REPO_ID, "--dry-run"]) == 0
    assert RunFolder(run).status() == "verified"
    return run


def hashes(run: Path) -> Dict[str, str]:
    """sha256 of every file of the run, its attempts/ left out (later attempts are kept there)."""
    out = {}
    for path in sorted(run.rglob("*")):
        rel = path.relative_to(run)
        if path.is_file() and rel.parts[0] != ATTEMPTS_DIR:
            out[rel.as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def damage(run: Path, fault: str, checkpoint: Optional[Path]) -> List[str]:
    """Damage the file the case names; returns extra command-line arguments (a checkpoint folder)."""
    how, name = fault.split(" ", 1)
    target = (checkpoint / name) if name == "model.safetensors" else run / name
    data = target.read_bytes()
    if how == "truncated":
        target.write_bytes(data[: len(data) // 2])
    else:  # corrupt: flip 64 bytes (size unchanged) where they matter: the shipped library's ELF header, or
        # (a .ptd) the end, where the weights are
        at = data.find(b"\x7fELF")
        at = at if at >= 0 else len(data) - 64
        target.write_bytes(data[:at] + bytes(b ^ 0xFF for b in data[at:at + 64]) + data[at + 64:])
    if name == "model.safetensors":
        return [f"source.local_dir={checkpoint}", "source.fabricate=false"]
    return []


def argv(case: Case, run: Path, extra: List[str]) -> List[str]:
    return {
        "export": ["export", str(TOY_RECIPE), *extra, "--output-dir", str(run)],
        "lower": ["lower", str(run)],
        "verify": ["lower", str(run), "--verify-only"],
        "publish": ["publish", str(run), "--repo-id", REPO_ID, "--dry-run"],
        "audit": ["audit", str(run)],
        "audit-so": ["audit", str(run / "so" / "forward.so")],
    }[case.command]


# --------------------------------------------------------------------------------------------------------
# The child: zoo's command line with the fault injected


def install_fake_gpu(patch) -> None:
    """Only the GPU parts faked: AOTInductor's compile (fake_cuda) and loading the .so (ShippedProgram)."""
    fake_cuda.FakeCudaCompile({}).install(patch)
    patch.setattr(zoo.export.verify, "aoti_runners", lambda state: ShippedProgram)
    patch.setattr(zoo.export.verify, "_default_device", lambda: "cpu")


class ShippedProgram:
    """Stands in for torch's AOTI runner over a shipped .so: the bytes handed over must be the compiled library
    and weights (anything else fails to load, as dlopen would); it then runs the rewritten program the .so was
    compiled from, taking inputs and returning outputs in the delegate's order (so/<method>.io.json)."""

    def __init__(self, method: str, so: Path, weights: Optional[Path], device: str):
        if Path(so).read_bytes() != fake_cuda.FakeCudaCompile({}).so_bytes(method):
            raise RuntimeError(f"{so}: invalid ELF header (dlopen failed)")
        if weights is None or Path(weights).read_bytes() != fake_cuda.weights_bytes(method):
            raise RuntimeError(f"{weights}: constants blob does not match the library")
        run = RunFolder(Path(so).parent.parent)  # the run folder (or its staging) the .so came from
        self.order = run.io_order(method)
        self.module = run.load_program("rewritten", method).module()

    def run(self, inputs):
        signature = [None] * len(inputs)
        for k, i in enumerate(self.order["input_order"]):
            signature[i] = inputs[k]
        with torch.no_grad():
            out = self.module(*signature)
        outs = list(out) if isinstance(out, (list, tuple)) else [out]
        so_order = [None] * len(outs)
        for j, k in enumerate(self.order["output_order"]):
            so_order[k] = outs[j]
        return so_order


def _inject(fault: str) -> None:
    if fault in SIGNALS:
        os.kill(os.getpid(), SIGNALS[fault])
        time.sleep(30)  # the signal lands here (SIGINT raises KeyboardInterrupt out of the sleep)
        raise AssertionError(f"{fault} did not stop the process")
    if fault == "ENOSPC":
        zoo.core.atomic.atomic_path = _disk_full


@contextlib.contextmanager
def _disk_full(target):
    """zoo's atomic writer on a full disk: every write fails, as the OS reports it."""
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))
    yield  # pragma: no cover  (a generator, so that it is a context manager like the real one)


def _hook_stages(stage: str, fault: str) -> None:
    """Wrap the stage recorder where zoo's modules use it: the fault hits once the stage has started."""
    real = zoo.core.report.timed_stage

    @contextlib.contextmanager
    def timed_stage(report, name, label):
        with real(report, name, label) as facts:
            if name == stage:
                _inject(fault)
            yield facts

    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("zoo") and getattr(module, "timed_stage", None) is real:
            module.timed_stage = timed_stage
    if stage == "preflight":
        # Where a GPU lowers, the kernel preflight runs inside each method's lowering, on its edge program
        # (zoo.export.lower.method_lowering.lower_with_partitioner), under the "lower" stage: the fault hits when it starts.
        preflight = zoo.export.lower.method_lowering.require_kernels

        def require_kernels(*args, **kwargs):
            _inject(fault)
            return preflight(*args, **kwargs)

        zoo.export.lower.method_lowering.require_kernels = require_kernels


def _hook_publish(fault: str) -> None:
    real = zoo.export.publish.upload._place
    state = {"first": True}

    def place(src, dst):
        if state.pop("first", False):
            _inject(fault)
        return real(src, dst)

    zoo.export.publish.upload._place = place


def _as_started(out: str, err: str, pythonpath: Optional[str]) -> None:
    """A forked child's stdout/stderr to files, and the PYTHONPATH of the test that started it."""
    if pythonpath is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = pythonpath
    for fd, path in ((1, out), (2, err)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(handle, fd)
        os.close(handle)


def _good_run_child(folder: str, log: str, pythonpath: Optional[str]) -> None:
    _as_started(log, log, pythonpath)
    good_run(Path(folder))
    sys.stdout.flush()
    sys.stderr.flush()


def child(case: Dict, run: str, extra: List[str], out: str, err: str, pythonpath: Optional[str]) -> None:
    """The forked child: stdout/stderr to files, the fault installed, zoo's command line run (in the
    environment of the test that started it: ``pythonpath`` is its PYTHONPATH)."""
    _as_started(out, err, pythonpath)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    c = Case(**{**case, "words": tuple(case["words"])})
    patch = pytest.MonkeyPatch()
    if c.command in ("lower", "verify"):
        install_fake_gpu(patch)
    if c.stage == "publish":
        _hook_publish(c.fault)
    elif c.stage:
        _hook_stages(c.stage, c.fault)
    code = zoo_main(argv(c, Path(run), extra))
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


# --------------------------------------------------------------------------------------------------------
# Running a case


@dataclass
class Outcome:
    case: Case
    exit_code: Optional[int]
    stdout: str
    stderr: str
    failed_at: str = "-"
    message: str = ""
    intact: Optional[bool] = None
    changed: List[str] = field(default_factory=list)
    leftovers: List[str] = field(default_factory=list)
    attempt: Optional[str] = None  # the attempt folder the message names, where one was kept

    def row(self) -> List[str]:
        c = self.case
        intact = ("yes" if self.intact else "NO: " + ", ".join(self.changed[:3])) if c.intact else \
            ("replaced by the new verified attempt" if not self.intact else "yes")
        return [c.command, c.stage or "-", c.fault, str(self.exit_code), self.failed_at, self.message, intact]


_CONTEXT: List[multiprocessing.context.BaseContext] = []


def _context():
    if not _CONTEXT:
        ctx = multiprocessing.get_context("forkserver")
        # support.fault_warmup builds one good run in the server, so that the first-use set-up of torch.export and
        # ExecuTorch is not paid again by every child.
        ctx.set_forkserver_preload(["support.faults", "support.fault_warmup"])
        # The server imports its preload modules before it knows this process's sys.path (Python 3.12's
        # forkserver does not apply it), so it finds them only through PYTHONPATH: without it the import fails
        # silently and every case imports torch, executorch and zoo anew. The children get PYTHONPATH back as
        # this process has it (``child``).
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), *_pythonpath()]))
            multiprocessing.forkserver.ensure_running()
        _CONTEXT.append(ctx)
    return _CONTEXT[0]


def _pythonpath() -> List[str]:
    return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


def forked_good_run(folder: Path) -> Path:
    """``good_run`` in a child of the fork server, which has paid torch.export's and ExecuTorch's first-use set-up
    already: it costs only the run's own work (in the test's process, that set-up again). Its output goes to
    ``folder/good_run.log``."""
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "good_run.log"
    process = _context().Process(target=_good_run_child, args=(str(folder), str(log), os.environ.get("PYTHONPATH")))
    process.start()
    process.join(TIMEOUT)
    if process.is_alive():
        process.kill()
        process.join()
    assert process.exitcode == 0, f"the good run failed (exit {process.exitcode}):\n{log.read_text()[-3000:]}"
    return folder / "toy-rope"


def run_case(case: Case, run: Path, checkpoint: Optional[Path], logs: Path) -> Outcome:
    """Damage what the case names, run its command in a forked child, and compare the run with its hashes."""
    extra = damage(run, case.fault, checkpoint) if not case.stage else []
    before = hashes(run)
    logs.mkdir(parents=True, exist_ok=True)
    out, err = logs / f"{case.id}.out", logs / f"{case.id}.err"
    process = _context().Process(target=child, args=(asdict(case), str(run), extra, str(out), str(err),
                                                     os.environ.get("PYTHONPATH")))
    process.start()
    process.join(TIMEOUT)
    if process.is_alive():
        process.kill()
        process.join()
        raise AssertionError(f"{case.id}: still running after {TIMEOUT} s")
    outcome = Outcome(case, process.exitcode, out.read_text(errors="replace"), err.read_text(errors="replace"))
    after = hashes(run)
    outcome.changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    outcome.intact = not outcome.changed
    outcome.leftovers = sorted(p.name for p in run.parent.iterdir() if p.name.startswith(f".{run.name}."))
    outcome.leftovers += sorted(p.name for p in run.iterdir() if p.name.startswith(".")) if run.is_dir() else []
    outcome.message = _message(outcome.stderr).replace(f"{run.parent.parent}/", "")  # paths from runs/
    outcome.failed_at = _failed_at(run, outcome)
    return outcome


def _message(stderr: str) -> str:
    """The line the user reads: zoo's error, or its interrupted line."""
    for line in stderr.splitlines():
        if line.startswith("error: ") or line.startswith("interrupted"):
            return line.removeprefix("error: ")
    return ""


def _failed_at(run: Path, outcome: Outcome) -> str:
    """The stage the attempt's own report names (the newest attempt kept beside the run, else the run's)."""
    folder = RunFolder(run)
    reports = [a for a in folder.attempts() if a.report_json.is_file()]
    if reports:
        newest = max(reports, key=lambda a: a.report_json.stat().st_mtime)
        outcome.attempt = str(newest.path)
        return json.loads(newest.report_json.read_text()).get("failed_stage") or "-"
    return "-"


def markdown_table(rows: List[List[str]]) -> str:
    """The table of outcomes' rows (``Outcome.row``)."""
    from zoo.core.report import markdown_table as table

    header = ["command", "stage", "fault", "exit", "failed at", "message", "earlier run intact"]
    return table([header] + rows)


def write_table_rows(path: Path, rows: List[List[str]]) -> None:
    """Append outcomes' rows as JSON lines (``tools/fault_table.py`` reads them)."""
    with open(path, "a") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")


def copy_run(good: Path, folder: Path) -> Path:
    run = folder / good.name
    shutil.copytree(good, run, symlinks=True)
    return run
