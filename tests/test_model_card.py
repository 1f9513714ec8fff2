"""The model card's pieces: license and base model, the audit table, the runner's ExecuTorch ref, and the
rendering of hand-worked manifests (every expected string below is written out by hand)."""

from __future__ import annotations

import pytest
import yaml

from zoo.contract import chunk_latency
from zoo.contract.host_settings import NoHostSettings
from zoo.contract.io_spec import IoSpec
from zoo.export.publish.card_results import audit_rows
from zoo.export.publish.model_card import card_metadata, render_card, resolve_license, runtime_ref

from support.contract_cases import llama_settings
from support.manifests import manifest


def checkpoint(tmp_path, header: str):
    (tmp_path / "README.md").write_text(header + "# a checkpoint\n")
    return str(tmp_path)


# --- license --------------------------------------------------------------------------------------------


def test_license_prefers_source_json_then_local_card_then_recipe(tmp_path):
    local = checkpoint(tmp_path, "---\nlicense: other\nlicense_name: lingbot-license\nlicense_link: LICENSE\n---\n")
    recipe = {"publish": {"license": "mit"}}
    assert resolve_license({"license": "apache-2.0", "local_dir": local}, recipe) == \
        {"license": "apache-2.0", "from": "source.json"}
    assert resolve_license({"local_dir": local}, recipe) == \
        {"license": "other", "license_name": "lingbot-license", "license_link": "LICENSE",
         "from": "the source checkpoint's model card"}
    assert resolve_license({"local_dir": str(tmp_path / "missing")}, recipe) == \
        {"license": "mit", "from": "recipe publish.license"}
    assert resolve_license({}, {"publish": {"license": None}}) is None


def test_a_card_without_a_header_or_license_falls_through(tmp_path):
    local = checkpoint(tmp_path, "")
    assert resolve_license({"local_dir": local}, {}) is None
    local2 = checkpoint(tmp_path, "---\n- just a list\n---\n")
    assert resolve_license({"local_dir": local2}, {"publish": {"license": "mit"}})["license"] == "mit"


# --- Hub metadata ---------------------------------------------------------------------------------------


def test_metadata_names_license_base_model_and_tags():
    meta = card_metadata(manifest())
    assert meta == {"license": "apache-2.0", "base_model": "robbyant/lingbot-va", "library_name": "executorch",
                    "pipeline_tag": "robotics",
                    "tags": ["robotics", "lerobot", "executorch", "cuda", "aoti", "zoo", "lingbot-va"]}


def test_a_local_checkpoint_folder_gets_no_base_model():
    m = manifest(source={"repo_id": "robbyant/lingbot-va", "revision": "main", "commit": None})
    assert "base_model" not in card_metadata(m)


def test_fabricated_checkpoints_get_no_base_model_and_a_warning():
    m = manifest(license=None)
    m["recipe"]["source"]["fabricate"] = True
    meta = card_metadata(m)
    assert "base_model" not in meta and "license" not in meta
    card = render_card(m, None, NoHostSettings(), "org/tiny")
    assert "**Test artifact.**" in card
    assert "License: none stated by the source checkpoint or the recipe" in card
    assert "license:" not in card.split("---\n")[1]


# --- audit and runtime ------------------------------------------------------------------------------------


