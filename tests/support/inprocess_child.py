"""Runs the in-process ExecuTorch session in a process of its own, as a test's child: the library makes its
shims global, which no pytest process that also runs torch's AOTI runner may hold (zoo.runtimes.shims).

    python inprocess_child.py CASE LIBRARY PTE PTD OUT
CASE: calls (three gather calls and six pool calls, outputs written to OUT as tensor files), aoti-first,
session-first (the two refusals), bad-input. A ZooError is printed and exits 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support import portable_program  # noqa: E402
from zoo.contract.tensor_file import write_tensor  # noqa: E402
from zoo.core.errors import ZooError  # noqa: E402
from zoo.runtimes import aoti, inprocess  # noqa: E402


def main(case: str, library: str, pte: str, ptd: str, out: str) -> None:
    out_dir = Path(out)
    if case == "aoti-first":
        aoti.promote_libtorch_global()
    with inprocess.InProcessSession(pte, ptd, library=library) as session:
        if case == "session-first":
            aoti.promote_libtorch_global()
        if case == "bad-input":
            x, idx, mask = portable_program.gather_inputs(0)
            session.call("gather", [x, idx.int(), mask])
        for seed in range(3):
            for k, t in enumerate(session.call("gather", portable_program.gather_inputs(seed))):
                write_tensor(out_dir / f"gather{seed}.{k}.zt", t)
        pool = torch.zeros(5, 4)
        for i, (method, values, slots) in enumerate(portable_program.pool_calls(6)):
            readout, pool = session.call(method, [values, slots, pool])
            write_tensor(out_dir / f"pool{i}.0.zt", readout)
            write_tensor(out_dir / f"pool{i}.1.zt", pool)
        print(f"calls {session.stats['calls']} load_ms {session.load_ms:.3f} last {session.last_call}")


if __name__ == "__main__":
    try:
        main(*sys.argv[1:])
    except ZooError as e:
        print(f"error: {e}")
        sys.exit(2)
