"""zoo.export.lower.assemble: single-method ExecuTorch programs merged into one, checked against the program ExecuTorch writes
for all methods at once (byte for byte) and against eager PyTorch through ExecuTorch's own runtime (pybindings)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from zoo.contract import artifact
from zoo.export.lower import assemble
from zoo.contract.artifact import DataEntry, ensure_flatc
from zoo.export.lower.assemble import ProgramPart
from zoo.core.errors import LoweringError

from portable_lowering import lower_program  # tests/fixtures (tests/support/environment.py)
from support.two_methods import CALLS, X, MethodB, Unit, eager_calls, programs, run_calls, write


def sequential_and_assembled(tmp_path: Path, options, progs=None):
    ensure_flatc()
    progs = progs or programs()
    sequential = write(lower_program(copy.deepcopy(progs), options), tmp_path / "sequential", "model")
    parts = [write(lower_program({m: copy.deepcopy(ep)}, options), tmp_path / m, m) for m, ep in progs.items()]
    assembled = assemble.assemble_program(parts, tmp_path / "out")
    return sequential, assembled


@pytest.fixture(scope="module")
def lowered(tmp_path_factory):
    """``sequential_and_assembled`` once per set of options for the whole module (lowering is the slow part)."""
    cache = {}

    def get(**options):
        key = tuple(sorted(options.items()))
        if key not in cache:
            cache[key] = sequential_and_assembled(tmp_path_factory.mktemp("lowered"), dict(options))
        return cache[key]

    return get


@pytest.mark.parametrize("options", [{"init_buffers": ("count",)}, {}], ids=["initial-state", "no-initial-state"])
def test_assembled_program_is_the_sequential_program_byte_for_byte(lowered, options):
    sequential, assembled = lowered(**options)
    assert assembled.methods == ["a", "b"]
    assert assembled.pte.read_bytes() == sequential.pte.read_bytes()
    assert not assembled.data_files and not sequential.data_files


def test_assembled_program_computes_what_eager_computes(lowered):
    sequential, assembled = lowered(init_buffers=("count",))
    expected = eager_calls(CALLS)
    got = run_calls(assembled.pte, [], CALLS)
    for e, g in zip(expected, got):  # ``count`` carries from one call of ``a`` to the next, as in eager
        torch.testing.assert_close(g, e)


def test_external_constants_ptd_is_merged_to_the_sequential_bytes(lowered):
    sequential, assembled = lowered(init_buffers=("count",), external_constants=True)
    name = "_default_external_constant.ptd"
    assert set(assembled.data_files) == {name}
    merged = assembled.pte.parent / name
    assert merged.read_bytes() == sequential.data_files[name].read_bytes()
    # ``shared`` and ``scale`` were in both methods' files and are stored once
    summary = assembled.data_files[name]
    assert sum(summary.entries.values()) == sum(p.numel() * 4 for p in Unit().state_dict().values())
    for e, g in zip(eager_calls(CALLS), run_calls(assembled.pte, [merged], CALLS)):
        torch.testing.assert_close(g, e)
    assert _program_differences(sequential.pte, assembled.pte) == {"external data_buffer_idx"}


def _program_differences(a: Path, b: Path):
    """Which fields two programs differ in; the index of EXTERNAL tensor data is ignored by the runtime
    (schema/program.fbs, ExtraTensorInfo.location) and numbered per emitter, so it is told apart."""
    from executorch.exir.schema import TensorDataLocation

    pa, pb = artifact.read_pte_file(a).program, artifact.read_pte_file(b).program
    found = set()
    for plan_a, plan_b in zip(pa.execution_plan, pb.execution_plan):
        for va, vb in zip(plan_a.values, plan_b.values):
            if va != vb:
                info = getattr(va.val, "extra_tensor_info", None)
                external = info is not None and info.location == TensorDataLocation.EXTERNAL
                va.val.data_buffer_idx = vb.val.data_buffer_idx = 0
                found.add("external data_buffer_idx" if external and va == vb else f"value of {plan_a.name}")
        plan_a.values = plan_b.values = []
    if pa != pb:
        found.add("program")
    return found


def xnnpack_programs(tie: bool):
    """Both methods delegate to XNNPACK with their weights in ``weights.ptd`` (delegate named data in a .ptd,
    as the CUDA backend stores its weights). With ``tie``, two different parameters hold the same values."""
    from executorch.exir.passes.external_constants_pass import delegate_external_constants_pass_unlifted

    class Heads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.shared = nn.Linear(8, 8)
            self.head_a = nn.Linear(8, 4)
            self.head_b = nn.Linear(8, 4)
            if tie:
                self.head_b.load_state_dict(self.head_a.state_dict())

    class A(nn.Module):
        def __init__(self, u):
            super().__init__()
            self.u = u

        def forward(self, x):
            return self.u.head_a(torch.relu(self.u.shared(x)))

    class B(nn.Module):
        def __init__(self, u):
            super().__init__()
            self.u = u

        def forward(self, x):
            return self.u.head_b(self.u.shared(x))

    unit = Heads()

    def export(module):
        unlifted = torch.export.export(module, (X,)).module()
        delegate_external_constants_pass_unlifted(unlifted, lambda node: "weights")
        return torch.export.export(unlifted, (X,))

    return {"a": export(A(unit)), "b": export(B(unit))}, {"a": A(unit), "b": B(unit)}


@pytest.mark.parametrize("tie", [False, True], ids=["distinct-heads", "identical-heads"])
def test_delegate_weights_in_a_ptd_are_merged_and_run(tmp_path, tie):
    progs, eager = xnnpack_programs(tie)
    sequential, assembled = sequential_and_assembled(tmp_path, {"xnnpack_ptd": True}, progs)
    merged = tmp_path / "out" / "weights.ptd"
    assert assembled.pte.read_bytes() == sequential.pte.read_bytes()
    assert merged.read_bytes() == sequential.data_files["weights.ptd"].read_bytes()
    summary = assembled.data_files["weights.ptd"]
    head_bytes = (8 * 4 + 4) * 4
    if tie:  # two keys, one segment: ExecuTorch's runtime reads both heads from the one copy
        assert summary.shared_bytes == head_bytes
        assert any(len(keys) == 2 for keys in summary.segments)
    else:
        assert summary.shared_bytes == 0
    calls = [("a", X), ("b", X * 3)]
    with torch.no_grad():
        expected = [eager[m](x) for m, x in calls]
    for e, g in zip(expected, run_calls(assembled.pte, [merged], calls)):
        torch.testing.assert_close(g, e)


# --- the .ptd writer -----------------------------------------------------------------------------------------


def test_ptd_writer_matches_executorch_serializer_byte_for_byte(tmp_path):
    """Entries streamed from files give the bytes FlatTensorSerializer writes from memory, two keys of
    identical bytes naming one segment as the NamedDataStore makes them."""
    ensure_flatc()
    from executorch.exir._serialize._named_data_store import NamedDataStore
    from executorch.exir._serialize.data_serializer import DataPayload
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorSerializer

    blobs = {"a_weights_blob": bytes(range(256)) * 3, "b_weights_blob": bytes(range(256)) * 3,
             "c": b"\x07" * 1000, "d": b""}
    store = NamedDataStore()
    for key, data in blobs.items():
        store.add_named_data(key, data, 1, "blob")
    out = store.get_named_data_store_output()
    reference = bytes(FlatTensorSerializer().serialize(DataPayload(out.buffers, out.external_data["blob"])))

    entries = []
    for key, data in blobs.items():
        path = tmp_path / f"{key}.bin"
        path.write_bytes(b"junk" + data + b"tail")  # entries lie inside larger files
        entries.append(DataEntry(key, path, 4, len(data)))
    summary = assemble.write_data_file(entries, tmp_path / "blob.ptd")
    assert (tmp_path / "blob.ptd").read_bytes() == reference
    assert summary.segments[0] == ["a_weights_blob", "b_weights_blob"]
    assert summary.shared_bytes == len(blobs["a_weights_blob"])
    index = {e.key: e for e in artifact.read_ptd_entries(tmp_path / "blob.ptd")}
    assert index["a_weights_blob"].offset == index["b_weights_blob"].offset
    assert index["c"].offset != index["a_weights_blob"].offset


# --- refusals and atomicity ----------------------------------------------------------------------------------


def _parts(lowered, **options):
    """The single-method parts behind ``lowered(**options)``."""
    out = lowered(**options)[1].pte.parent
    return [ProgramPart(m, out.parent / m / f"{m}.pte", {p.name: p for p in (out.parent / m).glob("*.ptd")})
            for m in ("a", "b")]


def test_a_method_in_two_programs_is_refused(lowered, tmp_path):
    parts = _parts(lowered)
    with pytest.raises(LoweringError, match="method 'a' is in both"):
        assemble.assemble_program([parts[0], ProgramPart("again", parts[0].pte)], tmp_path / "out")


def test_a_data_key_with_two_contents_is_refused_and_nothing_is_written(lowered, tmp_path):
    parts = _parts(lowered, init_buffers=("count",), external_constants=True)
    other = Unit()
    with torch.no_grad():
        other.shared.weight.add_(1.0)
    changed = write(lower_program({"b": torch.export.export(MethodB(other), (X,))},
                                  {"init_buffers": ("count",), "external_constants": True}), tmp_path / "b2", "b")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.pte").write_bytes(b"an earlier run")
    with pytest.raises(LoweringError, match="'u.shared.weight' differs between 'a' and 'b'"):
        assemble.assemble_program([parts[0], changed], tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []  # the earlier .pte is gone, nothing new is there


def test_failure_while_writing_leaves_no_pte(lowered, tmp_path, monkeypatch):
    parts = _parts(lowered, init_buffers=("count",), external_constants=True)

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(assemble, "write_data_file", broken)
    with pytest.raises(OSError, match="disk full"):
        assemble.assemble_program(parts, tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []


def test_foreign_files_are_zoo_errors(tmp_path):
    bad = tmp_path / "x.pte"
    bad.write_bytes(b"not a program at all" * 10)
    with pytest.raises(LoweringError, match="not a readable ExecuTorch program"):
        artifact.read_pte_file(bad)
    with pytest.raises(LoweringError, match="not an ExecuTorch data file"):
        artifact.read_ptd_entries(bad)
