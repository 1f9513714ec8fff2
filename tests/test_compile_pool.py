"""zoo.compile_pool: Inductor's compile pool started before a CUDA lowering, its size per worker, and what is
recorded when it cannot be used. The readiness is Inductor's own answer (``AsyncCompile.use_process_pool``), in
a fresh process so that no pool outlives the test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from zoo.compile_pool import threads_per_worker

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("cores, workers, share", [(16, 2, 8), (16, 4, 4), (16, 1, 16), (2, 4, 1), (16, 0, 16)])
def test_each_worker_gets_an_equal_share_of_the_cores(cores, workers, share):
    assert threads_per_worker(cores, workers) == share


def _start_in_fresh_process(threads: int) -> dict:
    code = ("import json, os\n"
            "from zoo.compile_pool import start_compile_pool\n"
            "from torch._inductor.async_compile import AsyncCompile\n"
            "facts = start_compile_pool(timeout_s=120)\n"
            "facts['inductor_says_ready'] = AsyncCompile.use_process_pool()\n"
            "print(json.dumps(facts))\n")
    env = {"PYTHONPATH": str(ROOT), "TORCHINDUCTOR_COMPILE_THREADS": str(threads), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_pool_is_ready_before_the_first_compile_asks():
    # Without the warm-up Inductor answers False to the first kernels that ask (they then compile in-process).
    facts = _start_in_fresh_process(2)
    assert facts["processes"] == 2 and facts["ready"] is True and facts["inductor_says_ready"] is True
    assert facts["seconds"] >= 0


def test_one_compile_thread_means_no_pool_and_says_why():
    facts = _start_in_fresh_process(1)
    assert facts["processes"] == 1 and facts["ready"] is False and facts["inductor_says_ready"] is False
    assert "compiles in this process" in facts["why"]
