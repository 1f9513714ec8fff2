"""Runtime audit on real ELF libraries: the checked-in fixtures (tests/fixtures/so, built from aoti_needs.c)
and one compiled here with cc. Expected symbols are the ones written into the C sources by hand."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from zoo.export import audit
from zoo.core.errors import LoweringError
from zoo.contract.releases import load_runtimes

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "so"
# What every fixture's C source references as undefined aoti_torch_* functions (see aoti_needs.c).
BASE_NEEDS = ["aoti_torch_create_cuda_guard", "aoti_torch_device_type_cuda", "aoti_torch_dtype_float32",
              "aoti_torch_empty_strided", "aoti_torch_get_data_ptr"]
RELEASES = ["1.2", "1.3", "1.4", "1.5"]


def test_runtime_table_has_every_release_and_each_extends_the_one_before():
    runtimes = load_runtimes()
    assert list(runtimes) == RELEASES
    for older, newer in zip(RELEASES, RELEASES[1:]):
        assert runtimes[older].symbols < runtimes[newer].symbols
        assert runtimes[older].allowed_fallback_kernels <= runtimes[newer].allowed_fallback_kernels
    # The facts the table encodes (notes/executorch-cuda.md section 2): no float64 anywhere, float16 from 1.4.
    assert all("float64" not in r.dtypes and "aoti_torch_dtype_float64" not in r.symbols for r in runtimes.values())
    assert ["float16" in runtimes[r].dtypes for r in RELEASES] == [False, False, True, True]
    for r in runtimes.values():  # every dtype the table claims has its shim function, and the reverse
        assert {s[len("aoti_torch_dtype_"):] for s in r.symbols if s.startswith("aoti_torch_dtype_")} == set(r.dtypes)


def test_release_1_2_matches_the_shim_names_shipped_in_the_executorch_wheel():
    # executorch 1.2.0 ships the import library of its CUDA shims (for Windows cross-builds): an independent
    # list of exactly the functions the 1.2 runtime exports.
    from importlib.util import find_spec

    spec = find_spec("executorch")
    libs = [Path(p) / "data" / "lib" / "aoti_cuda_shims.lib" for p in spec.submodule_search_locations]
    lib = next((p for p in libs if p.exists()), None)
    if lib is None:
        pytest.skip("this executorch wheel has no data/lib/aoti_cuda_shims.lib")
    shipped = set(re.findall(rb"aoti_torch[a-z0-9_]*", lib.read_bytes()))
    assert {s.decode() for s in shipped} == load_runtimes()["1.2"].symbols


def test_undefined_symbols_are_read_from_the_dynamic_table():
    # The defined aoti_torch_defined_here and the undefined non-aoti cuLaunchKernel are not needs.
    assert audit.undefined_aoti_symbols(FIXTURES / "clean.so") == BASE_NEEDS
    assert audit.undefined_aoti_symbols(FIXTURES / "float64.so") == sorted(BASE_NEEDS + ["aoti_torch_dtype_float64"])
    assert audit.undefined_aoti_symbols((FIXTURES / "scatter.so").read_bytes()) == sorted(
        BASE_NEEDS + ["aoti_torch_cuda_scatter_reduce_two_out", "aoti_torch_dtype_int64"])


def test_clean_library_loads_on_every_release():
    result = audit.audit_artifact(FIXTURES / "clean.so")
    assert result.loadable_releases() == RELEASES
    assert result.dtypes() == ["float32"]
    assert result.notes == []


def test_float64_library_loads_nowhere_and_the_audit_says_why():
    result = audit.audit_artifact(FIXTURES / "float64.so")
    assert result.loadable_releases() == []
    assert result.dtypes() == ["float32", "float64"]
    for release in RELEASES:
        assert result.methods[0].missing[release] == ["aoti_torch_dtype_float64"]
    assert any("float64" in n and "rotary_pairs=float32" in n for n in result.notes)
    table = result.table()
    assert "aoti_torch_dtype_float64" in table and "NO" in table
    # Reports carry no path (a run is audited in its staging folder); the command line names what it read.
    assert "float64.so" not in table and result.table(title=True).startswith("runtime audit of float64.so")


def test_float16_library_needs_release_1_4():
    result = audit.audit_artifact(FIXTURES / "float16.so")
    assert [result.loadable(r) for r in RELEASES] == [False, False, True, True]
    assert result.as_dict()["releases"]["1.3"]["missing"] == {"float16": ["aoti_torch_dtype_float16"]}


def test_direct_scatter_fallback_is_missing_everywhere():
    result = audit.audit_artifact(FIXTURES / "scatter.so")
    assert result.loadable_releases() == []
    assert all(m == ["aoti_torch_cuda_scatter_reduce_two_out"] for m in result.methods[0].missing.values())
    assert any(n.startswith("aoti_torch_cuda_scatter_reduce_two_out") for n in result.notes)


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_library_built_here_with_cc(tmp_path):
    src = tmp_path / "m.c"
    src.write_text("int aoti_torch_dtype_bfloat16(void); int aoti_torch_dtype_bool(void);\n"
                   "int aoti_torch_check(void);\n"
                   "int run(void) { return aoti_torch_dtype_bfloat16() + aoti_torch_dtype_bool()"
                   " + aoti_torch_check(); }\n")
    so = tmp_path / "m.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    result = audit.audit_artifact(so)
    assert result.methods[0].symbols == ["aoti_torch_check", "aoti_torch_dtype_bfloat16", "aoti_torch_dtype_bool"]
    # aoti_torch_check is listed from 1.5 only (the table's conservative choice for names first seen in main).
    assert [result.loadable(r) for r in RELEASES] == [False, False, False, True]


def test_audit_main_prints_json_and_exits_by_loadability(capsys):
    assert audit.audit_main([str(FIXTURES / "clean.so"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["releases"]["1.2"] == {"version": "1.2.0", "loadable": True, "missing": {},
                                       "tested": "inferred from symbols", "caveats": []}
    assert audit.audit_main([str(FIXTURES / "float64.so")]) == 1
    assert "aoti_torch_dtype_float64" in capsys.readouterr().out
    assert audit.audit_main([str(FIXTURES / "float16.so"), "--require", "1.2"]) == 1
    assert audit.audit_main([str(FIXTURES / "float16.so"), "--require", "1.4"]) == 0
    capsys.readouterr()
    assert audit.audit_main([str(FIXTURES / "clean.so"), "--require", "9.9"]) == LoweringError.exit_code
    assert "unknown runtime release" in capsys.readouterr().err


def test_bad_paths_are_zoo_errors(tmp_path, capsys):
    not_elf = tmp_path / "x.so"
    not_elf.write_bytes(b"not an ELF file")
    with pytest.raises(LoweringError, match="not an ELF shared library"):
        audit.audit_artifact(not_elf)
    with pytest.raises(LoweringError, match="does not exist"):
        audit.audit_artifact(tmp_path / "missing.pte")
    with pytest.raises(LoweringError, match="neither model.pte nor so/"):
        audit.audit_artifact(tmp_path)
    assert audit.audit_main([str(not_elf)]) == LoweringError.exit_code
    assert "what to do" in capsys.readouterr().err


def test_run_folder_without_pte_audits_its_so_files(tmp_path):
    (tmp_path / "so").mkdir()
    shutil.copy(FIXTURES / "clean.so", tmp_path / "so" / "video_step.so")
    shutil.copy(FIXTURES / "float64.so", tmp_path / "so" / "action_step.so")
    result = audit.audit_artifact(tmp_path)
    by_method = {m.method: m for m in result.methods}
    assert set(by_method) == {"video_step", "action_step"}
    assert by_method["video_step"].loadable("1.2") and not by_method["action_step"].loadable("1.2")
    assert not result.loadable("1.2")


# The import list of real model libraries lowered on an H200 (tests/fixtures/so/h200_imports.c): what a
# torch 2.11 AOTInductor .so for ExecuTorch actually asks the runtime for.
H200_ROPE_IMPORTS = [
    "aoti_torch__reinterpret_tensor", "aoti_torch_clone", "aoti_torch_clone_preserve_strides",
    "aoti_torch_create_cuda_stream_guard", "aoti_torch_create_tensor_from_blob",
    "aoti_torch_create_tensor_from_blob_v2", "aoti_torch_delete_cuda_stream_guard", "aoti_torch_delete_tensor_object",
    "aoti_torch_device_type_cpu", "aoti_torch_device_type_cuda", "aoti_torch_dtype_float32",
    "aoti_torch_empty_strided", "aoti_torch_get_data_ptr", "aoti_torch_get_device_type", "aoti_torch_get_dtype",
    "aoti_torch_get_sizes", "aoti_torch_get_storage_offset", "aoti_torch_get_storage_size", "aoti_torch_get_strides",
    "aoti_torch_grad_mode_is_enabled", "aoti_torch_grad_mode_set_enabled", "aoti_torch_layout_strided",
    "aoti_torch_new_tensor_handle", "aoti_torch_warn"]


def test_real_float32_pairs_library_loads_on_every_release():
    result = audit.audit_artifact(FIXTURES / "h200_rope.so")
    assert result.methods[0].symbols == H200_ROPE_IMPORTS
    assert result.loadable_releases() == RELEASES


def test_real_float64_pairs_library_needs_a_runtime_with_float64():
    result = audit.audit_artifact(FIXTURES / "h200_rope64.so")
    expected = sorted(set(H200_ROPE_IMPORTS) - {"aoti_torch__reinterpret_tensor"} | {"aoti_torch_dtype_float64"})
    assert result.methods[0].symbols == expected
    assert result.loadable_releases() == []
    assert {r: m for r, m in result.methods[0].missing.items()} == {r: ["aoti_torch_dtype_float64"] for r in RELEASES}


# --- tested by running: the prediction next to what a runtime built from one release did -------------------------


@pytest.mark.parametrize("library, ran, agrees, words", [
    ("clean.so", True, True, "loadable by the audit, and it ran"),
    ("float64.so", False, True, "not loadable by the audit (1.2 lacks aoti_torch_dtype_float64), and it failed"),
    ("clean.so", False, False, "the audit calls it loadable, but it failed to run: exit 127"),
    ("float64.so", True, False, "the audit says not loadable (1.2 lacks aoti_torch_dtype_float64), but it ran"),
])
def test_running_marks_the_release_tested_and_a_contradiction_is_a_finding(library, ran, agrees, words):
    result = audit.audit_artifact(FIXTURES / library)
    why = "" if ran else "exit 127 (a symbol lookup error)"
    agreement = audit.audit_agreement(result, "1.2.0", ran=ran, why=why, gpu="NVIDIA H200")
    assert agreement["release"] == "1.2" and agreement["agrees"] is agrees and words in agreement["verdict"]
    audit.mark_tested(result, agreement)
    tested = "by running: ok on NVIDIA H200" if ran else f"by running: FAILED: {why}"
    record = result.as_dict()["releases"]
    assert record["1.2"]["tested"] == tested
    assert [record[r]["tested"] for r in ("1.3", "1.4", "1.5")] == ["inferred from symbols"] * 3
    table = result.table()
    assert table.splitlines()[4].split()[-1] == "tested" and tested in table  # the release table: column, 1.2 row
    assert result.findings == ([] if agrees else [agreement["verdict"]])
    assert ("FINDING" in table) is (not agrees)


def test_a_runtime_release_the_table_lacks_is_said_so():
    result = audit.audit_artifact(FIXTURES / "clean.so")
    agreement = audit.audit_agreement(result, "1.9.0a0", ran=True, gpu="H200")
    assert agreement["release"] == "1.9" and agreement["agrees"] is None and "no release '1.9'" in agreement["verdict"]
    audit.mark_tested(result, agreement)
    assert set(result.tested) == set() and result.findings == []
