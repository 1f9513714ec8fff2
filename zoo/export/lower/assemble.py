"""Assembling one multi-method ExecuTorch program from programs lowered one method each.

Why and how: docs/ARCHITECTURE.md, "Assembling one program from single-method ones".
"""

from __future__ import annotations

import copy
import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Sequence, Tuple

from zoo.core.errors import LoweringError
from zoo.contract.artifact import PTE_NAME, DataEntry, ensure_flatc, range_chunks, read_ptd_entries, read_pte_file

DEFAULT_SEGMENT_ALIGNMENT = 128  # ExecutorchBackendConfig.segment_alignment and FlatTensorConfig's default


@dataclass
class ProgramPart:
    """One lowered program: its ``.pte`` and the ``.ptd`` files written beside it, by file name."""

    label: str  # the method it holds, for messages
    pte: Path
    data_files: Dict[str, Path] = field(default_factory=dict)


@dataclass
class DataFileSummary:
    """What an assembled ``.ptd`` holds: its entries, and the bytes that identical entries share."""

    name: str
    file_bytes: int
    entries: Dict[str, int]  # key -> bytes
    segments: List[List[str]]  # keys naming each segment, in file order
    shared_bytes: int  # bytes not stored again because an identical entry already had them

    def as_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "file_bytes": self.file_bytes, "entries": self.entries,
                "segments": self.segments, "shared_bytes": self.shared_bytes}


@dataclass
class AssembledProgram:
    pte: Path
    pte_bytes: int
    methods: List[str]
    data_files: Dict[str, DataFileSummary]

    def as_dict(self) -> Dict[str, Any]:
        return {"pte": self.pte.name, "pte_bytes": self.pte_bytes, "methods": self.methods,
                "data_files": {name: s.as_dict() for name, s in self.data_files.items()}}


# --- the .pte --------------------------------------------------------------------------------------------------


def merge_programs(parts: Sequence[Tuple[str, Any]]):
    """One ``PTEFile`` holding every execution plan of ``parts`` ((label, PTEFile) pairs), re-indexed.

    The inputs are not modified. Refuses two plans of one name, different schema versions, a key of named data
    with two different contents, and mutable data in more than one mutable segment (executorch 1.2's
    deserializer already refuses that).
    """
    from executorch.exir._serialize._named_data_store import NamedDataStore
    from executorch.exir._serialize._program import PTEFile
    from executorch.exir.schema import Buffer, DataLocation, Program, SubsegmentOffsets

    if not parts:
        raise LoweringError("no programs to assemble", "lower at least one method first")
    versions = {label: pte.program.version for label, pte in parts}
    if len(set(versions.values())) != 1:
        raise LoweringError(f"the programs have different schema versions {versions}",
                            "lower every method with the same executorch release")
    merged = Program(version=next(iter(versions.values())), execution_plan=[], constant_buffer=[Buffer(b"")],
                     backend_delegate_data=[], segments=[],
                     constant_segment=SubsegmentOffsets(segment_index=0, offsets=[]),
                     mutable_data_segments=None, named_data=None)
    mutable: List[Any] = [Buffer(b"")]
    constant_index: Dict[bytes, int] = {}
    mutable_index: Dict[bytes, int] = {}
    named = NamedDataStore()
    plan_owner: Dict[str, str] = {}

    for label, pte in parts:
        program = copy.deepcopy(pte.program)  # plans are moved into the merged program and re-indexed in place
        constants = _append_deduplicated(program.constant_buffer, merged.constant_buffer, constant_index)
        mutables = _append_deduplicated(pte.mutable_data or [], mutable, mutable_index)
        delegate_base = len(merged.backend_delegate_data)
        merged.backend_delegate_data.extend(program.backend_delegate_data)
        for plan in program.execution_plan:
            if plan.name in plan_owner:
                raise LoweringError(f"method {plan.name!r} is in both {plan_owner[plan.name]!r} and {label!r}",
                                    "give each lowered program different methods")
            plan_owner[plan.name] = label
            for value in plan.values:
                _reindex_tensor(value.val, constants, mutables, plan.name)
            for delegate in plan.delegates:
                if delegate.processed.location == DataLocation.INLINE:
                    delegate.processed.index += delegate_base
            merged.execution_plan.append(plan)
        if pte.named_data is not None:
            for key, entry in pte.named_data.pte_data.items():
                try:
                    named.add_named_data(key, pte.named_data.buffers[entry.buffer_index], entry.alignment,
                                         external_tag=None, tensor_layout=entry.tensor_layout)
                except ValueError as exc:
                    raise LoweringError(f"named data {key!r} of {label!r} differs from the same key in an "
                                        f"earlier program: {exc}",
                                        "the programs were not lowered from the same unit; lower them again "
                                        "together") from exc
    named_output = named.get_named_data_store_output()
    return PTEFile(program=merged, mutable_data=mutable if len(mutable) > 1 else None,
                   named_data=named_output if named_output.pte_data else None)


