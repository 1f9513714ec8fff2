"""The tensor file format the C++ runner reads and writes (zoo/contract/tensor_file.py, runtime/cpp/tensor_file.cpp).

Round trips compare with the tensor written (torch.equal, bitwise: NaN payloads and -0.0 included); the header
is checked against bytes packed here by hand from the documented layout, so a reader and writer that agree
with each other but not with the format still fail. Truncated, padded and foreign files are refused with a
TensorFileError that says what is wrong.
"""

from __future__ import annotations

import struct

import pytest
import torch

from zoo.core.errors import TensorFileError, ZooError
from zoo.contract.tensor_file import read_tensor, write_tensor

# Every dtype the artifacts use (inputs, outputs, KV pools, slots, masks) and the rest the format carries.
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
SHAPES = [(), (0,), (3, 0, 2), (1,), (5,), (2, 3), (2, 1, 4, 3)]


def sample(dtype: torch.dtype, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash((str(dtype), shape)) % 2**31)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip(tmp_path, dtype, shape):
    t = sample(dtype, shape)
    back = read_tensor(write_tensor(tmp_path / "t.zt", t))
    assert back.dtype == dtype and tuple(back.shape) == tuple(shape)
    assert torch.equal(back, t)
    # bitwise: equal bytes, not just equal values
    assert torch.equal(back.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


def test_special_values_survive_bitwise(tmp_path):
    t = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40], dtype=torch.float32)
    back = read_tensor(write_tensor(tmp_path / "t.zt", t))
    assert torch.equal(back.view(torch.int32), t.view(torch.int32))


def test_extreme_integers(tmp_path):
    t = torch.tensor([torch.iinfo(torch.int64).min, -1, 0, torch.iinfo(torch.int64).max], dtype=torch.int64)
    assert torch.equal(read_tensor(write_tensor(tmp_path / "t.zt", t)), t)


def test_non_contiguous_and_offset_views_are_written_in_logical_order(tmp_path):
    base = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)
    for view in (base.transpose(0, 2), base[1:, ::2, 1:4], base.expand(2, 3, 4, 5)[1]):
        back = read_tensor(write_tensor(tmp_path / "v.zt", view))
        assert torch.equal(back, view) and back.is_contiguous()


def test_header_matches_the_documented_layout(tmp_path):
    t = torch.tensor([[1.5, -2.0, 3.25]], dtype=torch.float32)
    raw = write_tensor(tmp_path / "t.zt", t).read_bytes()
    # magic, version 1, dtype 6 (float32), rank 2, reserved 0, sizes 1 and 3, then three little-endian floats
    want = b"ZOOTENS\x00" + struct.pack("<IIII", 1, 6, 2, 0) + struct.pack("<qq", 1, 3) + struct.pack("<3f", 1.5, -2.0, 3.25)
    assert raw == want


def test_dtype_codes_are_executorch_scalar_types(tmp_path):
    # ExecuTorch's ScalarType numbers (runtime/core/portable_type/scalar_type.h), written out by hand.
    expected = {torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.int64: 4, torch.float16: 5,
                torch.float32: 6, torch.float64: 7, torch.bool: 11, torch.bfloat16: 15}
    for dtype, code in expected.items():
        raw = write_tensor(tmp_path / "t.zt", torch.zeros(1, dtype=dtype)).read_bytes()
        assert struct.unpack_from("<I", raw, 12)[0] == code, dtype


def test_bfloat16_bytes_are_the_upper_half_of_float32(tmp_path):
    # 1.0 in bfloat16 is 0x3F80: the file holds 80 3F.
    raw = write_tensor(tmp_path / "t.zt", torch.ones((), dtype=torch.bfloat16)).read_bytes()
    assert raw[-2:] == b"\x80\x3f" and len(raw) == 24 + 2


def test_write_is_atomic_and_leaves_no_temporary(tmp_path):
    write_tensor(tmp_path / "t.zt", torch.zeros(3))
    assert [p.name for p in tmp_path.iterdir()] == ["t.zt"]


def test_a_handover_file_holds_the_same_bytes_written_in_place(tmp_path, monkeypatch):
    """The runner's hand-over files: the same format byte for byte, no temporary file and no fsync."""
    t = sample(torch.bfloat16, (2, 1, 4, 3))
    atomic = write_tensor(tmp_path / "atomic.zt", t).read_bytes()
    monkeypatch.setattr("os.fsync", lambda fd: pytest.fail("a hand-over file was synced"))
    monkeypatch.setattr("tempfile.mkstemp", lambda *a, **k: pytest.fail("a hand-over file went through a temporary"))
    path = write_tensor(tmp_path / "handed.zt", t, handover=True)
    assert path.read_bytes() == atomic
    assert torch.equal(read_tensor(path), t)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["atomic.zt", "handed.zt"]


def _valid(tmp_path) -> bytes:
    return write_tensor(tmp_path / "ok.zt", torch.arange(12, dtype=torch.int64).reshape(3, 4)).read_bytes()


@pytest.mark.parametrize("mangle, words", [
    (lambda b: b[:10], "shorter than its 24-byte header"),
    (lambda b: b[:30], "truncated"),
    (lambda b: b[:-1], "truncated"),
    (lambda b: b + b"\x00", "trailing bytes"),
    (lambda b: b"PK\x03\x04" + b[4:], "not a zoo tensor file"),
    (lambda b: b[:8] + struct.pack("<I", 2) + b[12:], "version 2"),
    (lambda b: b[:12] + struct.pack("<I", 99) + b[16:], "dtype code 99"),
    (lambda b: b[:16] + struct.pack("<I", 40) + b[20:], "corrupt header"),
    (lambda b: b[:24] + struct.pack("<q", -3) + b[32:], "negative size"),
    (lambda b: b"", "shorter than"),
], ids=["header-cut", "sizes-cut", "data-cut", "trailing", "foreign", "version", "dtype", "rank", "negative", "empty"])
def test_bad_files_are_refused_clearly(tmp_path, mangle, words):
    bad = tmp_path / "bad.zt"
    bad.write_bytes(mangle(_valid(tmp_path)))
    with pytest.raises(TensorFileError, match=words) as info:
        read_tensor(bad)
    assert isinstance(info.value, ZooError) and str(bad) in str(info.value)


def test_a_foreign_file_of_plausible_size_is_refused(tmp_path):
    path = tmp_path / "t.pt"
    torch.save(torch.zeros(4), path)
    with pytest.raises(TensorFileError, match="not a zoo tensor file"):
        read_tensor(path)


def test_missing_file_and_unsupported_dtype(tmp_path):
    with pytest.raises(TensorFileError, match="cannot open"):
        read_tensor(tmp_path / "nope.zt")
    with pytest.raises(TensorFileError, match="float8"):
        write_tensor(tmp_path / "f8.zt", torch.zeros(2, dtype=torch.float8_e4m3fn))
    assert not (tmp_path / "f8.zt").exists()