def test_audit_rows_read_both_forms_of_the_audit_record():
    # AuditResult.as_dict(): per release its version, loadability and each method's missing symbols
    as_dict = {"path": "/x", "releases": {
        "1.10": {"version": "1.10.0", "loadable": True, "missing": {}},
        "1.2": {"version": "1.2.0", "loadable": False,
                "missing": {"video_step": ["aoti_torch_dtype_float64"],
                            "action_step": ["aoti_torch_dtype_float64", "aoti_torch_cuda_mm_out"]}},
        "1.9": {"version": "1.9.2", "loadable": True, "missing": {}},
    }, "notes": []}
    # the dataclass fields of AuditResult: releases map to versions, the missing lists sit in each method
    fields = {"path": "/x", "releases": {"1.2": "1.2.0", "1.9": "1.9.2", "1.10": "1.10.0"}, "methods": [
        {"method": "video_step", "missing": {"1.2": ["aoti_torch_dtype_float64"], "1.9": [], "1.10": []}},
        {"method": "action_step", "missing": {"1.2": ["aoti_torch_dtype_float64", "aoti_torch_cuda_mm_out"],
                                              "1.9": [], "1.10": []}}]}
    expected = [
        {"release": "1.2", "version": "1.2.0", "loadable": False,
         "missing": ["aoti_torch_cuda_mm_out", "aoti_torch_dtype_float64"]},
        {"release": "1.9", "version": "1.9.2", "loadable": True, "missing": []},
        {"release": "1.10", "version": "1.10.0", "loadable": True, "missing": []},
    ]
    assert audit_rows(as_dict) == expected
    assert audit_rows(fields) == expected
    assert audit_rows(None) == []


@pytest.mark.parametrize("audit, expected", [
    ({"1.2": {"version": "1.2.0", "loadable": True, "missing": {}},
      "1.4": {"version": "1.4.1", "loadable": True, "missing": {}}},
     {"ref": "v1.2.0", "release": "1.2.0", "loadable": True}),
    ({"1.2": {"version": "1.2.0", "loadable": False, "missing": {"m": ["x"]}},
      "1.4": {"version": "1.4.1", "loadable": True, "missing": {}}},
     {"ref": "v1.4.1", "release": "1.4.1", "loadable": True}),
    ({"1.2": {"loadable": False, "missing": ["x"]}, "1.3": {"loadable": True, "missing": []}},
     {"ref": "release/1.3", "release": "1.3", "loadable": True}),
    ({"1.2": {"version": "1.2.0", "loadable": False, "missing": {"m": ["x"]}}},
     {"ref": "v1.2.0", "release": "1.2.0", "loadable": False}),
    ({}, {"ref": "v1.2.0", "release": "1.2.0", "loadable": None}),
])
def test_runner_is_built_from_a_release_the_audit_says_loads_it(audit, expected):
    assert runtime_ref(manifest(audit=audit)) == expected


def test_card_names_the_groups_of_methods_that_share_a_blob():
    # LingBot-VA's chunk layout: the two transformer steps share one blob, the two VAE encodes another.
    gib = 2**30
    audit = {"releases": {"1.2": {"version": "1.2.0", "loadable": True, "missing": {}, "caveats": []}}, "weights": {
        "ptd_bytes": 10 * gib, "blobs": {"vae_encode_first": 1 * gib, "vae_encode": 1 * gib, "video_step": 9 * gib,
                                         "action_step": 9 * gib},
        "segments": [["vae_encode_first", "vae_encode"], ["video_step", "action_step"]], "shared": True,
        "gpu_bytes_each_method_own_copy": 20 * gib, "gpu_bytes_one_copy": 10 * gib}}
    card = render_card(manifest(audit=audit), None, NoHostSettings(), "org/x")
    assert ("- The methods that read the same weights have one blob, stored once: `vae_encode_first` = "
            "`vae_encode`; `video_step` = `action_step`. With every method loaded, a runtime that gives each method "
            "its own copy holds 20.00 GiB of weights on the GPU; one copy is 10.00 GiB.") in card


