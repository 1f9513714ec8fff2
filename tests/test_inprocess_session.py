"""ExecuTorch's runtime loaded into the caller's process (zoo.runtimes.inprocess, libzoo_session.so), on the CPU,
over the portable three-method program that test_runtime_cpp.py runs through zoo_runner.

Runs where the library is built (scripts/build_runtime.sh puts it beside zoo_runner; $ZOO_ET_SESSION or
$ZOO_ET_RUNNER names it); skipped otherwise. Each case runs in a child process (support/inprocess_child.py): the
library makes its aoti_torch_* shims global, which a pytest process that also runs torch's AOTI runner must not
hold. The reference is the eager module. Checked: outputs of single calls and of a pool fed from call to call,
the refusal of a process whose libtorch serves the shims already (and the other way round), and a wrong input
dtype named before the runtime sees it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support import portable_program
from zoo.contract.tensor_file import read_tensor
from zoo.core.errors import RuntimeNotBuilt
from zoo.runtimes import inprocess


def _library():
    try:
        return inprocess.find_library()
    except RuntimeNotBuilt:
        return None


LIBRARY = _library()
pytestmark = pytest.mark.skipif(LIBRARY is None, reason=f"no built {inprocess.LIBRARY_NAME} "
                                                        "(scripts/build_runtime.sh; $ZOO_ET_SESSION)")
CHILD = Path(__file__).parent / "support" / "inprocess_child.py"
MODULES = portable_program.modules()


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    return portable_program.build(tmp_path_factory.mktemp("program"), MODULES)


def child(case: str, program, out: Path) -> subprocess.CompletedProcess:
    pte, ptd = program
    return subprocess.run([sys.executable, str(CHILD), case, str(LIBRARY), str(pte), str(ptd), str(out)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": os.getcwd()})


def test_calls_match_eager(program, tmp_path):
    proc = child("calls", program, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "calls 9" in proc.stdout
    for seed in range(3):
        want = MODULES["gather"](*portable_program.gather_inputs(seed))
        got = [read_tensor(tmp_path / f"gather{seed}.{k}.zt") for k in range(2)]
        assert portable_program.close(got[0], want[0]) and torch.equal(got[1], want[1])
    pool = torch.zeros(5, 4)
    for i, (method, values, slots) in enumerate(portable_program.pool_calls(6)):
        readout, pool = MODULES[method](values, slots, pool)
        assert portable_program.close(read_tensor(tmp_path / f"pool{i}.0.zt"), readout)
        assert torch.equal(read_tensor(tmp_path / f"pool{i}.1.zt"), pool)


@pytest.mark.parametrize("case", ["aoti-first", "session-first"])
def test_one_process_never_holds_both_runtimes_shims(program, tmp_path, case):
    proc = child(case, program, tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "already serves the aoti_torch_* names from" in proc.stdout
    assert ("libtorch" if case == "aoti-first" else "ExecuTorch's CUDA shims") in proc.stdout.split("from", 1)[1]
    assert not list(tmp_path.glob("*.zt")), "nothing should have run"


def test_a_wrong_input_dtype_is_named(program, tmp_path):
    proc = child("bad-input", program, tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "method gather: input 1 is int32, the method takes int64" in proc.stdout
