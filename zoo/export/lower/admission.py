"""Admission of lowering workers against the machine's memory, across every zoo process of the machine.

``choose_workers`` bounds one lowering's workers by the memory it sees when it starts; two lowerings started side
by side each see all of it, start all their workers and together exhaust it. So each worker, before it starts,
claims its memory estimate in a ledger every zoo process of the machine shares, and starts only when the
estimate fits in the memory not yet promised to the workers already running:

    room = available - sum(max(0, claimed - in use) for every live claim)
    a worker starts when  need <= room,  or when no live claim is held at all

``available`` is MemAvailable now (``ZOO_LOWERING_MEMORY_BYTES`` stands in for it: tests, trying the rule), which
already counts what the running workers use; what they still expect to take on top is their estimate less their
resident memory (VmRSS). A lone claim always starts (as ``choose_workers`` starts at least one worker), so a
lowering never waits for nothing, and waiting ends when the running workers end: only started workers hold
claims, and they finish or fail.

The ledger: one JSON file per claim (its zoo process, the worker's pid once started, the estimate, the method,
the run folder) in ``ZOO_LOWERING_LEDGER_DIR``, by default ``zoo-lowering-<user>`` in the system's temporary
folder; read and changed under an exclusive ``flock`` of its ``.lock`` file, each claim written atomically. A
claim whose zoo process has died (SIGKILL leaves its file) is stale: removed by the next reader, never counted.
A claim whose worker has exited is not counted either (its memory is free; its process releases it next).
Docs: docs/ARCHITECTURE.md, "Lowerings side by side on one machine".
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import json
import os
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from zoo.core import atomic
from zoo.core.errors import LoweringError

ENV_LEDGER_DIR = "ZOO_LOWERING_LEDGER_DIR"
# A whole number of bytes taken as the machine's available memory at every look, in place of MemAvailable.
ENV_MEMORY = "ZOO_LOWERING_MEMORY_BYTES"
_LOCK = ".lock"
GIB = float(1 << 30)


def available_memory_bytes() -> Optional[int]:
    """``ZOO_LOWERING_MEMORY_BYTES`` if set, else MemAvailable of /proc/meminfo (Linux); None where neither is."""
    override = os.environ.get(ENV_MEMORY)
    if override:
        try:
            return int(override)
        except ValueError:
            raise LoweringError(f"{ENV_MEMORY}={override!r} is not a whole number of bytes",
                                f"set {ENV_MEMORY} to the memory lowerings may count on, in bytes, or unset it "
                                "to use the machine's MemAvailable") from None
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def admits(need: int, available: Optional[int], others: Sequence[Tuple[int, int]]) -> Tuple[bool, Optional[int]]:
    """Whether a worker needing ``need`` bytes may start, and the room it was judged against. ``others``: the
    live claims as (claimed, in use) bytes. No other claim, or no figure for the machine: it starts."""
    if available is None:
        return True, None
    room = available - sum(max(0, claimed - used) for claimed, used in others)
    return (not others or need <= room), room


def ledger_folder() -> Path:
    """``ZOO_LOWERING_LEDGER_DIR``, else ``zoo-lowering-<user>`` in the temporary folder (TMPDIR, else /tmp)."""
    configured = os.environ.get(ENV_LEDGER_DIR)
    if configured:
        return Path(configured)
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container without a passwd entry)
        user = str(os.getuid())
    return Path(tempfile.gettempdir()) / f"zoo-lowering-{user}"


# --- processes ---------------------------------------------------------------------------------------------


def process_start(pid: int) -> Optional[int]:
    """When ``pid`` started (clock ticks since boot, /proc/PID/stat); None if it is not running (a zombie counts
    as ended) or where /proc cannot tell. With the pid it names one process: a pid reused later starts later."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def running(pid: Optional[int], start: Optional[int]) -> bool:
    """Whether the process ``pid`` that started at ``start`` still runs."""
    if pid is None:
        return False
    if Path("/proc/self/stat").exists():
        now = process_start(pid)
        return now is not None and (start is None or now == start)
    return atomic.process_alive(pid)  # no /proc: whether the pid exists at all


def resident_bytes(pid: int) -> int:
    """The resident memory of ``pid`` (VmRSS); 0 where it cannot be read, which counts its whole claim as still
    to come."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return 0


# --- the ledger --------------------------------------------------------------------------------------------


@dataclass
class Claim:
    """One worker's memory estimate, held from just before it starts until it has ended."""

    id: str
    owner: int  # the zoo process lowering (it releases the claim)
    owner_start: Optional[int]
    need: int  # bytes, the worker's estimate at its peak
    method: str
    run: str
    worker: Optional[int] = None  # the worker's pid once started (this process's own when lowering in it)
    worker_start: Optional[int] = None
    since: float = field(default_factory=time.time)

    def live(self) -> bool:
        """Counted: its zoo process runs and its worker has not started yet or still runs."""
        return running(self.owner, self.owner_start) and (
            self.worker is None or running(self.worker, self.worker_start))


@dataclass
class Verdict:
    """What one look at the ledger found for a worker that asked to start."""

    admitted: bool
    method: str
    need: int
    available: Optional[int]
    room: Optional[int]
    held: List[Tuple[Claim, int]]  # the live claims it was judged against, with the bytes each worker uses
    claim: Optional[Claim] = None  # written when admitted

    def words(self) -> str:
        """The waiting line: what this worker needs, what is free, and who holds what."""
        holders = "; ".join(
            f"zoo process {c.owner} lowering {c.method}" + (f" (worker {c.worker})" if c.worker else "")
            + f" for {c.run}: {c.need / GIB:.1f} GiB claimed, {used / GIB:.1f} GiB in use" for c, used in self.held)
        return (f"lowering {self.method} waits for memory: it needs ~{self.need / GIB:.1f} GiB and "
                f"{max(self.room or 0, 0) / GIB:.1f} GiB of the {(self.available or 0) / GIB:.1f} GiB available "
                f"are not promised to the lowering workers running: {holders}. It starts when they have ended "
                f"or freed enough")


