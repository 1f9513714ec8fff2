"""What a person at the terminal sees while zoo works, and the run's log file.

- ``say(message)``: a start or done line, ``[zoo] ...``, on stderr (and in the run's log). Always printed, also
  when stderr is not a terminal: CI logs keep every start and done line.
- ``steps(items, what)`` / ``Progress(what, total)``: a tqdm bar over the steps of a long stage (methods,
  seeds x sizes, files). It appears only on a terminal and only once the stage has run for ``BAR_DELAY``
  seconds, so short stages and CI logs stay quiet. A clock keeps the elapsed time moving during a long step.
- ``warn(message)``: zoo's own warning, always on the terminal.
- ``run_log(path)``: while a run goes on, what its dependencies print on stderr (warnings, their loggers)
  goes to the run's log file instead of the terminal; zoo's own lines go to both.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import threading
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, TextIO

log = logging.getLogger("zoo")

BAR_DELAY = 10.0  # seconds a stage runs before its bar is drawn
ZOO_PACKAGE = str(Path(__file__).resolve().parents[1])

# Warnings raised from zoo's own frames that are really a dependency's (seen while exporting the tiny recipes):
# they go to the log like any other dependency warning.
DEPENDENCY_WARNINGS = (
    re.compile(r"LeafSpec"),  # copyreg FutureWarning of torch's pytree, unpickling exported programs
    re.compile(r"The given buffer is not writable"),  # torch.frombuffer over read-only bytes (safetensors)
    re.compile(r"should be kept in float32"),  # diffusers, a Wan VAE built in bf16
)


class _Output:
    """Where zoo's own lines go: the terminal stream of the command (stderr when the run began) and the log."""

    terminal: Optional[TextIO] = None
    log: Optional[TextIO] = None
    captured = 0  # dependency lines that went only to the log
    pending: Optional[io.StringIO] = None  # dependency output from before the run's log existed (held_back)


def terminal() -> TextIO:
    return _Output.terminal or sys.stderr


def _to_log(text: str) -> None:
    if _Output.log is not None:
        with contextlib.suppress(OSError, ValueError):  # a full disk must not turn a progress line into an error
            _Output.log.write(text if text.endswith("\n") else text + "\n")


def say(message: str) -> None:
    """A progress line for the person at the terminal (and the run's log)."""
    line = f"[zoo] {message}"
    print(line, file=terminal(), flush=True)
    _to_log(line)


def warn(message: str) -> None:
    """zoo's own warning: always shown on the terminal, never only in a log."""
    say(f"warning: {message}")


def setup_logging(verbose: bool = False) -> None:
    if getattr(setup_logging, "_done", False):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[zoo] %(levelname)s %(message)s"))
    root = logging.getLogger("zoo")
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    root.propagate = False
    setup_logging._done = True  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------------------------
# Bars


def bars_on() -> bool:
    """Bars are drawn on a terminal only (never into a CI log); ZOO_NO_PROGRESS=1 turns them off."""
    stream = terminal()
    return bool(getattr(stream, "isatty", lambda: False)()) and not os.environ.get("ZOO_NO_PROGRESS")


