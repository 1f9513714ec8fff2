"""The recipe's ``lowering.gemm`` (who computes the GEMMs) on the CPU: what ExecuTorch's CUDA backend is told while
a method compiles, what the artifact then needs of the runtime (runtime.json), the audit's row for zoo's runtime
build, and the refusal of a runtime built without the cuBLAS shims. Hand-worked cases; the shims' own mapping is
tests/test_gemm_plan_cpp.py, and a lowered, verified GEMM is tests/gpu/test_gpu_lowering.py's."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from zoo.contract.recipes import load_recipe
from zoo.contract.releases import (GEMM_FEATURE, RuntimeRequirement, features_for, load_features, load_runtimes,
                                   lowering_features, zoo_build_rows)
from zoo.core.errors import RecipeError, RuntimeMismatch
from zoo.export import audit
from zoo.export.lower.compile_settings import gemm_backends

SHIMS = ["aoti_torch_cuda_addmm_out", "aoti_torch_cuda_baddbmm_out", "aoti_torch_cuda_bmm_out",
         "aoti_torch_cuda_mm_out"]


def test_the_recipe_takes_three_words_and_refuses_others():
    assert load_recipe("llama-rope-tiny").lowering.gemm == "triton"
    for word, features in (("triton", []), ("cublas", [GEMM_FEATURE]), ("autotune", [GEMM_FEATURE])):
        recipe = load_recipe("llama-rope-tiny", overrides=[f"lowering.gemm={word}"])
        assert lowering_features(recipe.lowering) == features
    with pytest.raises(RecipeError) as e:
        load_recipe("llama-rope-tiny", overrides=["lowering.gemm=cudnn"])
    assert "lowering.gemm='cudnn' is not allowed" in str(e.value) and "triton, cublas, autotune" in e.value.hint


@pytest.mark.parametrize("gemm,backends", [("cublas", "ATEN"), ("autotune", "ATEN,TRITON")])
def test_the_backend_is_told_of_the_shims_only_while_a_method_compiles(gemm, backends):
    from executorch.backends.cuda.cuda_backend import CudaBackend

    from zoo.contract.releases import compile_specs

    specs = compile_specs("forward", "OFF")
    assert CudaBackend.get_aoti_compile_options(specs)["max_autotune_gemm_backends"] == "TRITON"
    before = set(CudaBackend.get_supported_fallback_kernels())
    with gemm_backends(gemm) as settings:
        assert CudaBackend.get_aoti_compile_options(specs)["max_autotune_gemm_backends"] == backends
        assert set(CudaBackend.get_supported_fallback_kernels()) == before | set(SHIMS)
        assert settings["shims"] == SHIMS
        import torch._inductor.config as inductor_config

        assert inductor_config.triton.autotune_cublasLt is False  # its bias addmm has no C shim
    assert CudaBackend.get_aoti_compile_options(specs)["max_autotune_gemm_backends"] == "TRITON"
    assert set(CudaBackend.get_supported_fallback_kernels()) == before
    with gemm_backends("triton") as settings:
        assert CudaBackend.get_aoti_compile_options(specs)["max_autotune_gemm_backends"] == "TRITON"
    assert settings == {"gemm": "triton"}


def test_the_feature_is_what_the_shim_source_defines():
    feature = load_features()[GEMM_FEATURE]
    from pathlib import Path

    source = (Path(__file__).resolve().parents[1] / "runtime" / "cpp" / "cublas_gemm.cu").read_text()
    defined = {name for name in SHIMS if f"Error {name}(" in source}
    assert feature.symbols == feature.fallback_kernels == defined == set(SHIMS)
    assert feature.releases == ["1.2"]


def test_an_artifact_that_needs_the_shims_refuses_a_runtime_built_without_them():
    requirement = RuntimeRequirement(release="1.2", lowered_with="1.2.0", features=[GEMM_FEATURE])
    with pytest.raises(RuntimeMismatch) as e:
        requirement.check({"executorch_version": "1.2.0", "features": []})
    assert "needs cublas-gemm from zoo's build of ExecuTorch's runtime 1.2" in str(e.value)
    assert "lowering.gemm=triton" in e.value.hint and "build_runtime.sh" in e.value.hint
    with pytest.raises(RuntimeMismatch):  # a zoo_runner older than the "features" key
        requirement.check({"executorch_version": "1.2.0"})
    requirement.check({"executorch_version": "1.2.0", "features": [GEMM_FEATURE]})
    from zoo.runtimes.executorch import describe

    assert describe({"executorch_version": "1.2.0", "cuda": True, "features": [GEMM_FEATURE]}).endswith(
        "zoo's additions: cublas-gemm)")
    assert "built by zoo with cublas-gemm" in requirement.describe()
    again = RuntimeRequirement.from_dict(requirement.as_dict())
    assert again.features == [GEMM_FEATURE]
    old = {"release": "1.2", "lowered_with": "1.2.0"}  # runtime.json before the key existed
    assert RuntimeRequirement.from_dict(old).features == []


def test_the_audit_adds_zoos_build_only_for_an_artifact_that_imports_its_shims():
    runtimes = load_runtimes()
    assert zoo_build_rows(runtimes, {"aoti_torch_get_data_ptr"}) == {}
    # What the lowering writes into runtime.json, from the symbols the .so files import.
    assert [f.name for f in features_for({"aoti_torch_get_data_ptr", "aoti_torch_cuda_bmm_out"})] == [GEMM_FEATURE]
    assert features_for({"aoti_torch_get_data_ptr"}) == []
    rows = zoo_build_rows(runtimes, {"aoti_torch_get_data_ptr", "aoti_torch_cuda_mm_out"})
    assert list(rows) == ["1.2+cublas-gemm"]  # the only release zoo builds with the shims
    row = rows["1.2+cublas-gemm"]
    assert row.symbols == runtimes["1.2"].symbols | set(SHIMS) and row.version == "1.2.0 built by zoo"


C_SOURCE = """
typedef void* T;
int aoti_torch_get_data_ptr(T, void**);
int aoti_torch_cuda_mm_out(T, T, T);
int f(T a, T b, T c) { void* p; aoti_torch_get_data_ptr(a, &p); return aoti_torch_cuda_mm_out(a, b, c); }
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_a_library_calling_the_gemm_shim_loads_on_zoos_build_only(tmp_path):
    src, so = tmp_path / "gemm.c", tmp_path / "forward.so"
    src.write_text(C_SOURCE)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    result = audit.audit_artifact(so)
    assert result.loadable("1.2+cublas-gemm")
    assert not result.loadable("1.2") and result.methods[0].missing["1.2"] == ["aoti_torch_cuda_mm_out"]
    assert not any(result.loadable(r) for r in result.releases if "+" not in r)  # no stock release has it
    assert "aoti_torch_cuda_mm_out: needed by the .so; only releases 1.2+cublas-gemm provide it" in result.notes
    # Running zoo's build that has the feature agrees with the audit; a stock 1.2 that failed agrees too.
    ran = audit.audit_agreement(result, "1.2.0", ran=True, features=[GEMM_FEATURE])
    assert ran["release"] == "1.2+cublas-gemm" and ran["agrees"] is True
    # The command line: --require names a stock release or zoo's build of one.
    assert audit.audit_main([str(so), "--require", "1.2"]) == 1
    assert audit.audit_main([str(so), "--require", "1.2+cublas-gemm"]) == 0
    from zoo.core.errors import LoweringError

    assert audit.audit_main([str(so), "--require", "1.3+cublas-gemm"]) == LoweringError.exit_code  # zoo builds 1.2
    failed = audit.audit_agreement(result, "1.2.0", ran=False, why="undefined symbol: aoti_torch_cuda_mm_out")
    assert failed["release"] == "1.2" and failed["agrees"] is True
    assert "lacks aoti_torch_cuda_mm_out" in failed["reason"]