def test_card_states_the_weights_on_each_runtime_from_the_audit():
    gib = 2**30
    audit = {"releases": {"1.2": {"version": "1.2.0", "loadable": True, "missing": {},
                                  "caveats": ["each method's container copies its own weights blob"]},
                          "1.3": {"version": "1.3.1", "loadable": True, "missing": {}, "caveats": []}},
             "weights": {"ptd_bytes": 10 * gib, "blobs": {"video_step": 9 * gib, "action_step": 9 * gib},
                         "segments": [["video_step", "action_step"]], "shared": True,
                         "gpu_bytes_each_method_own_copy": 18 * gib, "gpu_bytes_one_copy": 9 * gib}}
    card = render_card(manifest(audit=audit), None, NoHostSettings(), "org/x")
    assert "- `aoti_cuda_blob.ptd` is 10.00 GiB; the methods' weights blobs: `video_step` 9.00 GiB, " \
           "`action_step` 9.00 GiB." in card
    assert "- Every method's weights blob is the same bytes, stored once. With every method loaded, " \
           "a runtime that gives each method its own copy holds 18.00 GiB of weights on the GPU; one copy is " \
           "9.00 GiB." in card
    assert "- ExecuTorch 1.2: each method's container copies its own weights blob" in card
    assert "ExecuTorch 1.3:" not in card
    assert "Measured:" not in card  # nothing ran on ExecuTorch's runtime: no measured line
    assert "The weights on each runtime" not in render_card(manifest(), None, NoHostSettings(), "org/x")

    # What verification measured on ExecuTorch's own runtime (the H200 run's 19334 MiB for both methods).
    ran = manifest(audit=audit)
    ran["verification"]["runtimes"] = {"executorch": {"status": "ran", "release": "1.2", "gpu_loaded_mib": 19334.2}}
    assert ("- Measured: ExecuTorch 1.2 took 19334 MiB of GPU memory after loading every method (zoo_runner, "
            "`cudaMemGetInfo` before and after).") in render_card(ran, None, NoHostSettings(), "org/x")


def test_card_says_when_no_runtime_loads_the_artifact():
    m = manifest(audit={"1.2": {"loadable": False, "missing_symbols": ["aoti_torch_dtype_float64"]}})
    card = render_card(m, None, NoHostSettings(), "org/x")
    assert "No audited ExecuTorch release can load this artifact" in card
    assert "| 1.2 | no | `aoti_torch_dtype_float64` |" in card
    assert "the runner below fails to load it" in card


# --- rendering ------------------------------------------------------------------------------------------


IO_SPEC = IoSpec.from_json({"format": 1, "dtype": "bfloat16", "dynamic": {}, "example_sizes": {}, "methods": {
    "video_step": {"inputs": [{"name": "latent", "dtype": "bfloat16", "shape": [2, 48, 4, 8, 8], "sampler": "normal"},
                              {"name": "slots", "dtype": "int64", "shape": [32], "sampler": "randperm:64"}],
                   "outputs": ["noise_pred"]},
    "action_step": {"inputs": [{"name": "actions", "dtype": "bfloat16", "shape": [2, 16, 30], "sampler": "normal"}],
                    "outputs": ["action_pred"]},
}}, "io_spec.json")


def test_card_renders_hand_worked_manifest():
    m = manifest(overrides=["unit.dtype=bfloat16"],
                 rewrites={"video_step": [{"rewrite": "replace_complex_with_real", "changed": True, "declined": None,
                                           "counts": {"aten.view_as_complex.default": 60}, "notes": []},
                                          {"rewrite": "replace_detach_with_alias", "changed": False,
                                           "declined": "aten.foo at model.py:3", "counts": {}, "notes": []}]})
    card = render_card(m, IO_SPEC, llama_settings(), "my-lab/lingbot-va-cuda")
    meta = yaml.safe_load(card.split("---\n")[1])
    assert meta["base_model"] == "robbyant/lingbot-va" and meta["license"] == "apache-2.0"
    assert card.splitlines()[card.splitlines().index("---", 1) + 2] == "# my-lab/lingbot-va-cuda"
    # verification numbers, formatted by hand: 0.0123456 -> 1.235e-02, 0.00871 -> 8.710e-03
    assert "| video_step | 3 | static | noise_pred | 1.235e-02 | 8.710e-03 | 0.99996123 | yes |" in card
    assert "NVIDIA A100-SXM4-80GB (compute capability 8.0, sm_80)" in card
    # inputs, outputs and what stays on the host
    assert "| `video_step` | `latent`: bfloat16 [2, 48, 4, 8, 8]<br>`slots`: int64 [32] | `noise_pred` |" in card
    assert "| `action_step` | `actions`: bfloat16 [2, 16, 30] | `action_pred` |" in card
    assert "Compute dtype: `bfloat16`" in card
    assert "classifier-free guidance" in card and "the UMT5 text encoder" in card
    assert "| `eos_token_id` | `[2, 7]` |" in card and "| `vocab_size` | `256` |" in card
    assert "`format`" not in card and "`family`" not in card  # the file's own keys are no settings
    # two methods: the runner note names them
    assert "This program has 2 methods (`video_step`, `action_step`)" in card
    assert "executor_runner --model_path model.pte --data_path aoti_cuda_blob.ptd" in card
    # provenance
    assert "with overrides `unit.dtype=bfloat16`" in card
    assert "| `video_step` | replace_complex_with_real | yes | aten.view_as_complex.default x60 |" in card
    assert "| `video_step` | replace_detach_with_alias | declined: aten.foo at model.py:3 | none |" in card
    assert "lerobot not installed" in card
    assert f"| `model.pte` | 2.5 MB | `{'a' * 64}` |" in card
    assert f"| `processors/stats.safetensors` | 999 B | `{'b' * 64}` |" in card
    assert "`processors/stats.safetensors`." in card  # listed among the host's processors