class Progress:
    """A tqdm bar over ``total`` steps of ``what``, drawn once the work has lasted ``BAR_DELAY`` seconds.

    ``begin(label)`` names the step now running; ``advance()`` counts it done. While a bar is shown, a clock
    thread redraws it every second, so a single long step (one method's compile) still shows time passing.
    """

    def __init__(self, what: str, total: Optional[int] = None, unit: str = "step"):
        self._bar = None
        self._stop = threading.Event()
        self._clock: Optional[threading.Thread] = None
        if not bars_on():
            return
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc=f"[zoo] {what}", unit=unit, delay=BAR_DELAY, file=terminal(),
                         leave=False, dynamic_ncols=True)
        self._clock = threading.Thread(target=self._tick, name="zoo-progress", daemon=True)
        self._clock.start()

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            bar = self._bar
            if bar is not None:
                with contextlib.suppress(Exception):  # a bar closed under our feet: nothing to draw
                    bar.refresh()

    def begin(self, label: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(label, refresh=False)

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        self._stop.set()
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def steps(items: Iterable[Any], what: str, *, label: Optional[Callable[[Any], str]] = None,
          total: Optional[int] = None, unit: str = "step") -> Iterator[Any]:
    """Iterate over ``items`` with a ``Progress`` bar; ``label(item)`` names the step while it runs."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with Progress(what, total, unit) as bar:
        for item in items:
            bar.begin(label(item) if label is not None else str(item))
            yield item
            bar.advance()


@contextlib.contextmanager
def on_terminal() -> Iterator[None]:
    """Let a dependency draw its own progress on the terminal for the block (huggingface_hub's per-file
    download bars), although a run's dependency output otherwise goes to its log."""
    saved = sys.stderr
    sys.stderr = terminal()
    try:
        yield
    finally:
        sys.stderr = saved


# --------------------------------------------------------------------------------------------------------
# The run's log


@contextlib.contextmanager
def held_back(verbose: bool = False) -> Iterator[None]:
    """Dependency output of a step that runs without a run log (importing a policy family before the log exists;
    the deploy commands, which write none) is held back: written into the next ``run_log`` if one follows, printed
    to the terminal if the block fails, so that a failure still shows what the libraries said."""
    if verbose:
        yield
        return
    buffer = io.StringIO()
    saved_stderr, saved_stdout, saved_terminal = sys.stderr, sys.stdout, _Output.terminal
    _Output.terminal = terminal()  # zoo's own lines (say) keep reaching the terminal
    stand_in = _DependencyOutput(buffer, saved_stderr, echo=False)
    redirected = _terminal_handlers(saved_stderr)
    sys.stderr = stand_in
    sys.stdout = _ZooStdout(saved_stdout, stand_in)
    for h in redirected:
        h.setStream(stand_in)
    failed = False
    try:
        yield
    except BaseException:
        failed = True
        raise
    finally:
        sys.stderr, sys.stdout, _Output.terminal = saved_stderr, saved_stdout, saved_terminal
        # Handlers made inside the block (a library configuring its logger on import) hold the stand-in: they
        # go back to the terminal stream too, where run_log finds and redirects them.
        for h in redirected + _handlers_on(stand_in):
            h.setStream(saved_stderr)
        stand_in.detach_run()
        if failed:
            saved_stderr.write(buffer.getvalue())
        else:
            _Output.pending = buffer


class _ZooStdout(io.TextIOBase):
    """Stands in for sys.stdout while a run goes on: zoo's own prints (its tables) reach the terminal, a
    dependency's (LeRobot's "Loading weights from local directory") go where its stderr goes, the log."""

    def __init__(self, stdout: TextIO, dependency: "_DependencyOutput"):
        super().__init__()
        self._stdout, self._dependency = stdout, dependency

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        # print() is C code: the frame that called it is the one just above this write.
        caller = sys._getframe(1).f_globals.get("__name__", "")
        own = caller == "__main__" or caller == "zoo" or caller.startswith("zoo.")
        return (self._stdout if own else self._dependency).write(text)

    def flush(self) -> None:
        self._stdout.flush()
        self._dependency.flush()

    def isatty(self) -> bool:
        return self._stdout.isatty()

    def fileno(self) -> int:
        return self._stdout.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._stdout, "encoding", "utf-8")


