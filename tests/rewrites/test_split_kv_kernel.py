"""zoo's split-KV attention kernels (zoo/kernels/split_kv_triton.py) without a GPU.

- In Triton's interpreter, on CPU tensors, against attention written out here in float64:
  ``softmax(q k^T * scale, masked keys at -inf) v``, a row that sees no key as zeros (torch's SDPA writes zeros
  there). float32 and float16 inputs: on this machine the interpreter's bf16 arithmetic is not exact, so bf16 is
  left to the GPU tests. The interpreter needs ``TRITON_INTERPRET=1`` before the kernels' module is imported, so
  every case runs in one process of its own (tests/fixtures/split_kv_interpreter.py), once for this module.
- Compiled for sm_90 (Hopper) by Triton itself, down to a cubin with the ptxas Triton ships: the kernel is valid
  Triton for the GPU it is meant for, and spills no registers at LingBot-VA's shapes.
- The launch shape's rule at LingBot-VA's real shapes, worked by hand.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional

import pytest
import torch

from zoo.kernels import split_kv_triton as kernels

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
BOUND = {torch.float32: 1e-5, torch.float16: 1e-3}  # relative L2 against float64; fp16: its output rounding


# --------------------------------------------------------------------------------------------- the cases


def reference(q, k, v, mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """Attention in float64; a row whose mask hides every key is zeros."""
    scores = q.double() @ k.double().transpose(-2, -1) * scale
    if mask is None:
        return torch.softmax(scores, dim=-1) @ v.double()
    mask = mask.expand(scores.shape)
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.where(mask.any(-1, keepdim=True), weights, 0.0) @ v.double()


def heads_last(generator, batch, length, heads, width, dtype) -> torch.Tensor:
    """[B, H, L, D] as attention code passes it: a transposed view of a [B, L, H, D] tensor (not contiguous)."""
    return torch.randn(batch, length, heads, width, generator=generator).to(dtype).transpose(1, 2)


def case(seed: int, *, batch=2, heads=2, q_len=16, kv_len=200, width=64, dtype=torch.float32, mask="pool",
         hidden=(), num_splits=None, scale=None) -> Dict:
    """One launch. ``mask``: "pool" (one [S] visibility for every row, batch and head, expanded as LingBot-VA's
    pool attention does, strides 0), "rows" (a full [B, H, Lq, S] mask, different per row and head) or None;
    ``hidden``: key ranges the pool mask hides whatever the draw."""
    g = torch.Generator().manual_seed(seed)
    q = heads_last(g, batch, q_len, heads, width, dtype)
    k, v = (heads_last(g, batch, kv_len, heads, width, dtype) for _ in range(2))
    if mask == "pool":
        visible = torch.rand(kv_len, generator=g) > 0.4
        for start, end in hidden:
            visible[start:end] = False
        mask = visible[None, None, None, :].expand(batch, 1, q_len, kv_len)
    elif mask == "rows":
        mask = torch.rand(batch, heads, q_len, kv_len, generator=g) > 0.5
    return {"query": q, "key": k, "value": v, "mask": mask, "num_splits": num_splits,
            "scale": scale if scale is not None else 1 / math.sqrt(width)}


def poisoned(clean: Dict) -> Dict:
    """``clean`` with NaN in every key and value slot its pool mask hides: a kernel that reads one, even to
    weigh it by 0, writes NaN."""
    hidden = ~clean["mask"][0, 0, 0]
    k, v = clean["key"].clone(), clean["value"].clone()  # clone keeps the transposed layout
    k[:, :, hidden], v[:, :, hidden] = float("nan"), float("nan")
    return {**clean, "key": k, "value": v}


def row_that_sees_nothing(c: Dict) -> Dict:
    mask = c["mask"].clone()
    mask[1, 0, 3] = False
    return {**c, "mask": mask}


CASES = {
    # S=200: three whole key blocks of 64 and a partial one; keys 0-69 hidden: block 0 whole, block 1 in part.
    "pool, 16 queries, 200 keys, rule's splits": case(1, width=128, hidden=[(0, 70)]),
    "pool, fp16": case(1, width=128, hidden=[(0, 70)], dtype=torch.float16),
    "pool, one split": case(1, width=128, hidden=[(0, 70)], num_splits=1),
    "one query, no mask, 3 splits, the last of 2 keys": case(2, batch=1, q_len=1, kv_len=130, mask=None,
                                                             num_splits=3),
    "128 queries, a mask per row and head, one split": row_that_sees_nothing(case(3, q_len=128, kv_len=70,
                                                                                  mask="rows")),
    # 3 splits of 128 keys: the middle one (128-255) hidden whole; 60-69 hidden inside block 0.
    "a split with every key hidden, fp16": case(4, batch=1, heads=1, q_len=5, kv_len=300, dtype=torch.float16,
                                                hidden=[(128, 256), (60, 70)], num_splits=3),
    "1000 keys, scale 0.05, fp16": case(5, batch=1, width=128, kv_len=1000, dtype=torch.float16, scale=0.05),
}
CASES["NaN in hidden slots"] = poisoned(CASES["pool, 16 queries, 200 keys, rule's splits"])
CASES["NaN in hidden slots, fp16"] = poisoned(CASES["pool, fp16"])
CLEAN = {"NaN in hidden slots": "pool, 16 queries, 200 keys, rule's splits", "NaN in hidden slots, fp16": "pool, fp16"}


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> Dict[str, torch.Tensor]:
    """Every case's output, from one process running the kernels in Triton's interpreter."""
    folder = tmp_path_factory.mktemp("split_kv")
    torch.save(CASES, folder / "cases.pt")
    done = subprocess.run([sys.executable, str(FIXTURES / "split_kv_interpreter.py"), str(folder / "cases.pt"),
                           str(folder / "outputs.pt")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(folder / "outputs.pt")


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


# --------------------------------------------------------------------------------------------- the interpreter


@pytest.mark.parametrize("name", [n for n in CASES if n not in CLEAN])
def test_the_kernels_compute_attention_in_the_interpreter(name, interpreted):
    c = CASES[name]
    got = interpreted[name]
    assert got.dtype == c["query"].dtype and got.stride() == c["query"].stride()  # written in q's layout
    want = reference(c["query"], c["key"], c["value"], c["mask"], c["scale"])
    assert rel_l2(got, want) < BOUND[got.dtype], name


def test_one_split_and_many_give_the_same_attention(interpreted):
    c = CASES["pool, 16 queries, 200 keys, rule's splits"]
    assert kernels.choose_num_splits(2 * 2, 16, 200, 128) == 2  # the rule's case has two splits
    assert rel_l2(interpreted["pool, one split"], interpreted["pool, 16 queries, 200 keys, rule's splits"].double()) \
        < BOUND[torch.float32]
    assert c["mask"].stride() == (0, 200, 0, 1)  # the pool mask: one row for every batch, head and query


def test_a_row_that_sees_no_key_is_zeros(interpreted):
    got = interpreted["128 queries, a mask per row and head, one split"]
    assert torch.isfinite(got).all() and got[1, 0, 3].abs().max() == 0
    assert got[1, 1, 3].abs().max() > 0  # the same row of the other head sees its keys


@pytest.mark.parametrize("name", list(CLEAN))
def test_hidden_pool_slots_are_never_read(name, interpreted):
    """Built to fail if the kernel's mask handling is wrong: hidden slots hold NaN (any read of one, even one
    weighted by 0, gives NaN), and the hidden keys change the answer (a kernel that ignores the mask is off)."""
    clean = CASES[CLEAN[name]]
    got = interpreted[name]
    want = reference(clean["query"], clean["key"], clean["value"], clean["mask"], clean["scale"])
    assert torch.isfinite(got).all(), "the kernel read a key or value slot its mask hides"
    assert rel_l2(got, want) < BOUND[got.dtype]
    # The poison does detect a read: attention math that weighs the hidden slots by 0 gives NaN.
    c = CASES[name]
    weights = torch.softmax((c["query"].double() @ c["key"].double().transpose(-2, -1)).masked_fill(
        ~c["mask"], float("-inf")), dim=-1)
    assert torch.isnan(weights.nan_to_num(0.0) @ c["value"].double()).any()
    # And the mask matters: the same attention over every key is far from it.
    unmasked = reference(clean["query"], clean["key"], clean["value"], None, clean["scale"])
    assert rel_l2(unmasked.to(got.dtype), want) > 100 * BOUND[got.dtype]


# --------------------------------------------------------------------------------------------- launch shape


@pytest.mark.parametrize("what, shape, splits, programs", [
    # action_step's self-attention: B*H = 2*24 = 48 heads, 16 queries (one block of 16), 2160 pool slots.
    # 396 programs wanted / 48 = 8.25 -> 9 splits; 2160 keys = 34 blocks of 64, 4 blocks (256 keys) a split.
    ("action_step, pool", (48, 16, 2160, 128), 9, 432),
    # video_step: 128 queries = 2 blocks of 64 -> 96 programs; 396 / 96 = 4.1 -> 5 splits of 7 blocks.
    ("video_step, pool", (48, 128, 2160, 128), 5, 480),
    # action_step's text cross-attention: 512 keys = 8 blocks, at least 2 a split -> 4 splits.
    ("action_step, text", (48, 16, 512, 128), 4, 192),
    # one head of the tiny recipe: 96 keys = 2 blocks -> one split.
    ("lingbot-va-tiny, pool", (2, 16, 96, 128), 1, 2),
])
def test_the_number_of_splits_at_lingbot_va_shapes(what, shape, splits, programs):
    batch_heads, q_len, kv_len, width = shape
    assert kernels.choose_num_splits(*shape) == splits, what
    per_split = kernels.keys_per_split(kv_len, splits)
    assert math.ceil(kv_len / per_split) == splits  # no split without keys
    block_m = kernels.query_block(q_len, width)
    assert batch_heads * math.ceil(q_len / block_m) * splits == programs
    if batch_heads == 48 and kv_len == 2160:
        assert 2 * kernels.SMS <= programs <= 4 * kernels.SMS  # two to four waves of 132 SMs


def test_the_op_knows_the_head_widths_the_kernel_takes_without_triton():
    from zoo.kernels import split_kv_attention

    assert split_kv_attention.HEAD_DIMS == kernels.HEAD_DIMS


def test_splits_are_capped():
    assert kernels.choose_num_splits(1, 1, 1_000_000, 128) == kernels.MAX_SPLITS
    assert kernels.choose_num_splits(1, 1, 64 * 5, 128) == 2  # 5 blocks: at most 2 splits of 2 blocks or more


# --------------------------------------------------------------------------------------------- compiled for sm_90

TRITON_BIN = Path(sys.modules["triton"].__file__).parent / "backends" / "nvidia" / "bin"


def _compile(kernel, signature: Dict[str, str], constants: Dict[str, object], num_warps: int):
    """``kernel`` compiled by Triton for sm_90 with the specialisation a launch gets: strides equal to 1 become
    constants, pointers and other strides are taken as multiples of 16 (as Triton assumes for aligned values)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    for name in names:
        signature.setdefault(name, "constexpr" if name in constants else "i32")
    aligned = [n for n in names if signature[n].startswith("*") or (n.startswith("stride") and n not in constants)]
    source = ASTSource(kernel, signature, {(names.index(n),): v for n, v in constants.items()},
                       attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": kernels.NUM_STAGES})


def _spilled_bytes(compiled, folder: Path) -> Optional[int]:
    """The stack a thread of the compiled kernel needs (registers spilled to local memory), read by cuobjdump."""
    cuobjdump = TRITON_BIN / "cuobjdump"
    if not cuobjdump.exists():
        return None
    cubin = folder / f"{compiled.name}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                           check=True).stdout
    return int(re.search(r"STACK:(\d+)", usage).group(1))


@pytest.mark.skipif(not (TRITON_BIN / "ptxas").exists(), reason="Triton's ptxas is not installed")
@pytest.mark.parametrize("q_len", [16, 128])
def test_the_kernels_compile_for_sm90_without_spilling_at_lingbot_va_shapes(q_len, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))  # not the user's cache
    width, block_m = 128, kernels.query_block(q_len, 128)
    unit_strides = {n: 1 for n in ("stride_qd", "stride_kd", "stride_vd", "stride_od", "stride_mn")}
    partial = _compile(kernels._split_kv_attention_partial,
                       {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Out": "*bf16", "Mask": "*i1", "PartAcc": "*fp32",
                        "PartMax": "*fp32", "PartSum": "*fp32", "qk_scale_log2": "fp32"},
                       {**unit_strides, "HAS_MASK": True, "ONE_SPLIT": False, "EXACT_DOT": False, "BLOCK_M": block_m,
                        "BLOCK_N": kernels.BLOCK_N, "HEAD_DIM": width},
                       kernels.num_warps(block_m, width))
    combine = _compile(kernels._split_kv_attention_combine,
                       {"PartAcc": "*fp32", "PartMax": "*fp32", "PartSum": "*fp32", "Out": "*bf16"},
                       {"stride_od": 1, "SPLITS": 16, "HEAD_DIM": width}, 4)
    for compiled in (partial, combine):
        assert compiled.asm["cubin"], "no cubin"
        assert _spilled_bytes(compiled, tmp_path) in (0, None)