def _append_deduplicated(buffers: Sequence[Any], into: List[Any], index: Dict[bytes, int]) -> Dict[int, int]:
    """Append ``buffers[1:]`` (index 0 is the reserved empty entry) to ``into``, reusing identical ones."""
    mapping = {0: 0}
    for old, buffer in enumerate(buffers):
        if old == 0:
            continue
        data = bytes(buffer.storage)
        if data not in index:
            index[data] = len(into)
            into.append(buffer)
        mapping[old] = index[data]
    return mapping


def _reindex_tensor(value: Any, constants: Dict[int, int], mutables: Dict[int, int], plan: str) -> None:
    from executorch.exir.schema import Tensor, TensorDataLocation

    if not isinstance(value, Tensor) or value.data_buffer_idx == 0:
        return
    info = value.extra_tensor_info
    if info is not None and info.location == TensorDataLocation.EXTERNAL:
        return  # found by fully qualified name in a .ptd; data_buffer_idx is ignored
    if value.allocation_info is None:
        value.data_buffer_idx = constants[value.data_buffer_idx]
        return
    if info is not None and info.mutable_data_segments_idx != 0:
        raise LoweringError(f"method {plan!r} keeps mutable data in segment {info.mutable_data_segments_idx}",
                            "executorch 1.2 programs keep all initial mutable data in one segment")
    value.data_buffer_idx = mutables[value.data_buffer_idx]


def serialize_program(pte_file, *, segment_alignment: int = DEFAULT_SEGMENT_ALIGNMENT) -> bytes:
    """The ``.pte`` bytes of a ``PTEFile``, with ``to_executorch()``'s defaults (delegate data in segments)."""
    ensure_flatc()
    from executorch.exir._serialize._program import serialize_pte_binary

    return bytes(serialize_pte_binary(pte_file, extract_delegate_segments=True, segment_alignment=segment_alignment))


# --- the .ptd --------------------------------------------------------------------------------------------------


def entry_chunks(entry: DataEntry) -> Iterator[bytes]:
    """An entry's bytes, read from where they lie in pieces of at most 64 MiB."""
    return range_chunks(entry.source, entry.offset, entry.size)


def _digest(entry: DataEntry) -> bytes:
    h = hashlib.sha256()
    for chunk in entry_chunks(entry):
        h.update(chunk)
    return h.digest()


def _group_identical(entries: Sequence[DataEntry]) -> Tuple[List[DataEntry], List[int]]:
    """Unique contents (first entry holding each) and, per entry, the index of its content.

    Only entries of equal size can be equal, so only those are hashed.
    """
    by_size: Dict[int, int] = {}
    for entry in entries:
        by_size[entry.size] = by_size.get(entry.size, 0) + 1
    unique: List[DataEntry] = []
    seen: Dict[Tuple[int, bytes], int] = {}
    which: List[int] = []
    for entry in entries:
        key = (entry.size, _digest(entry) if by_size[entry.size] > 1 else entry.key.encode())
        if key not in seen:
            seen[key] = len(unique)
            unique.append(entry)
        which.append(seen[key])
    return unique, which


