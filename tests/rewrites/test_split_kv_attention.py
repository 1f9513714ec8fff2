"""replace_sdpa_with_split_kv_attention and the op it puts in, ``zoo::split_kv_attention``, on the CPU.

- The op off CUDA is torch's SDPA itself: the rewritten program equals the program as exported bit for bit (a toy
  with every kind of attention, and lingbot-va-tiny's DiT steps from the session's shared export).
- What is replaced, what is kept and why, what declines; the program re-exports, saves and loads.
- The way to the GPU, replayed without one: ExecuTorch's CUDA partitioner hands the op to AOTInductor as one node
  (tests/rewrites/inductor_probe.py), the kernel preflight takes it (its kernels are compiled into the .so), and
  on a CUDA device's fake tensors its body traces to the two Triton kernels, with only the output and the
  scratch written (a stub Triton driver names sm_90 as the target, which the trace asks for).
The kernel's numbers are tests/rewrites/test_split_kv_kernel.py's.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import export

from inductor_probe import inductor_input
from zoo.export.lower.preflight import check_kernels
from zoo.kernels import SPLIT_KV_ATTENTION
from zoo.rewrites import replace_sdpa_with_split_kv_attention as rewrite

SDPA = torch.ops.aten.scaled_dot_product_attention.default
SDPA_NAME = "aten.scaled_dot_product_attention.default"


def count(ep, target) -> int:
    return sum(1 for m in ep.graph_module.modules() if isinstance(m, torch.fx.GraphModule)
               for n in m.graph.nodes if n.op == "call_function" and n.target is target)


class EveryKind(nn.Module):
    """Attention as LingBot-VA's steps hold it, [B, L, H, D] tensors transposed into SDPA: over a pool under one
    visibility mask, over a prompt without one; and four SDPAs the kernel does not take."""

    def forward(self, q, k, v, visible, text, long_q, wide):
        batch, length = q.shape[0], q.shape[1]
        mask = visible[None, None, None, :].expand(batch, 1, length, visible.shape[0])
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        pool = F.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=mask)
        prompt = F.scaled_dot_product_attention(t(q), t(text), t(text), scale=0.1)
        causal = F.scaled_dot_product_attention(t(q), t(q), t(q), is_causal=True)  # kept: causal
        additive = F.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=mask.float())  # kept: float mask
        many = F.scaled_dot_product_attention(t(long_q), t(k), t(v))  # kept: 160 queries
        odd = F.scaled_dot_product_attention(t(wide), t(wide), t(wide))  # kept: a head of 80
        out = (pool + prompt + causal + additive).transpose(1, 2).reshape(batch, length, -1)
        return out, many.sum(), odd.sum()


def every_kind(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    visible = torch.rand(200, generator=g) > 0.4
    return (r(2, 16, 3, 64), r(2, 200, 3, 64), r(2, 200, 3, 64), visible, r(2, 24, 3, 64), r(2, 160, 3, 64),
            r(2, 8, 3, 80))


def exported(module, args):
    with torch.no_grad():
        return export(module.eval(), args)


def run(ep, args):
    with torch.no_grad():
        return ep.module()(*args)


# --------------------------------------------------------------------------------------------- what it replaces


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_and_prompt_attention_are_replaced_and_the_rest_kept_with_reasons(dtype):
    args = every_kind(dtype)
    ep = exported(EveryKind(), args)
    result = rewrite(ep)
    assert result.declined is None and result.changed
    assert result.counts == {SDPA_NAME: 2}
    assert count(result.program, SPLIT_KV_ATTENTION) == 2 and count(result.program, SDPA) == 4
    assert count(ep, SDPA) == 6  # the caller's program is untouched
    kept = "\n".join(result.notes)
    assert len(result.notes) == 4
    for why in ("causal", "its mask is float32, not boolean", "160 queries per head, more than 128",
                "80 channels wide"):
        assert why in kept, why


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rewritten_program_is_the_exported_one_bit_for_bit_on_the_cpu(dtype):
    args = every_kind(dtype)
    ep = exported(EveryKind(), args)
    for got, want in zip(run(rewrite(ep).program, args), run(ep, args)):
        assert got.dtype == dtype and torch.equal(got, want)


def test_the_op_is_torchs_sdpa_off_cuda_in_value_and_layout():
    q, k, v, visible, *_ = every_kind()
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    mask = visible[None, None, None, :].expand(2, 1, 16, 200)
    for m, scale in ((mask, None), (None, 0.3)):
        got = SPLIT_KV_ATTENTION(q, k, v, m, scale=scale)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale)
        assert torch.equal(got, want) and got.stride() == want.stride() == torch.empty_like(q).stride()


def test_dropout_declines_the_program_naming_the_reason():
    class Dropout(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1) * 1

    ep = exported(Dropout(), tuple(torch.randn(1, 2, 4, 64) for _ in range(3)))
    result = rewrite(ep)
    assert result.program is ep and "dropout" in result.declined and "p=0.1" in result.declined


def test_a_program_with_nothing_to_replace_is_handed_back_with_the_reasons():
    class Causal(nn.Module):
        def forward(self, q):
            return F.scaled_dot_product_attention(q, q, q, is_causal=True) * 1

    ep = exported(Causal(), (torch.randn(1, 2, 4, 64),))
    result = rewrite(ep)
    assert result.program is ep and not result.changed and result.declined is None
    assert "causal" in result.notes[0]


def test_the_rewritten_program_saves_loads_and_re_exports_with_the_op():
    args = every_kind()
    program = rewrite(exported(EveryKind(), args)).program
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer)
    assert count(loaded, SPLIT_KV_ATTENTION) == 2
    assert count(loaded.run_decompositions(), SPLIT_KV_ATTENTION) == 2  # re-traced, as ExecuTorch's backend does
    with torch.no_grad():
        assert count(export(loaded.module(), args), SPLIT_KV_ATTENTION) == 2
    for got, want in zip(run(loaded, args), run(program, args)):
        assert torch.equal(got, want)


# --------------------------------------------------------------------------------------------- lingbot-va-tiny


@pytest.fixture(scope="module")
def tiny_steps(tiny_runs):
    """lingbot-va-tiny's DiT steps as torch.export returned them, from the session's shared export."""
    from zoo.contract.run_folder import RunFolder

    run = tiny_runs("lingbot-va-tiny")
    run.check_exported()
    return {m: RunFolder(run.path).load_program("exported", m) for m in ("video_step", "action_step")}


@pytest.mark.parametrize("method", ["video_step", "action_step"])
def test_lingbot_va_tiny_steps_have_every_attention_replaced_and_compute_the_same(method, tiny_steps):
    ep = tiny_steps[method]
    result = rewrite(ep)
    # Two blocks, each a self-attention over the KV pool (masked) and a cross-attention over the prompt.
    assert result.counts == {SDPA_NAME: 4} and result.notes == []
    assert count(result.program, SDPA) == 0
    masks = [n.args[3] for n in result.program.graph.nodes if n.target is SPLIT_KV_ATTENTION]
    assert sum(m is not None for m in masks) == 2
    args, kwargs = ep.example_inputs  # the slots and pool visibility the export drew
    with torch.no_grad():
        got, want = result.program.module()(*args, **kwargs), ep.module()(*args, **kwargs)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


# --------------------------------------------------------------------------------------------- on the way to a GPU


class PoolAttention(nn.Module):
    def forward(self, q, k, v, visible):
        mask = visible[None, None, None, :].expand(q.shape[0], 1, q.shape[1], visible.shape[0])
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)


def pool_inputs(dtype):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, n, 4, 64, generator=g).to(dtype) for n in (16, 200, 200))
    return q, k, v, torch.rand(200, generator=g) > 0.4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_executorchs_cuda_partitioner_hands_the_op_to_aotinductor_as_one_node(dtype):
    program = rewrite(exported(PoolAttention(), pool_inputs(dtype))).program
    probe = inductor_input(program)  # after to_edge, the view-copy pass and the backend's re-trace
    assert count(probe, SPLIT_KV_ATTENTION) == 1 and count(probe, SDPA) == 0


@pytest.mark.parametrize("dtype, compiled_in", [(torch.bfloat16, True), (torch.float32, False)])
def test_the_kernel_preflight_takes_the_op(dtype, compiled_in):
    program = rewrite(exported(PoolAttention(), pool_inputs(dtype))).program
    result = check_kernels({"forward": program}, triton_kernel_mode="ON", capability=(9, 0))
    assert result.ok and result.needs == [], result.table()
    # bf16: its Triton kernels are compiled into the .so; float32: torch's SDPA inside it, decomposed as math.
    assert any("split-KV Triton kernels, compiled into the .so" in n for n in result.notes) == compiled_in


def test_torch_knows_the_ops_triton_kernels():
    """Read from the op's source by torch: Inductor's and AOTAutograd's caches key on these kernels' source, so an
    edit to a kernel is compiled again, never served from a cache."""
    from zoo.kernels import split_kv_triton

    kernels = torch._library.triton.get_triton_kernels_for_op("zoo::split_kv_attention")
    assert kernels == [split_kv_triton._split_kv_attention_partial, split_kv_triton._split_kv_attention_combine]


class _Sm90Driver:
    """What the Triton kernel wrapper's trace asks of the active driver: the target to generate TTIR for."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cuda", 0)