# --- the policy check and the runner --------------------------------------------------------------------------


POLICY_CHECK = {
    "cpu": {"passed": False, "backend": "eager", "device": "cpu", "seed": 0, "rule": "float32", "rows": [
        {"chunk": 1, "steps": 12, "shape": [12, 1, 7], "max_abs": 2.384e-07, "rel_l2": 9.876e-08, "cosine": 1.0,
         "bound": 1e-05, "ok": True, "why": ""},
        {"chunk": 2, "steps": 16, "shape": [16, 1, 7], "max_abs": 0.5, "rel_l2": 0.25, "cosine": 0.9,
         "bound": 1e-05, "ok": False, "why": "relative L2 2.500e-01 > tolerance 1.0e-05"}]},
    "gpu": {"status": "skipped", "reason": "needs lerobot (the policies extra), which is not installed here"},
}


def test_card_shows_the_policy_check_and_the_three_lines_of_python():
    card = render_card(manifest(policy_check=POLICY_CHECK), IO_SPEC, NoHostSettings(), "my-lab/lingbot-va-cuda")
    assert "## Policy check" in card
    # numbers formatted by hand: 2.384e-07, 9.876e-08, cosine 1.0 -> 1.00000000, bound 1e-05 -> 1.0e-05
    assert "| 1 | 12 | 2.384e-07 | 9.876e-08 | 1.00000000 | 1.0e-05 | yes |" in card
    assert "| 2 | 16 | 5.000e-01 | 2.500e-01 | 0.90000000 | 1.0e-05 | no: relative L2 2.500e-01 > tolerance 1.0e-05 |" \
        in card
    assert "Result: **FAILED** (1 of 2 chunks within tolerance, float32 rule, seed 0)" in card
    assert "Skipped: needs lerobot (the policies extra), which is not installed here." in card
    lines = card.splitlines()
    start = lines.index("import zoo.runner")
    assert lines[start + 1].startswith('runner = zoo.runner.load("my-lab/lingbot-va-cuda", backend="artifact")')
    assert lines[start + 2:start + 4] == ["runner.reset()", "action = runner.select_action(batch)"]
    assert "python -m zoo prompt" in card and "python -m zoo act" in card


def test_card_of_a_run_without_a_policy_check_record_says_so():
    card = render_card(manifest(), IO_SPEC, NoHostSettings(), "my-lab/lingbot-va-cuda")
    assert card.count("Not recorded.") == 2


def test_a_llama_card_has_no_policy_to_check_and_no_runner():
    m = manifest()
    m["recipe"]["family"] = "llama"
    card = render_card(m, IO_SPEC, NoHostSettings(), "my-lab/smol")
    assert "Not applicable: a Llama-style transformer has no action loop" in card
    assert "zoo.runner.load" not in card


# --- the chunk latency the card quotes (zoo.contract.chunk_latency) ------------------------------------------------------


