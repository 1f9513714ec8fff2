"""The chunk bench's runner candidates and their roofline: ``runner`` (zoo.runner on ``--backend``), ``executorch``
(zoo.runner on ExecuTorch's own runtime), ``graphs`` (zoo.runner on the artifact, each method a CUDA graph),
``pytorch`` (zoo.runner's host loop over the strongest PyTorch steps, ``zoo.bench.graphed``), each timed over whole
chunks and then once more call by call, every call's floor worked out (``zoo.bench.roofline``).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from zoo.bench.graphed import GraphedBackend
from zoo.bench.roofline import CallRecorder, ProgramCosts, Rates, chunk_floor
from zoo.contract.run_folder import RunFolder
from zoo.runner import load as load_runner
from zoo.runner.loading import RUNNERS

# Candidate -> what it is, for tables and cards.
RUNNER_LABELS = {"runner": "zoo.runner on --backend (artifact: torch's AOTI runner)",
                 "executorch": "zoo.runner on the artifact (ExecuTorch's runtime, zoo_runner)",
                 "graphs": "zoo.runner on the artifact, each method replayed as a CUDA graph (torch's AOTI runner)",
                 "pytorch": "the strongest PyTorch: whole steps torch.compile'd, CUDA graphs, state in place"}


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def make_runner(candidate: str, run: RunFolder, backend: str, device: str) -> Any:
    """The runner a candidate times: ``runner`` on ``backend``, ``executorch``, ``graphs`` or ``pytorch``."""
    if candidate == "runner":
        return load_runner(run, backend=backend, device=device)
    if candidate == "executorch":
        return load_runner(run, backend="executorch", device=device)
    if candidate == "graphs":
        return load_runner(run, backend="artifact", device=device, cuda_graphs=True)
    if candidate == "pytorch":
        settings = run.read_host_settings()
        return RUNNERS[settings.policy_type](run, GraphedBackend(run, device))
    raise ValueError(f"unknown runner candidate {candidate!r}")


def record_calls(runner: Any, observations: List[dict], starts: Sequence[int], seed: int, costs: ProgramCosts,
                 device: str) -> Dict[str, Any]:
    """One more episode, each call of the timed chunks (2..N) synchronised and timed on its own: per method and
    input shapes, calls per chunk, bytes moved, FLOPs and median latency (``CallCost``)."""
    state = type(runner).device_state(runner.settings)
    recorder = CallRecorder(runner.backend, costs.flops_of, costs.weights_of, state, lambda: sync(device))
    torch.manual_seed(seed)
    runner.reset()
    with recorder:
        for step, obs in enumerate(observations):
            recorder.recording = starts[1] <= step < starts[-1]
            runner.select_action({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in obs.items()})
    return {"costs": list(recorder.costs.values()), "chunks": len(starts) - 2}


def roofline(recorded: Dict[str, Any], rates: Rates) -> Dict[str, Any]:
    """The recorded calls as rows (``methods``) and one chunk's floor (``chunk``)."""
    costs = recorded["costs"]
    return {"methods": [c.as_dict(rates) for c in costs], "chunk": chunk_floor(costs, rates, recorded["chunks"])}


def floor_rows(results: Dict[str, Any]) -> List[List[str]]:
    """Per candidate and method: calls per chunk, what a call moves and computes, its floor, its median, the
    ratio."""
    rows = [["policy", "candidate", "method", "calls/chunk", "GB moved", "GFLOP", "bound", "floor ms", "median ms",
             "median/floor"]]
    for r in results["policies"]:
        for name, c in (r.get("candidates") or {}).items():
            chunks = ((c.get("roofline") or {}).get("chunk") or {})
            for m in (c.get("roofline") or {}).get("methods", []):
                per_chunk = m["calls"] / max(1, _chunks_of(c))
                rows.append([r["policy"], name, m["method"], f"{per_chunk:g}", f"{m['bytes_moved'] / 1e9:.3f}",
                             f"{m['flops'] / 1e9:.1f}", m["bound"], f"{m['floor_ms']:.3f}",
                             f"{m['median_ms']:.3f}" if m.get("median_ms") is not None else "-",
                             f"{m['ratio']:.2f}x" if m.get("ratio") else "-"])
            if chunks:
                rows.append([r["policy"], name, "(one chunk)", f"{sum(chunks['calls_per_chunk'].values()):g}",
                             f"{chunks['bytes_moved'] / 1e9:.2f}", f"{chunks['flops'] / 1e9:.1f}", "",
                             f"{chunks['floor_ms']:.1f}", _chunk_median(c), _chunk_ratio(c)])
    return rows