def test_the_card_sends_a_cublas_artifact_to_zoos_runtime_build():
    from zoo.export.publish.model_card import _build_lines

    needs = RuntimeRequirement(release="1.2", lowered_with="1.2.0", features=[GEMM_FEATURE],
                               memory_planned={"forward": {"inputs": [True], "outputs": [True]}})
    text = "\n".join(_build_lines({"runtime": needs.as_dict()}, {"ref": "v1.2.0"}, "org/x"))
    # Planned I/O alone would send it to executor_runner; the shims it imports need zoo's build.
    assert "executor_runner -j" not in text and "scripts/build_runtime.sh" in text
    assert "needs what zoo's build adds to that runtime: cublas-gemm" in text
    assert "left out of memory planning" not in text  # its I/O is planned: only the shims send it to zoo's build
    plain = RuntimeRequirement(release="1.2", lowered_with="1.2.0",
                               memory_planned={"forward": {"inputs": [True], "outputs": [True]}})
    assert "executor_runner -j" in "\n".join(_build_lines({"runtime": plain.as_dict()}, {"ref": "v1.2.0"}, "org/x"))


def test_the_preflight_names_the_gemm_shims_a_cublas_lowering_calls_and_allows_them():
    import torch
    from torch import nn

    from zoo.export.lower import preflight

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 8)

        def forward(self, x, y):
            return self.proj(x), torch.bmm(y, y.transpose(1, 2))

    with torch.no_grad():
        ep = torch.export.export(Block(), (torch.randn(4, 16), torch.randn(2, 3, 5)))
    programs = {"forward": ep}
    plain = preflight.check_kernels(programs, "1.2", triton_kernel_mode="OFF")
    assert plain.ok and not plain.needs  # Triton templates: no shim
    for gemm in ("cublas", "autotune"):
        result = preflight.check_kernels(programs, "1.2", triton_kernel_mode="OFF", gemm=gemm)
        assert result.ok, result.refused
        kernels = sorted(n.kernel for n in result.needs)
        assert kernels == ["aoti_torch_cuda_addmm_out", "aoti_torch_cuda_bmm_out"], kernels
        assert all("allowed and provided by runtime 1.2+cublas-gemm" in n.why for n in result.needs)