BENCH_RECORD = {  # one policy of benchmarks/bench_chunk.py's results, as it writes them
    "policy": "lingbot_va", "recipe": "lingbot-va", "dtype": "bfloat16", "actions_per_chunk": 16, "status": "done",
    "candidates": {
        "runner": {"chunk_ms": {"median": 412.34567, "p10": 401.0, "p90": 430.0}, "actions_per_second": 38.76543},
        "eager": {"chunk_ms": {"median": 2061.7, "p10": 2000.0, "p90": 2100.0}, "actions_per_second": 7.76},
        "compile": {"error": "RuntimeError: boom"}},
    "ratios": {"runner/eager": 0.2000019, "runner/compile": None},
}


def _measured(tmp_path, monkeypatch, entries):
    path = tmp_path / "chunk_latency.json"
    monkeypatch.setattr(chunk_latency, "MEASURED_JSON", path)
    chunk_latency.record_measured(entries)
    return path


def test_a_bench_record_becomes_an_entry_rounded_by_hand():
    entry = chunk_latency.entry_from_bench(BENCH_RECORD, gpu="NVIDIA H200", command="python benchmarks/bench_chunk.py",
                                           measured="2026-12-02", weights="seeded")
    assert entry["candidates"] == {
        "runner": {"median_ms": 412.346, "p10_ms": 401.0, "p90_ms": 430.0, "actions_per_second": 38.8},
        "eager": {"median_ms": 2061.7, "p10_ms": 2000.0, "p90_ms": 2100.0, "actions_per_second": 7.8}}
    assert entry["ratios"] == {"runner/eager": 0.2, "runner/compile": None}
    assert (entry["actions_per_chunk"], entry["dtype"], entry["gpu"]) == (16, "bfloat16", "NVIDIA H200")


def test_recording_a_recipe_keeps_the_others(tmp_path, monkeypatch):
    path = _measured(tmp_path, monkeypatch, {"fast-wam": {"gpu": "A"}, "lingbot-va": {"gpu": "B"}})
    chunk_latency.record_measured({"lingbot-va": {"gpu": "C"}})
    assert chunk_latency.read_measured(path) == {"fast-wam": {"gpu": "A"}, "lingbot-va": {"gpu": "C"}}


def test_card_quotes_the_recipes_measured_chunk_latency(tmp_path, monkeypatch):
    entry = chunk_latency.entry_from_bench(BENCH_RECORD, gpu="NVIDIA H200", command="python benchmarks/bench_chunk.py "
                                           "--policies lingbot_va", measured="2026-12-02", weights="seeded weights")
    _measured(tmp_path, monkeypatch, {"lingbot-va": entry})
    m = manifest()
    m["recipe"]["name"] = "lingbot-va"
    card = render_card(m, IO_SPEC, NoHostSettings(), "my-lab/lingbot-va-cuda")
    assert "## Speed of a whole action chunk" in card
    assert "Measured for the `lingbot-va` recipe on NVIDIA H200 (2026-12-02), bfloat16, seeded weights" in card
    # 412.34567 -> 412.346 stored -> 412.3 shown; 38.76543 actions/s -> 38.8
    assert "| `zoo.runner` on this artifact (torch's AOTI runner) | 412.3 (401.0-430.0) | 38.8 |" in card
    assert "| LeRobot's `select_action`, eager PyTorch | 2061.7 (2000.0-2100.0) | 7.8 |" in card
    assert "| LeRobot's `select_action`, DiT blocks `torch.compile`d | not measured | - |" in card
    assert "runner / eager: 0.20; runner / torch.compile: n/a." in card
    assert "`python benchmarks/bench_chunk.py --policies lingbot_va`" in card


def test_card_of_an_unmeasured_recipe_says_so_and_llama_has_no_chunk(tmp_path, monkeypatch):
    _measured(tmp_path, monkeypatch, {"fast-wam": {"gpu": "A"}})
    m = manifest()
    m["recipe"]["name"] = "lingbot-va-tiny"
    assert "Not measured for the `lingbot-va-tiny` recipe yet" in render_card(m, IO_SPEC, NoHostSettings(), "my-lab/x")
    m["recipe"]["family"] = "llama"
    assert "Speed of a whole action chunk" not in render_card(m, IO_SPEC, NoHostSettings(), "my-lab/x")
