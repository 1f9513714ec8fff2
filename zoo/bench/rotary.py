"""The rotary embedding alone: the real-pair computation zoo's rewrite produces, compiled by Inductor as the
artifact's kernels are, against eager complex math, and its achieved memory bandwidth as a fraction of what
the device reaches copying memory. How it is measured: docs/benchmarks.md, "What is measured" (Rotary alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
from torch import nn

from zoo.core.errors import RewriteDeclined, ZooError
from zoo.core.numerics import compare
from zoo.rewrites.complex_to_real import replace_complex_with_real
from zoo.bench.candidates import auto_input_sets, indexed_device, top_kernels
from zoo.bench.measuring import copy_bandwidth, measure_device_time
from zoo.bench.rendering import TARGETS, judge_at_least

PAIR_TABLE_DTYPE = torch.float32  # the rewrite turns the complex64 table into float32 pairs


@dataclass(frozen=True)
class RotaryCase:
    name: str
    shape: Tuple[int, int, int, int]  # [B, L, H, D]: batch, sequence, heads, head dim (pairs interleaved)
    dtype: str = "bfloat16"


# SmolLM2-135M's q at its longest sequence (a small, launch-bound call), and a tensor far beyond any L2
# cache with LingBot-VA's / Fast-WAM's head geometry (24 x 128), where bandwidth decides.
DEFAULT_CASES = (
    RotaryCase("smollm2-135m q, seq 2048", (1, 2048, 9, 64)),
    RotaryCase("24x128 heads, 16k tokens", (2, 8192, 24, 128)),
)


def angle_table(length: int, head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """float64 [length, head_dim/2]: position t times frequency theta^(-2j/head_dim) (Meta's table)."""
    j = torch.arange(head_dim // 2, dtype=torch.float64)
    freqs = theta ** (-2.0 * j / head_dim)
    return torch.outer(torch.arange(length, dtype=torch.float64), freqs)


class ComplexRope(nn.Module):
    """Meta's rotary embedding: ``x`` [B, L, H, D] as complex pairs times a complex64 table, in float32."""

    def __init__(self, angles: torch.Tensor):
        super().__init__()
        a = angles.to(torch.float32)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(a), a), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        freqs = self.freqs_cis[:length].view(1, length, 1, xc.shape[-1])
        return torch.view_as_real(xc * freqs).flatten(3).type_as(x)


def rewritten_rope(module: nn.Module, example: torch.Tensor):
    """The rotary module exported and rewritten to real pairs, exactly as the pipeline rewrites a policy."""
    with torch.no_grad():
        ep = torch.export.export(module, (example,), strict=False)
    result = replace_complex_with_real(ep)
    if result.declined or not result.changed:
        raise RewriteDeclined(f"the rotary microbenchmark's module was not rewritten: {result.declined}",
                              "replace_complex_with_real must handle Meta's rotary formulation; see its tests")
    return result.program


def rope_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes one call must move at least: x read, result written (x's dtype), table rows read (float32 pairs)."""
    b, length, h, d = shape
    element = torch.empty((), dtype=dtype).element_size()
    table = length * (d // 2) * 2 * torch.empty((), dtype=PAIR_TABLE_DTYPE).element_size()
    return 2 * b * length * h * d * element + table


def bench_case(case: RotaryCase, device: str, runs: int, warmup: int, copy_gbps: Optional[float],
               compile: bool = True, input_sets: Optional[int] = None) -> Dict[str, Any]:
    """Eager complex rotary vs the rewritten real-pair program (compiled unless ``compile`` is False)."""
    from torch.export.passes import move_to_device_pass

    dtype = getattr(torch, case.dtype)
    b, length, h, d = case.shape
    module = ComplexRope(angle_table(length, d))
    example = torch.randn(case.shape).to(dtype)
    program = rewritten_rope(module, example)
    device = indexed_device(device)
    if torch.device(device).type != "cpu":
        program = move_to_device_pass(program, device)
    pairs = program.module()
    if compile:
        torch._dynamo.reset()
        pairs = torch.compile(pairs, dynamic=False)
    eager = module.to(device)
    x_bytes = b * length * h * d * torch.empty((), dtype=dtype).element_size()
    count = input_sets or auto_input_sets(x_bytes, device)
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(case.shape, generator=g).to(dtype).to(device) for _ in range(count)]
    with torch.no_grad():
        agree = compare("rope", pairs(inputs[0]), eager(inputs[0]))  # also compiles, outside the timing
        # Device time, like the copy it is compared with: the kernels, not the Python that launches them.
        eager_stats, timing = measure_device_time(eager, inputs, warmup, runs, device)
        pairs_stats, _ = measure_device_time(pairs, inputs, warmup, runs, device)
        # What the real-pair call launches: one fused kernel is the goal; several mean extra passes over x.
        kernels = top_kernels(lambda args: [pairs(args[0])], [[x] for x in inputs]) if device != "cpu" else []
    moved = rope_bytes(case.shape, dtype)
    gbps = moved / (pairs_stats.median * 1e-3) / 1e9
    fraction = gbps / copy_gbps if copy_gbps else None
    return {
        "case": case.name, "shape": list(case.shape), "dtype": case.dtype, "input_sets": count, "timing": timing,
        "eager": {"what": "complex64 math, eager", "stats": eager_stats.as_dict()},
        "pairs": {"what": "rewritten real pairs, " + ("torch.compile (Inductor)" if compile else "not compiled"),
                  "stats": pairs_stats.as_dict()},
        "pairs_kernels": kernels,
        "speedup": eager_stats.median / pairs_stats.median,
        "bytes_per_call": moved, "pairs_gbps": gbps, "copy_fraction": fraction,
        "target": judge_at_least(fraction, TARGETS.rotary_copy_fraction),
        "agreement": {"rel_l2": agree.rel_l2, "cosine": agree.cosine, "max_abs": agree.max_abs},
    }


def run_rotary(device: str, runs: int = 50, warmup: int = 10, cases: Sequence[RotaryCase] = DEFAULT_CASES,
               compile: bool = True, copy_bytes: int = 1 << 30) -> Dict[str, Any]:
    """Copy bandwidth, then every case: the ``copy_bandwidth`` and ``rotary`` sections of a bench result."""
    copy = copy_bandwidth(device, copy_bytes, runs=max(5, runs // 2), warmup=min(warmup, 3))
    return {"copy_bandwidth": copy,
            "rotary": [bench_case(c, device, runs, warmup, copy["gbps"], compile) for c in cases]}


def parse_case(text: str, dtype: str = "bfloat16") -> RotaryCase:
    """``"2,8192,24,128"`` -> a case of that [B, L, H, D] shape."""
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1 or shape[3] % 2:
        raise ZooError(f"bad rotary shape {text!r}", "write B,L,H,D with positive sizes and an even D, "
                       "e.g. 2,8192,24,128")
    return RotaryCase("x".join(map(str, shape)), shape, dtype)  # type: ignore[arg-type]

