"""Comparing an output with its reference: max |diff|, relative L2, cosine, and the pass/fail judgement.

All metrics are computed in float64 on the CPU so the comparison itself adds no error.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Dict, Optional, Tuple

import torch


@dataclass
class Comparison:
    name: str
    shape: tuple
    dtype: str
    max_abs: float
    rel_l2: float
    cosine: float
    ok: bool = True
    why: str = ""  # set when not ok

    def as_dict(self) -> Dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d


def compare(name: str, got: torch.Tensor, ref: torch.Tensor) -> Comparison:
    """Metrics of ``got`` against ``ref``. A shape mismatch or a non-finite value is a failure by itself."""
    got_d = got.detach().to("cpu", torch.float64)
    ref_d = ref.detach().to("cpu", torch.float64)
    if tuple(got.shape) != tuple(ref.shape):
        return Comparison(name, tuple(got.shape), str(got.dtype), math.inf, math.inf, -1.0, False,
                          f"shape {tuple(got.shape)} != reference {tuple(ref.shape)}")
    bad = ~torch.isfinite(got_d)
    if bool(bad.any()) and not bool((~torch.isfinite(ref_d))[bad].all()):
        return Comparison(name, tuple(got.shape), str(got.dtype), math.nan, math.nan, math.nan, False,
                          f"{int(bad.sum())} non-finite values (NaN/Inf) where the reference is finite")
    diff = got_d - ref_d
    finite = torch.isfinite(diff)
    diff = torch.where(finite, diff, torch.zeros_like(diff))
    ref_f = torch.where(torch.isfinite(ref_d), ref_d, torch.zeros_like(ref_d))
    got_f = torch.where(torch.isfinite(got_d), got_d, torch.zeros_like(got_d))
    ref_norm = float(ref_f.norm())
    diff_norm = float(diff.norm())
    rel = diff_norm / ref_norm if ref_norm > 0 else (0.0 if diff_norm == 0 else math.inf)
    denom = float(got_f.norm()) * ref_norm
    cos = float((got_f * ref_f).sum()) / denom if denom > 0 else (1.0 if diff_norm == 0 else 0.0)
    max_abs = float(diff.abs().max()) if diff.numel() else 0.0
    return Comparison(name, tuple(got.shape), str(got.dtype), max_abs, rel, cos)


def judge(c: Comparison, rel_l2_max: float, min_cosine: Optional[float] = None) -> Comparison:
    """Mark ``c`` failed when its relative L2 exceeds the bound (or cosine is below ``min_cosine``)."""
    if not c.ok:
        return c
    if not c.rel_l2 <= rel_l2_max:  # also false for NaN
        c.ok, c.why = False, f"relative L2 {c.rel_l2:.3e} > tolerance {rel_l2_max:.1e}"
    elif min_cosine is not None and not c.cosine >= min_cosine:
        c.ok, c.why = False, f"cosine {c.cosine:.6f} < {min_cosine}"
    return c


def judge_low_precision(name: str, got: torch.Tensor, eager: torch.Tensor, ref32: torch.Tensor,
                        tolerance) -> Tuple[Comparison, float, Comparison]:
    """The bf16 rule, for the CPU check and the GPU verification alike: ``got`` and eager low precision are
    both measured against the float32 reference ``ref32``; ``got`` may be at most ``tolerance.bf16_factor``
    times as far from it as eager is (never held to less than the float32 tolerance, since eager bf16 can be
    exact), with cosine >= ``tolerance.bf16_min_cosine``. Returns (comparison, bound, eager's comparison)."""
    eager_c = compare(name, eager, ref32)
    c = compare(name, got, ref32)
    if not eager_c.ok or not math.isfinite(eager_c.rel_l2):
        c.ok, c.why = False, f"eager low precision is itself unusable against float32 ({eager_c.why or 'non-finite'})"
        return c, math.nan, eager_c
    bound = max(tolerance.bf16_factor * eager_c.rel_l2, tolerance.float32)
    judge(c, bound, tolerance.bf16_min_cosine)
    if not c.ok:
        c.why += f" (eager bf16 is {eager_c.rel_l2:.3e} from float32, factor {tolerance.bf16_factor})"
    return c, bound, eager_c
