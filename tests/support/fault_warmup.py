"""Imported by the fault-injection fork server only (tests/support/faults.py preloads it there): before the
server forks any case, it builds one good toy run in a scratch folder of its own and removes it, so that what
every zoo process pays on its first export, kernel preflight, lowering and verification (torch.export's and
ExecuTorch's lazy set-up, about 10 s) is paid once, not again by each case's child. A child then costs only the
work of its own command.

What a child sees is unchanged: zoo keeps nothing in memory from one command to the next, and the scratch run
shares no file with the runs the cases damage and check. Torch runs single-threaded meanwhile: an OpenMP thread
pool started before a fork is not usable in the forked child. A warm-up that fails only costs time: it is said
on stderr, and each child sets itself up as before.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from support import faults


def warm_up() -> None:
    scratch = Path(tempfile.mkdtemp(prefix="fault-warmup-", dir=os.environ.get("ZOO_TEST_SANDBOX")))
    threads = torch.get_num_threads()
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    log = os.open(scratch / "warmup.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.dup2(log, 1)
        os.dup2(log, 2)
        torch.set_num_threads(1)
        faults.good_run(scratch)
    except BaseException as exc:  # noqa: BLE001 (the server must live on: it only costs the children time)
        error = f"{type(exc).__name__}: {exc}"
    else:
        error = None
    finally:
        torch.set_num_threads(threads)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, log):
            os.close(fd)
    if error:
        print(f"[fault_warmup] the warm-up run failed ({error}); each case sets itself up (log: "
              f"{scratch / 'warmup.log'})", file=sys.stderr)
    else:
        shutil.rmtree(scratch, ignore_errors=True)


warm_up()