SPLIT_PARTS = (("execute", "execute"), ("runtime_io", "runtime I/O"), ("pipe", "pipe and files"),
               ("write", "write inputs"), ("read", "read outputs"))


def split_rows(results: Dict[str, Any]) -> List[List[str]]:
    """Per candidate whose backend says where a call's time goes (``executorch``) and method: its median beside
    the artifact runner's, and the median of each part (``zoo.runtimes.executorch.CallTiming``). Empty when no
    candidate has a split."""
    rows = [["policy", "candidate", "method", "runner ms", "median ms", "difference"]
            + [label for _, label in SPLIT_PARTS]]
    for r in results["policies"]:
        candidates = r.get("candidates") or {}
        runner = {m["method"]: m.get("median_ms") for m in ((candidates.get("runner") or {}).get("roofline") or {})
                  .get("methods", [])}
        for name, c in candidates.items():
            for m in (c.get("roofline") or {}).get("methods", []):
                split = m.get("split_ms")
                if not split:
                    continue
                base, ms = runner.get(m["method"]), m.get("median_ms")
                rows.append([r["policy"], name, m["method"], f"{base:.3f}" if base else "-",
                             f"{ms:.3f}" if ms is not None else "-",
                             f"{ms - base:+.3f}" if base and ms is not None else "-"]
                            + [f"{split[key]:.3f}" for key, _ in SPLIT_PARTS])
    return rows if len(rows) > 1 else []


def chunk_floor_of(candidate: Dict[str, Any]) -> Optional[float]:
    """A timed candidate's chunk floor (ms), or None when its roofline was not worked out."""
    return (((candidate or {}).get("roofline") or {}).get("chunk") or {}).get("floor_ms")


def _chunks_of(candidate: Dict[str, Any]) -> int:
    return int((candidate.get("roofline") or {}).get("chunks") or 1)


def _chunk_median(candidate: Dict[str, Any]) -> str:
    s = candidate.get("chunk_ms")
    return f"{s['median']:.1f}" if s else "-"


def _chunk_ratio(candidate: Dict[str, Any]) -> str:
    s, floor = candidate.get("chunk_ms"), chunk_floor_of(candidate)
    return f"{s['median'] / floor:.2f}x" if s and floor else "-"


def time_runner(candidate: str, runner: Any, observations: List[dict], starts: Sequence[int], args,
                costs: Optional[ProgramCosts], rates: Optional[Rates],
                time_episodes: Callable[..., Dict[str, Any]]) -> Dict[str, Any]:
    """A runner candidate timed over whole chunks, then (with ``costs``) once more call by call for its
    roofline; returns the timing record (``actions`` included, for the agreement with LeRobot eager)."""
    started = time.perf_counter()
    timed = time_episodes(runner, observations, list(starts), args.episodes, args.seed, args.device)
    timed["seconds"] = round(time.perf_counter() - started, 1)
    if costs is not None and rates is not None:
        try:
            recorded = record_calls(runner, observations, starts, args.seed, costs, args.device)
            timed["roofline"] = {**roofline(recorded, rates), "chunks": recorded["chunks"]}
        except Exception as exc:  # the floor is a column of its own: the chunk's timing stands without it
            timed["roofline"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    captures = getattr(runner.backend, "captures", None)
    if captures is not None:
        timed["cuda_graphs"] = captures
    return timed
