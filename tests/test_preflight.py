"""Kernel preflight on the CPU: what would need a fallback kernel on the ExecuTorch CUDA runtime, refused
before any compile. The expected kernels are the ones seen on an H200 (split_copy, detach_copy, the bf16-only
Triton SDPA) or named by torch 2.11's AOTInductor for the op (scatter_reduce_two_out for int64 scatter-add)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zoo.core.errors import LoweringError
from zoo.export.lower.preflight import check_kernels, edge_programs, require_kernels


class ScatterAddInt64(nn.Module):
    def forward(self, counts: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(4, dtype=torch.int64)
        out.scatter_add_(0, index, counts)
        return out


class Chunked(nn.Module):  # an adaLN-style modulation split, as in the DiT blocks
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shift, scale = x.chunk(2, dim=-1)
        return shift * (1 + scale)


class Clean(nn.Module):
    """Linear, a real-pair rope over a dynamic length, a pool written with index_copy_, attention."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("pool", torch.zeros(16, 8))
        angles = torch.arange(32.0)[:, None] * torch.tensor([1.0, 0.1, 0.01, 0.001])
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())

    def forward(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        y = self.proj(x)
        a, b = y[..., 0::2], y[..., 1::2]
        cos, sin = self.cos[:length], self.sin[:length]
        y = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
        self.pool.index_copy_(0, slots, y[0, :2])
        q = y.view(1, length, 2, 4).transpose(1, 2)
        o = torch.nn.functional.scaled_dot_product_attention(q, q, q)
        return o.transpose(1, 2).reshape(1, length, 8) + self.pool.sum()


class Float64Matmul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


class Detached(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 2).detach()


class AccumulateBf16(nn.Module):
    def forward(self, values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(4, dtype=torch.bfloat16)
        return out.index_put((index,), values, accumulate=True)


def export(module: nn.Module, *args, dynamic_shapes=None):
    with torch.no_grad():
        return torch.export.export(module, args, dynamic_shapes=dynamic_shapes)


@pytest.fixture(scope="module")
def clean_program():
    length = torch.export.Dim("length", min=2, max=32)
    return export(Clean(), torch.randn(1, 8, 8), torch.tensor([3, 7]), dynamic_shapes=({1: length}, None))


def test_int64_scatter_add_is_refused_with_the_kernel_named():
    program = export(ScatterAddInt64(), torch.tensor([1, 2, 3]), torch.tensor([0, 1, 0]))
    with pytest.raises(LoweringError) as info:
        require_kernels({"forward": program}, "1.2", triton_kernel_mode="OFF")
    assert "aoti_torch_cuda_scatter_reduce_two_out" in info.value.message
    assert "forward" in info.value.message
    # Newer runtimes do not have it either: AOTInductor writes this call directly, past ExecuTorch's check.
    result = check_kernels({"forward": program}, "1.5", triton_kernel_mode="OFF")
    assert [(n.path, n.kernel, n.refused) for n in result.needs] == [
        ("direct", "aoti_torch_cuda_scatter_reduce_two_out", True)]


def test_edge_program_with_split_copy_is_refused():
    # The edge program the CUDA partitioner is handed: chunk is kept as split, which becomes split_copy.
    edge = edge_programs({"forward": export(Chunked(), torch.randn(3, 8))}, "OFF")["forward"]
    assert "aten.split_copy.Tensor" in str(edge.graph)
    result = check_kernels({"forward": edge}, "1.2", triton_kernel_mode="OFF")
    assert not result.ok
    assert [n.kernel for n in result.refused] == ["aten::split_copy.Tensor"]
    assert result.refused[0].path == "proxy_executor"


def test_aten_program_with_chunk_is_refused_the_same_way():
    result = check_kernels({"forward": export(Chunked(), torch.randn(3, 8))}, "1.2", triton_kernel_mode="OFF")
    assert [n.kernel for n in result.refused] == ["aten::split_copy.Tensor"]


def test_clean_program_passes(clean_program):
    result = require_kernels({"forward": clean_program}, "1.2", triton_kernel_mode="OFF")
    assert result.ok and result.needs == []
    assert result.nodes > 10
    assert "no fallback kernel needed" in result.table()


def test_fp32_attention_with_triton_sdpa_is_refused_with_the_fix(clean_program):
    result = check_kernels({"forward": clean_program}, "1.2", triton_kernel_mode="ON")
    assert [n.path for n in result.refused] == ["triton_sdpa"]
    assert "bf16" in result.refused[0].why and "triton_kernel_mode=OFF" in result.refused[0].why


def test_detach_becomes_detach_copy_which_has_no_kernel():
    result = check_kernels({"forward": export(Detached(), torch.randn(3))}, "1.2", triton_kernel_mode="OFF")
    assert [n.kernel for n in result.refused] == ["aten::detach_copy"]


def test_float64_matmul_has_no_gemm_template():
    result = check_kernels({"forward": export(Float64Matmul(), torch.randn(3, 4, dtype=torch.float64))}, "1.2",
                           triton_kernel_mode="OFF")
    assert [(n.path, n.op) for n in result.refused] == [("no_gemm_template", "aten.mm.default")]


def test_bf16_accumulate_depends_on_the_gpu():
    program = export(AccumulateBf16(), torch.randn(3).bfloat16(), torch.tensor([0, 1, 0]))
    unknown = check_kernels({"forward": program}, "1.2", triton_kernel_mode="OFF", capability=None) \
        if not torch.cuda.is_available() else None
    if unknown is not None:  # without a GPU the outcome is the lowering GPU's: noted, not refused
        assert unknown.ok and unknown.notes and "sm_90" in unknown.notes[0]
    ampere = check_kernels({"forward": program}, "1.2", triton_kernel_mode="OFF", capability=(8, 0))
    assert [n.kernel for n in ampere.refused] == ["aoti_torch_index_put_out"]
    hopper = check_kernels({"forward": program}, "1.2", triton_kernel_mode="OFF", capability=(9, 0))
    assert hopper.ok and hopper.needs == []


def test_unknown_runtime_is_a_zoo_error(clean_program):
    with pytest.raises(LoweringError, match="unknown runtime release"):
        check_kernels({"forward": clean_program}, "0.9")


class CastWithDevice(torch.nn.Module):
    """Fast-WAM's rope builds positions as int64 and casts them with an explicit device: in the edge program
    that is ``_to_dim_order_copy(dtype=float64, device=cpu)``, which Inductor fuses into a kernel."""

    def forward(self, x):
        pos = torch.arange(x.shape[0]).to(dtype=torch.float64, device=x.device)
        return x * pos.to(torch.float32)[:, None]


def test_a_cast_with_a_device_argument_needs_no_fallback_kernel():
    from zoo.export.lower import preflight

    with torch.no_grad():
        ep = torch.export.export(CastWithDevice(), (torch.randn(5, 3),))
    result = preflight.check_kernels({"forward": ep}, "1.2", triton_kernel_mode="OFF")
    assert result.refused == []


class Attention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def bf16_attention(width: int, keys: int):
    g = torch.Generator().manual_seed(width + keys)
    q = torch.randn(2, 1, 64, width, generator=g).bfloat16()
    k, v = (torch.randn(2, 1, keys, width, generator=g).bfloat16() for _ in range(2))
    return export(Attention(), q, k, v)


@pytest.mark.parametrize("width, keys, fault", [(640, 64, "640/640 channels wide"),
                                                (128, 64, "64 keys, not a multiple of 256")])
def test_attention_the_triton_sdpa_computes_wrong_is_refused_naming_the_rewrite(width, keys, fault):
    from zoo.rewrites import replace_triton_unsafe_sdpa_with_math

    program = bf16_attention(width, keys)
    result = check_kernels({"forward": program}, "1.2", triton_kernel_mode="ON")
    assert [n.path for n in result.refused] == ["triton_sdpa"]
    why = result.refused[0].why
    assert fault in why and "with no error" in why and "replace_triton_unsafe_sdpa_with_math" in why
    rewritten = replace_triton_unsafe_sdpa_with_math(program).program
    assert check_kernels({"forward": rewritten}, "1.2", triton_kernel_mode="ON").refused == []


def test_bf16_attention_over_whole_key_blocks_keeps_the_triton_sdpa():
    result = check_kernels({"forward": bf16_attention(128, 512)}, "1.2", triton_kernel_mode="ON")
    assert result.ok and result.refused == []
