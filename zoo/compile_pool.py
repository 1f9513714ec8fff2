"""Inductor's pool of compile processes, started and waited for before a CUDA lowering compiles anything.

Why: ``torch.compile`` starts that pool as it begins (torch/_dynamo/backends/inductor.py calls
``async_compile.maybe_warm_pool``); the AOT compile that ExecuTorch's CUDA backend calls does not. The pool is then
created by the first Triton kernel that asks for it, and ``AsyncCompile.use_process_pool()`` answers False until
the pool has answered a first job. Every Triton compile that asks before then (a GEMM's autotuning choices, the
graph's kernels) is compiled in the lowering's own process instead, one at a time under the GIL. On the H200 the
real-size Fast-WAM lowering showed exactly that: Triton's ``make_llir``/``make_ptx`` in the worker's main thread
(221 s of 687 s) and the worker's CPU time growing at one core's rate (554 s of CPU in 656 s of wall).

How many processes: ``TORCHINDUCTOR_COMPILE_THREADS`` when set (``zoo.lowering_workers`` sets it to the worker's
share of the cores), else Inductor's own choice (one per core, at most 32).

A pool that does not start within the timeout is not an error: the lowering then compiles in its own process, as
it would have anyway, and the record says so.
"""

from __future__ import annotations

import time
from typing import Any, Dict

from .errors import first_line

ENV_THREADS = "TORCHINDUCTOR_COMPILE_THREADS"


def threads_per_worker(cores: int, workers: int) -> int:
    """Each of ``workers`` lowering processes gets an equal share of ``cores`` for its compile pool (at least 1):
    two workers with 16-process pools on 16 cores would only fight over them."""
    return max(1, cores // max(1, workers))


def start_compile_pool(timeout_s: float = 120.0) -> Dict[str, Any]:
    """Start Inductor's compile pool and wait until it answers. Returns what happened, for the lowering record:
    ``processes``, ``ready`` and ``seconds`` (or ``why`` it is not used)."""
    from torch._inductor.async_compile import AsyncCompile, get_compile_threads

    processes = get_compile_threads()
    if processes <= 1:
        return {"processes": 1, "ready": False,
                "why": f"compile_threads is 1 ({ENV_THREADS} or one core): Triton compiles in this process"}
    start = time.perf_counter()
    try:
        AsyncCompile.warm_pool()
        AsyncCompile.wakeup()
        AsyncCompile.wait_pool_ready(timeout=timeout_s)
    except Exception as exc:  # the pool is an accelerator; without it the compile still runs, in this process
        return {"processes": processes, "ready": False, "seconds": round(time.perf_counter() - start, 3),
                "why": f"the pool did not start ({type(exc).__name__}: {first_line(exc)}): Triton compiles in "
                       f"this process"}
    return {"processes": processes, "ready": bool(AsyncCompile.use_process_pool()),
            "seconds": round(time.perf_counter() - start, 3)}
