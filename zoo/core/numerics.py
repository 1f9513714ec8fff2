"""Comparing an output with its reference: max |diff|, relative L2, cosine, and the pass/fail judgement; and the
bytes a module's weights take (``held_bytes``), which the quantize stage and the roofline both count.

All metrics are computed in float64 so the comparison itself adds no error: piece by piece, on the device the
tensors are on (a GPU's float64 is exact IEEE arithmetic too), summing float64 partial sums. Why: verifying
LingBot-VA at real size compares KV pools of 398 M values three times each; as whole float64 copies on the CPU
that took 111.5 s of the H200 run's 135 s verification (and 40 s of its bench's agreement checks), and each
copy and temporary was 3.2 GB of host memory.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Dict, Optional, Tuple

import torch


def held_bytes(modules) -> int:
    """Bytes of every parameter and buffer the modules hold, each storage once (a tensor shared by two modules, or
    two views of one storage, counts once; meta tensors, which have no storage, once each)."""
    seen, total = set(), 0
    for module in modules:
        for t in list(module.parameters()) + list(module.buffers()):
            key = id(t) if t.device.type == "meta" else (t.untyped_storage().data_ptr(), str(t.device))
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
    return total


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


# Values per piece: 16 M float64 values are 128 MiB, and a piece holds a handful of them at once.
PIECE = 1 << 24


def compare(name: str, got: torch.Tensor, ref: torch.Tensor, *, piece: int = PIECE) -> Comparison:
    """Metrics of ``got`` against ``ref``. A shape mismatch or a non-finite value is a failure by itself.

    Non-finite values are left out of the norms, the dot product and max |diff|; a non-finite value in ``got``
    where ``ref`` is finite fails the comparison."""
    if tuple(got.shape) != tuple(ref.shape):
        return Comparison(name, tuple(got.shape), str(got.dtype), math.inf, math.inf, -1.0, False,
                          f"shape {tuple(got.shape)} != reference {tuple(ref.shape)}")
    got_flat, ref_flat = got.detach().reshape(-1), ref.detach().reshape(-1)
    device = got_flat.device if got_flat.device.type != "cpu" else ref_flat.device
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # |diff|^2, |ref|^2, |got|^2, got.ref
    max_abs = torch.zeros((), dtype=torch.float64, device=device)
    counts = torch.zeros(2, dtype=torch.int64, device=device)  # non-finite in got; of those, where ref is finite
    for start in range(0, got_flat.numel(), piece):
        g = got_flat[start:start + piece].to(device, torch.float64)
        r = ref_flat[start:start + piece].to(device, torch.float64)
        g_finite, r_finite = torch.isfinite(g), torch.isfinite(r)
        counts[0] += (~g_finite).sum()
        counts[1] += (~g_finite & r_finite).sum()
        diff = g - r
        diff = torch.where(torch.isfinite(diff), diff, 0.0)
        g = torch.where(g_finite, g, 0.0)
        r = torch.where(r_finite, r, 0.0)
        sums += torch.stack([diff.square().sum(), r.square().sum(), g.square().sum(), (g * r).sum()])
        if diff.numel():
            max_abs = torch.maximum(max_abs, diff.abs().max())
    nonfinite, unmatched = (int(v) for v in counts.tolist())
    if unmatched:
        return Comparison(name, tuple(got.shape), str(got.dtype), math.nan, math.nan, math.nan, False,
                          f"{nonfinite} non-finite values (NaN/Inf) where the reference is finite")
    diff_sq, ref_sq, got_sq, dot = sums.tolist()
    ref_norm, diff_norm = math.sqrt(ref_sq), math.sqrt(diff_sq)
    rel = diff_norm / ref_norm if ref_norm > 0 else (0.0 if diff_norm == 0 else math.inf)
    denom = math.sqrt(got_sq) * ref_norm
    cos = dot / denom if denom > 0 else (1.0 if diff_norm == 0 else 0.0)
    return Comparison(name, tuple(got.shape), str(got.dtype), float(max_abs), rel, cos)


def judge(c: Comparison, rel_l2_max: float, min_cosine: Optional[float] = None) -> Comparison:
    """Mark ``c`` failed when its relative L2 exceeds the bound (or cosine is below ``min_cosine``)."""
    if not c.ok:
        return c
    if not c.rel_l2 <= rel_l2_max:  # also false for NaN
        c.ok, c.why = False, f"relative L2 {c.rel_l2:.3e} > tolerance {rel_l2_max:.1e}"
    elif min_cosine is not None and not c.cosine >= min_cosine:
        c.ok, c.why = False, f"cosine {c.cosine:.6f} < {min_cosine}"
    return c


def low_precision_bound(eager_rel_l2: float, tolerance) -> float:
    """The bf16 rule's bound on a relative L2: ``tolerance.bf16_factor`` times eager low precision's own, never
    tighter than the float32 tolerance (eager bf16 can be exact)."""
    return max(tolerance.bf16_factor * eager_rel_l2, tolerance.float32)


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
    bound = low_precision_bound(eager_c.rel_l2, tolerance)
    judge(c, bound, tolerance.bf16_min_cosine)
    if not c.ok:
        c.why += f" (eager bf16 is {eager_c.rel_l2:.3e} from float32, factor {tolerance.bf16_factor})"
    return c, bound, eager_c