class _DependencyOutput(io.TextIOBase):
    """Stands in for sys.stderr while a run goes on: what dependencies print goes to the log file (and, with
    ``echo``, on to the terminal too). A library that kept a reference to it writes to the terminal again
    once the run is over (``detach``)."""

    def __init__(self, log_file: TextIO, terminal_stream: TextIO, echo: bool):
        super().__init__()
        self._log, self._terminal, self._echo = log_file, terminal_stream, echo
        self._attached = True

    def detach_run(self) -> None:
        self._attached = False

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if not self._attached:
            return self._terminal.write(text)
        if text.strip():
            with contextlib.suppress(OSError, ValueError):  # a full disk must not turn a line into an error
                self._log.write(text if text.endswith("\n") else text + "\n")
            _Output.captured += 1
        if self._echo:
            self._terminal.write(text)
        return len(text)

    def flush(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            (self._log if self._attached else self._terminal).flush()

    def isatty(self) -> bool:
        return False  # no dependency draws a progress bar into the log

    def fileno(self) -> int:
        # A child process handed "our stderr" writes into the log (the terminal's, once the run is over).
        return (self._log if self._attached else self._terminal).fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"


def _is_zoo_warning(message: Any, filename: str) -> bool:
    text = str(message)
    if any(p.search(text) for p in DEPENDENCY_WARNINGS):
        return False
    return os.path.abspath(filename).startswith(ZOO_PACKAGE)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    text = warnings.formatwarning(message, category, filename, lineno, line)
    if _is_zoo_warning(message, filename):
        print(text.rstrip(), file=terminal(), flush=True)
        _to_log(text)
    else:
        _to_log(text)
        _Output.captured += 1


def _handlers_on(stream: TextIO) -> list:
    """Stream handlers of every logger that write to ``stream``."""
    loggers = [logging.getLogger()] + [logger for logger in logging.Logger.manager.loggerDict.values()
                                       if isinstance(logger, logging.Logger)]
    return [h for logger in loggers for h in logger.handlers
            if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) is stream]


def _terminal_handlers(term: TextIO) -> list:
    """Logging handlers of every logger but zoo's that write to the terminal stream ``term``."""
    loggers = [logging.getLogger()] + [logger for name, logger in logging.Logger.manager.loggerDict.items()
                                       if isinstance(logger, logging.Logger) and name != "zoo"
                                       and not name.startswith("zoo.")]
    return [h for logger in loggers for h in logger.handlers
            if type(h) is logging.StreamHandler and getattr(h, "stream", None) in (term, sys.__stderr__)]


class RunLog:
    """The log of one run: where it is written and how many dependency lines went only there."""

    def __init__(self, path: Path):
        self.path = path
        self.captured = 0


@contextlib.contextmanager
def run_log(path: Path, verbose: bool = False) -> Iterator[RunLog]:
    """Write the run's log to ``path`` while the block runs; dependency output goes there, not the terminal.

    zoo's own start/done lines and warnings still reach the terminal (and the log). ``verbose`` also echoes the
    dependency output to the terminal. A failure leaving the block gets its traceback written to the log.
    """
    record = RunLog(Path(path))
    record.path.parent.mkdir(parents=True, exist_ok=True)
    log_file = open(record.path, "a", encoding="utf-8", buffering=1)
    saved = (_Output.terminal, _Output.log, _Output.captured, sys.stderr, warnings.showwarning, sys.stdout)
    term = terminal()
    _Output.terminal, _Output.log, _Output.captured = term, log_file, 0
    stand_in = _DependencyOutput(log_file, term, echo=verbose)
    if _Output.pending is not None:  # what held_back kept from before the log existed
        for line in _Output.pending.getvalue().splitlines():
            stand_in.write(line + "\n")
        _Output.pending = None
    sys.stderr = stand_in
    sys.stdout = _ZooStdout(saved[5], stand_in)
    warnings.showwarning = _show_warning
    root = logging.getLogger()
    handler = logging.StreamHandler(log_file)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    root.addHandler(handler)
    # Libraries imported before the run (torch's own logging) hold handlers writing to the terminal: they write
    # into the log for the run too. zoo's own logger keeps its terminal.
    redirected = _terminal_handlers(term)
    for h in redirected:
        h.setStream(stand_in)
    try:
        yield record
    except BaseException as exc:
        with contextlib.suppress(OSError, ValueError):
            log_file.write("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        raise
    finally:
        record.captured = _Output.captured
        root.removeHandler(handler)
        for h in redirected:
            h.setStream(term)
        stand_in.detach_run()
        sys.stderr, warnings.showwarning, sys.stdout = saved[3], saved[4], saved[5]
        _Output.terminal, _Output.log, _Output.captured = saved[0], saved[1], saved[2]
        with contextlib.suppress(OSError, ValueError):
            log_file.close()
