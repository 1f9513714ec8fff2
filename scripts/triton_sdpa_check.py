#!/usr/bin/env python3
"""Does ExecuTorch's CUDA backend compute the attention that zoo writes out right, as exported and after the rewrite?
(issue 13)

    python scripts/triton_sdpa_check.py --out OUT        # on a CUDA machine; about 2 minutes on an H200

Wan2.2's VAE encoder runs one attention in its middle block: a single head of 640 channels over the tokens of a
frame (64 for LingBot-VA's 128x128 cameras, 2 cameras), with no mask. The real-size LingBot-VA run's
``vae_encode_first`` failed verification downstream of it. That attention alone, bf16, ``triton_kernel_mode=ON`` (the
default, executorch's Triton SDPA), is lowered and run through torch's AOTI runner four ways:

  as exported        head 640, the SDPA handed to the backend as it is (the kernel preflight is off here, since
                     zoo's preflight now refuses this program)
  rewritten          head 640 after ``replace_triton_unsafe_sdpa_with_math``
  narrow             5 heads of 128 over the same 64 keys, as exported: the kernel's power-of-two path
  narrow rewritten   the same after the rewrite

Each is judged against the attention in float32 on the GPU under zoo's bf16 rule (at most 1.25x eager bf16's
distance, cosine >= 0.999). The channels past 256 are measured apart, since the kernel's head block stops there.
The table ends the run; OUT/triton_sdpa_check.json holds every number. Exit 0 when the two as-exported cases fail
and the two rewritten ones pass.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from zoo.core import numerics
from zoo.export import verify  # noqa: E402
from zoo.core.report import format_table  # noqa: E402

CASES = (("as exported", 640, 1, False), ("rewritten", 640, 1, True), ("narrow", 128, 5, False),
         ("narrow rewritten", 128, 5, True))
TOKENS, BATCH = 64, 2


class Attention(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


def _recipe():
    from zoo.contract.recipes import Lowering, Recipe, Source, Unit

    return Recipe(name="triton-sdpa-check", family="llama", source=Source(repo_id="none/none"),
                  unit=Unit(methods=["forward"]), lowering=Lowering(triton_kernel_mode="ON", max_mm_configs=1))


def one_case(label: str, width: int, heads: int, rewrite: bool, out: Path) -> dict:
    from zoo.runtimes.aoti import AotiRunner
    from zoo.export.lower.lowering import lower_to_pte
    from zoo.contract.recipes import Tolerance
    from zoo.rewrites import replace_triton_unsafe_sdpa_with_math

    g = torch.Generator().manual_seed(width)
    q, k, v = (torch.randn(BATCH, heads, TOKENS, width, generator=g).to(torch.bfloat16) for _ in range(3))
    with torch.no_grad():
        ep = torch.export.export(Attention().eval(), (q, k, v), strict=False)
    counts = {}
    if rewrite:
        result = replace_triton_unsafe_sdpa_with_math(ep)
        assert result.declined is None and result.changed, result.declined
        ep, counts = result.program, result.counts
    folder = out / label.replace(" ", "_")
    start = time.perf_counter()
    lowered = lower_to_pte({"forward": ep}, folder, _recipe(), run_preflight=False, workers=1)
    seconds = time.perf_counter() - start
    art = lowered.methods["forward"]  # lower_to_pte extracted its .so and weights from the written files
    inputs = [t.cuda() for t in (q, k, v)]
    (got,) = verify.run_in_delegate_order(AotiRunner(*art.files(folder), "cuda"), art.delegate_order, inputs)
    with torch.no_grad():
        eager = Attention()(*inputs)
        ref32 = Attention()(*(t.float() for t in inputs))
    c, bound, eager_c = numerics.judge_low_precision("out", got, eager, ref32, Tolerance())
    cut = min(width, 256)
    inside = numerics.compare("first 256", got[..., :cut], ref32[..., :cut])
    past = numerics.compare("past 256", got[..., cut:], ref32[..., cut:]) if width > cut else None
    return {"case": label, "head": width, "heads": heads, "rewritten": counts, "lower_s": round(seconds, 1),
            "rel_l2": c.rel_l2, "cosine": c.cosine, "eager_bf16_rel_l2": eager_c.rel_l2, "bound": bound,
            "ok": c.ok, "why": c.why, "first_256_rel_l2": inside.rel_l2,
            "past_256_rel_l2": past.rel_l2 if past else None,
            "nonfinite": int((~torch.isfinite(got)).sum())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("triton_sdpa_check: needs a CUDA device", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for label, width, heads, rewrite in CASES:
        rows.append(one_case(label, width, heads, rewrite, args.out / "runs"))
        (args.out / "triton_sdpa_check.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "tokens": TOKENS, "batch": BATCH, "cases": rows}, indent=2))

    def e(x):
        return "-" if x is None else f"{x:.3e}"

    print(format_table([["case", "head", "lower s", "rel L2", "cosine", "eager bf16", "bound", "ch <256 rel L2",
                        "ch >=256 rel L2", "non-finite", "result"]]
                       + [[r["case"], f"{r['heads']}x{r['head']}", r["lower_s"], e(r["rel_l2"]), f"{r['cosine']:.6f}",
                         e(r["eager_bf16_rel_l2"]), e(r["bound"]), e(r["first_256_rel_l2"]), e(r["past_256_rel_l2"]),
                         r["nonfinite"], "ok" if r["ok"] else "FAIL"] for r in rows]))
    return 0 if [r["ok"] for r in rows] == [False, True, False, True] else 1


if __name__ == "__main__":
    sys.exit(main())