def test_the_choice_reaches_a_method_s_compile(monkeypatch):
    """From the recipe to the options a worker gets (JSON) to the backend settings in force while it compiles."""
    import json

    import torch
    from executorch.backends.cuda.cuda_backend import CudaBackend

    from zoo.contract.releases import compile_specs
    from zoo.export.lower import lowering, method_lowering

    recipe = load_recipe("llama-rope-tiny", overrides=["lowering.gemm=autotune"])
    options = json.loads(json.dumps(lowering.lowering_options(recipe, False, None)))  # as a worker reads them
    assert options["gemm"] == "autotune"
    seen = {}

    from zoo.core.errors import ZooError

    class Stop(ZooError):  # a zoo error passes through the lowering's own wrapping
        pass

    def compile_now(method, program, partitioner, seconds, preflight):
        seen["backends"] = CudaBackend.get_aoti_compile_options(compile_specs(method, "OFF"))[
            "max_autotune_gemm_backends"]
        raise Stop("compiled")

    monkeypatch.setattr(method_lowering, "edge_and_lower", compile_now)
    program = torch.export.export(torch.nn.Linear(4, 4), (torch.randn(2, 4),))
    with pytest.raises(Stop):
        method_lowering.lower_with_partitioner("forward", program, options, partitioner=None)
    assert seen["backends"] == "ATEN,TRITON"
    after = CudaBackend.get_aoti_compile_options(compile_specs("forward", "OFF"))
    assert after["max_autotune_gemm_backends"] == "TRITON"