class Ledger:
    """The machine's claims, in ``folder`` (default ``ledger_folder()``). ``available`` and ``in_use`` stand in
    for MemAvailable and a pid's resident memory (tests)."""

    def __init__(self, folder: Optional[Path] = None, *,
                 available: Callable[[], Optional[int]] = available_memory_bytes,
                 in_use: Callable[[int], int] = resident_bytes):
        self.folder = Path(folder) if folder is not None else ledger_folder()
        self._available = available
        self._in_use = in_use

    def try_claim(self, method: str, need: int, run: str) -> Verdict:
        """Look, judge (``admits``) and, when admitted, write the claim: all under the lock, so two workers
        cannot both take the same room."""
        with self._locked():
            held = [(c, self._in_use(c.worker) if c.worker is not None else 0) for c in self._read_live()]
            available = self._available()
            admitted, room = admits(need, available, [(c.need, used) for c, used in held])
            verdict = Verdict(admitted, method, need, available, room, held)
            if admitted:
                me = os.getpid()
                verdict.claim = Claim(id=f"{me}-{uuid.uuid4().hex[:12]}", owner=me, owner_start=process_start(me),
                                      need=int(need), method=method, run=run)
                self._write(verdict.claim)
            return verdict

    def started(self, claim: Claim, pid: int) -> None:
        """The claim's worker runs as ``pid``: from now on what it uses counts against its claim."""
        claim.worker, claim.worker_start = pid, process_start(pid)
        with self._locked():
            self._write(claim)

    def release(self, claim: Claim) -> None:
        with self._locked():
            self._path(claim.id).unlink(missing_ok=True)

    def live_claims(self) -> List[Claim]:
        """The claims counted now (stale ones removed)."""
        with self._locked():
            return self._read_live()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self._ensure_folder()
        fd = os.open(self.folder / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released by the kernel too if this process is killed holding it
            yield
        finally:
            os.close(fd)

    def _ensure_folder(self) -> None:
        try:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            owner = self.folder.stat().st_uid
        except OSError as exc:
            raise LoweringError(f"the lowering workers' memory ledger {self.folder} cannot be made: {exc}",
                                f"set {ENV_LEDGER_DIR} to a folder of yours every lowering on this machine sees"
                                ) from exc
        if owner != os.getuid():  # another user's folder: its claims, and what it lets us write, are not ours
            raise LoweringError(f"the lowering workers' memory ledger {self.folder} belongs to another user",
                                f"set {ENV_LEDGER_DIR} to a folder of yours every lowering on this machine sees")

    def _read_live(self) -> List[Claim]:
        """Every claim file read; a stale one (its zoo process dead) or an unreadable one removed."""
        live = []
        for path in sorted(self.folder.glob("*.json")):
            try:
                claim = Claim(**json.loads(path.read_text()))
            except (OSError, ValueError, TypeError):
                path.unlink(missing_ok=True)
                continue
            if not running(claim.owner, claim.owner_start):
                path.unlink(missing_ok=True)
            elif claim.live():
                live.append(claim)
        return live

    def _path(self, claim_id: str) -> Path:
        return self.folder / f"{claim_id}.json"

    def _write(self, claim: Claim) -> None:
        atomic.write_json(self._path(claim.id), asdict(claim))


class Gate:
    """One lowering's workers admitted one by one: ``enter`` before a worker starts (False: not now, try again),
    ``started`` with its pid, ``leave`` once it has ended. A method without an estimate passes unclaimed. While a
    worker waits, its line is said at once and then every ``every_s``; the ledger is read at most every
    ``retry_s``."""

    def __init__(self, run: str, say: Callable[[str], None], *, ledger: Optional[Ledger] = None,
                 every_s: float = 60.0, retry_s: float = 1.0):
        self.run, self.say, self.every_s, self.retry_s = run, say, every_s, retry_s
        self._ledger = ledger
        self._claims: Dict[str, Claim] = {}
        self._waiting: Dict[str, Tuple[float, float]] = {}  # method -> (since, last said)
        self._last_try = -float("inf")

    @property
    def ledger(self) -> Ledger:
        if self._ledger is None:
            self._ledger = Ledger()
        return self._ledger

    def enter(self, method: str, need: Optional[int]) -> bool:
        if need is None:
            return True
        now = time.monotonic()
        if method in self._waiting and now - self._last_try < self.retry_s:
            return False
        self._last_try = now
        verdict = self.ledger.try_claim(method, need, self.run)
        since, said = self._waiting.get(method, (now, -float("inf")))
        if verdict.admitted:
            self._claims[method] = verdict.claim
            if self._waiting.pop(method, None) is not None:
                self.say(f"lowering {method}: the memory it needs is free after {now - since:.0f} s of waiting")
            return True
        if now - said >= self.every_s:
            self.say(verdict.words())
            said = now
        self._waiting[method] = (since, said)
        return False

    def wait(self, method: str, need: Optional[int], poll_s: float = 1.0) -> None:
        """``enter`` until admitted (a method lowered in this process)."""
        while not self.enter(method, need):
            time.sleep(poll_s)

    def started(self, method: str, pid: int) -> None:
        if method in self._claims:
            self.ledger.started(self._claims[method], pid)

    def leave(self, method: str) -> None:
        claim = self._claims.pop(method, None)
        if claim is not None:
            self.ledger.release(claim)

    def leave_all(self) -> None:
        for method in list(self._claims):
            self.leave(method)