def write_data_file(entries: Sequence[DataEntry], dest: Path, *,
                    segment_alignment: int = DEFAULT_SEGMENT_ALIGNMENT) -> DataFileSummary:
    """Write a ``.ptd`` holding ``entries`` in FlatTensorSerializer's layout, identical bytes stored once.

    Header, flatbuffer index and segment placement follow ``FlatTensorSerializer.serialize`` exactly (the tests
    compare bytes); the difference is that the segment bytes are copied from their files, not held in memory.
    """
    ensure_flatc()
    from executorch.exir._serialize._program import _insert_flatbuffer_header
    from executorch.exir._serialize.padding import aligned_size, pad_to
    from executorch.extension.flat_tensor.serialize.flat_tensor_schema import DataSegment, FlatTensor, NamedData
    from executorch.extension.flat_tensor.serialize.serialize import (
        _FLAT_TENSOR_VERSION,
        _FLATBUFFER_ALIGNMENT,
        FlatTensorHeader,
        _serialize_to_flatbuffer,
    )

    keys = [e.key for e in entries]
    if len(set(keys)) != len(keys):
        raise LoweringError(f"{dest.name}: a key appears twice among {keys}", "merge the entries first")
    unique, which = _group_identical(entries)
    segments: List[DataSegment] = []
    for entry in unique:
        end = segments[-1].offset + segments[-1].size if segments else 0
        segments.append(DataSegment(offset=aligned_size(end, segment_alignment), size=entry.size))
    named = [NamedData(key=e.key, segment_index=w, tensor_layout=e.tensor_layout) for e, w in zip(entries, which)]
    payload = bytes(_serialize_to_flatbuffer(FlatTensor(version=_FLAT_TENSOR_VERSION, segments=segments,
                                                        named_data=named)))
    header_length = aligned_size(FlatTensorHeader.EXPECTED_LENGTH, _FLATBUFFER_ALIGNMENT)
    base = aligned_size(len(payload) + header_length, segment_alignment)
    data_size = segments[-1].offset + segments[-1].size if segments else 0
    header = FlatTensorHeader(flatbuffer_offset=header_length, flatbuffer_size=len(payload),
                              segment_base_offset=base, segment_data_size=data_size).to_bytes()
    head = pad_to(_insert_flatbuffer_header(payload, r"FT[0-9a-zA-Z][0-9a-zA-Z]", pad_to(header, header_length)),
                  base)
    with open(dest, "wb") as out:
        out.write(head)
        for entry, segment in zip(unique, segments):
            out.write(b"\x00" * (base + segment.offset - out.tell()))
            for chunk in entry_chunks(entry):
                out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    members: List[List[str]] = [[] for _ in unique]
    for entry, w in zip(entries, which):
        members[w].append(entry.key)
    return DataFileSummary(name=dest.name, file_bytes=dest.stat().st_size, entries={e.key: e.size for e in entries},
                           segments=members, shared_bytes=sum(e.size for e in entries) - sum(e.size for e in unique))


def merge_data_entries(parts: Sequence[Tuple[str, List[DataEntry]]]) -> List[DataEntry]:
    """The entries of several ``.ptd`` files of one name, each key once; a key twice must have the same bytes."""
    merged: Dict[str, Tuple[str, DataEntry]] = {}
    for label, entries in parts:
        for entry in entries:
            if entry.key not in merged:
                merged[entry.key] = (label, entry)
                continue
            first_label, first = merged[entry.key]
            if first.size != entry.size or _digest(first) != _digest(entry):
                raise LoweringError(f"data entry {entry.key!r} differs between {first_label!r} and {label!r} "
                                    f"({first.size} and {entry.size} bytes)",
                                    "the programs were not lowered from the same weights; lower them again")
    return [entry for _, entry in merged.values()]


# --- both, atomically ------------------------------------------------------------------------------------------


def assemble_program(parts: Sequence[ProgramPart], out_dir: Path, *, pte_name: str = PTE_NAME,
                     segment_alignment: int = DEFAULT_SEGMENT_ALIGNMENT) -> AssembledProgram:
    """Merge ``parts`` into ``out_dir/pte_name`` plus one ``.ptd`` per data file name, atomically.

    ``pte_name`` is removed first; the data files are written to a staging folder and moved into place, and the
    ``.pte`` is moved last: an interrupted or failed assembly never leaves a ``.pte`` beside other weights.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    merged = merge_programs([(part.label, read_pte_file(part.pte)) for part in parts])
    pte_bytes = serialize_program(merged, segment_alignment=segment_alignment)
    by_name: Dict[str, List[Tuple[str, List[DataEntry]]]] = {}
    for part in parts:
        for name, path in part.data_files.items():
            by_name.setdefault(name, []).append((part.label, read_ptd_entries(path)))

    pte = out_dir / pte_name
    pte.unlink(missing_ok=True)  # a .pte left from an earlier run must not pair with the new data files
    staging = Path(tempfile.mkdtemp(prefix=".assemble.tmp-", dir=out_dir))
    try:
        summaries = {name: write_data_file(merge_data_entries(found), staging / name,
                                           segment_alignment=segment_alignment)
                     for name, found in by_name.items()}
        with open(staging / pte_name, "wb") as fh:
            fh.write(pte_bytes)
            fh.flush()
            os.fsync(fh.fileno())
        for name in summaries:
            os.replace(staging / name, out_dir / name)
        os.replace(staging / pte_name, pte)  # the commit point
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return AssembledProgram(pte=pte, pte_bytes=len(pte_bytes),
                            methods=[plan.name for plan in merged.program.execution_plan], data_files=summaries)