def _on_cuda(fake_mode, shape, stride, dtype):
    from torch._subclasses.fake_tensor import FakeTensor

    meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    return FakeTensor(fake_mode, meta, torch.device("cuda", 0))


def traced_on_cuda(dtype, monkeypatch):
    """The op's body as AOTInductor traces it (triton ops decomposed), on fake tensors of a CUDA device:
    LingBot-VA's action_step pool attention at 2 heads, [B, L, H, D] transposed."""
    import triton
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(triton.runtime.driver, "_active", _Sm90Driver())
    mode = FakeTensorMode()
    b, h, lq, s, d = 2, 2, 16, 2160, 128
    q = _on_cuda(mode, (b, h, lq, d), (lq * h * d, d, h * d, 1), dtype)
    k = _on_cuda(mode, (b, h, s, d), (s * h * d, d, h * d, 1), dtype)
    mask = _on_cuda(mode, (b, 1, lq, s), (0, s, 0, 1), torch.bool)

    class Op(nn.Module):
        def forward(self, q, k, v, mask):
            return SPLIT_KV_ATTENTION(q, k, v, mask)

    with mode:
        ep = export(Op(), (q, k, k, mask))
    return ep.run_decompositions({}, decompose_custom_triton_ops=True)


def test_on_a_cuda_device_the_op_traces_to_its_two_triton_kernels(monkeypatch):
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    traced = traced_on_cuda(torch.bfloat16, monkeypatch)
    wrapper = torch.ops.higher_order.triton_kernel_wrapper_functional
    calls = [n for n in traced.graph.nodes if n.target is wrapper]
    assert count(traced, SPLIT_KV_ATTENTION) == 0 and count(traced, SDPA) == 0
    names = [kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__ for n in calls]
    assert names == ["_split_kv_attention_partial", "_split_kv_attention_combine"]
    partial, combine = calls
    # 4 heads x 1 block of 16 queries x 34 key blocks; the rule's splits: ceil(396 / 4) = 99, capped at 17.
    assert partial.kwargs["grid"] == [(4, 1, 17)]
    assert combine.kwargs["grid"] == [(4, 16, 1)]
    # Only the scratch and the output are written (Triton's own analysis of the kernels): q, k, v and the mask
    # stay read-only, so nothing is cloned for them.
    assert sorted(partial.kwargs["tensors_to_clone"]) == ["PartAcc", "PartMax", "PartSum"]
    assert combine.kwargs["tensors_to_clone"] == ["Out"]


def test_on_a_cuda_device_float32_stays_torchs_sdpa(monkeypatch):
    traced = traced_on_cuda(torch.float32, monkeypatch)
    wrapper = torch.ops.higher_order.triton_kernel_wrapper_functional
    assert count(traced, wrapper) == 0 and count(traced, SDPA) == 1
