"""Publishing a verified run folder: manifest, staged folder, model card, commit operations, refusals.

The run folder is built here the way the pipeline builds it: a recipe loaded by the real recipe loader, the
I/O spec from a real ``MethodSpec``, rewrite statistics from a real ``RewriteResult``, and a verification
record made by ``zoo.core.numerics.compare``/``judge`` on the outputs of a real ``torch.export`` program against a
float64 eager reference, written by the real ``RunReport``. Only the network call is replaced: a recording
object stands in for ``HfApi`` at its method boundary.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import shutil
from collections import Counter
from importlib import metadata
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from huggingface_hub import constants
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import hf_raise_for_status
from safetensors.torch import save_file

from zoo.cli import publish
from zoo.export.publish import upload as publishing
from zoo.export.audit import AuditResult, MethodAudit
from zoo.core.errors import PublishRefused
from zoo.export.pull import Checkpoint
from zoo.export.lower.outputs import LoweringResult
from zoo.export.publish.manifest import read_manifest, write_manifest
from zoo.core.numerics import compare, judge
from zoo.export.pipeline import _as_record, io_spec
from zoo.contract.host_settings import LlamaHostSettings
from zoo.policies.base import ExportUnit, InputSpec, MethodSpec
from zoo.contract.recipes import load_recipe
from zoo.core.report import RunReport
from zoo.rewrites import RewriteResult
from zoo.contract.run_folder import RunFolder
from zoo.contract.releases import load_runtimes

SOURCE_REPO = "zoo-test/rope-mini"
SOURCE_COMMIT = "0123456789abcdef0123456789abcdef01234567"
OVERRIDES = ["verify.seeds=[0,1]"]
# What the compiled .so of a float16 method asks its runtime for; float16 first ships in ExecuTorch 1.4.
SO_SYMBOLS = ["aoti_torch_create_tensor_from_blob_v2", "aoti_torch_delete_tensor_object",
              "aoti_torch_dtype_float16", "aoti_torch_empty_strided", "aoti_torch_get_data_ptr"]
GPU = {"name": "NVIDIA H200", "capability": "90", "torch": "2.11.0+cu130", "cuda": "13.0"}  # cuda_device_info()
HOST_SETTINGS = LlamaHostSettings(vocab_size=64, max_seq_len=16, logits_dtype="float32", bos_token_id=None,
                                  eos_token_id=3, rope_theta=10000.0)
HOST_ROWS = ["| `vocab_size` | `64` |", "| `max_seq_len` | `16` |", "| `bos_token_id` | `null` |",
             "| `eos_token_id` | `3` |", "| `rope_theta` | `10000.0` |"]  # the card's table, by hand
ARTIFACT = {"model.pte", "aoti_cuda_blob.ptd", "io_spec.json", "host_settings.json", "so/forward.io.json",
            "processors/policy_preprocessor.json", "processors/policy_preprocessor_step_0_normalizer.safetensors"}


class RealPairRope(torch.nn.Module):
    """A projection followed by a rotary embedding in real pairs over a dynamic sequence length."""

    def __init__(self, dim: int = 8):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.proj = torch.nn.Linear(dim, dim)
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(dim, dim, generator=g) / math.sqrt(dim))
            self.proj.bias.copy_(torch.randn(dim, generator=g))
        self.register_buffer("inv_freq", 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        pos = torch.arange(x.shape[1], dtype=h.dtype, device=h.device)
        angle = pos[:, None] * self.inv_freq.to(h.dtype)[None, :]
        cos, sin = angle.cos(), angle.sin()
        a, b = h[..., 0::2], h[..., 1::2]
        return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


METHOD = MethodSpec("forward", RealPairRope(), [InputSpec("x", "float32", [1, "seq", 8])], ["y"])


@pytest.fixture(scope="module")
def exported():
    seq = torch.export.Dim("seq", min=2, max=16)
    example = METHOD.example_inputs({"seq": 6})
    program = torch.export.export(METHOD.module, example, dynamic_shapes=METHOD.dynamic_shapes({"seq": seq}))
    reference = copy.deepcopy(METHOD.module).double()
    return program, reference


def verification(exported, degrade=None) -> dict:
    """The record the verify step writes: each output of the exported program against float64 eager, judged
    at the recipe's float32 tolerance. ``degrade`` stands in for an artifact that lost precision."""
    from zoo.export.verify import Row, VerificationResult

    program, reference = exported
    with torch.no_grad():
        rows = [Row(runtime="aoti", tolerance=1e-5, **r) for r in _rows(program, reference, degrade)]
    # The record is what zoo.export.verify's own result writes into report.json, not a hand-made dict.
    return VerificationResult(rows=rows, device="cuda", gpu=dict(GPU), rotary_pairs="float32", unit_dtype="float32",
                              seconds=0.1).summary()


def _rows(program, reference, degrade) -> list:
    rows = []
    for seed in (0, 1):
        for seq in (2, 9, 16):
            (x,) = METHOD.example_inputs({"seq": seq}, seed=seed)
            got = program.module()(x)
            if degrade is not None:
                got = degrade(got)
            ref = reference(x.double())
            c = judge(compare("y", got, ref), rel_l2_max=1e-5)
            fields = {k: v for k, v in c.as_dict().items() if k != "name"}
            rows.append({"method": "forward", "seed": seed, "sizes": {"seq": seq}, "output": c.name, **fields})
    return rows


def build_run(root: Path, exported, verification_record) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    recipe_file = root / "rope-mini.yaml"
    recipe_file.write_text(yaml.safe_dump({
        "description": "A projection with a real-pair rope, for publishing tests.",
        "family": "llama", "source": {"repo_id": SOURCE_REPO, "revision": "main"},
        "unit": {"methods": ["forward"]}, "dynamic": {"seq": {"min": 2, "max": 16}},
        "rewrites": ["replace_complex_with_real"], "verify": {"sizes": {"seq": [9]}},
    }))
    recipe = load_recipe(str(recipe_file), OVERRIDES)
    # the pulled snapshot, in huggingface_hub's cache layout, with the source's model card
    cache = root / "hub"
    snapshot = cache / "models--zoo-test--rope-mini" / "snapshots" / SOURCE_COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "README.md").write_text("---\nlicense: apache-2.0\nlibrary_name: lerobot\n---\n# rope-mini\n")
    source = Checkpoint(path=snapshot, repo_id=SOURCE_REPO, revision="main", commit=SOURCE_COMMIT,
                        cache_dir=str(cache))

    run = root / "run"
    run.mkdir()
    folder = RunFolder(run)
    folder.write_recipe(recipe)
    folder.write_source(source.as_dict())
    folder.write_io_spec(io_spec(ExportUnit("llama", {"forward": METHOD}), recipe))
    folder.write_host_settings(HOST_SETTINGS)
    (run / "processors").mkdir()
    (run / "processors" / "policy_preprocessor.json").write_text(json.dumps({"name": "policy_preprocessor"}))
    save_file({"mean": torch.arange(4.0), "std": torch.ones(4)},
              str(run / "processors" / "policy_preprocessor_step_0_normalizer.safetensors"))
    g = torch.Generator().manual_seed(7)  # publishing never parses the artifact: any bytes will do
    for name, size in (("model.pte", 3000), ("aoti_cuda_blob.ptd", 5000)):
        (run / name).write_bytes(torch.randint(0, 256, (size,), generator=g, dtype=torch.uint8).numpy().tobytes())

    # The delegate I/O order lowering writes; published, so the policy runner can feed a downloaded artifact.
    folder.write_io_order("forward", {"input_order": [0], "output_order": [0]})
    (run / "so" / "forward.so").write_bytes(b"not published: the .so ships inside model.pte")

    program, _ = exported
    report = RunReport(run, recipe.to_dict())
    report.record("overrides", OVERRIDES)
    counts = Counter({"aten.view_as_complex.default": 2, "aten.mul.Tensor": 2})
    rewrite = RewriteResult.rewritten("replace_complex_with_real", program, counts)
    report.record("rewrites", {"forward": [rewrite.summary()]})
    report.record("lowering", _as_record(LoweringResult(
        out_dir=str(run), pte="model.pte", ptd="aoti_cuda_blob.ptd", pte_bytes=3000, ptd_bytes=5000, seconds=41.5,
        compile_seconds=40.0, methods={}, options={}, gpu=dict(GPU))))
    runtimes = load_runtimes()
    missing = {name: sorted(set(SO_SYMBOLS) - release.symbols) for name, release in runtimes.items()}
    report.record("audit", _as_record(AuditResult(
        path=str(run), methods=[MethodAudit("forward", 4096, SO_SYMBOLS, ["float16"], missing)],
        releases={name: release.version for name, release in runtimes.items()})))
    if verification_record is not None:
        report.record("verification", verification_record)
    folder.write_report(report)
    write_manifest(folder, folder.read_report())
    return run


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, exported):
    return build_run(tmp_path_factory.mktemp("verified"), exported, verification(exported))


@pytest.fixture
def run(base_run, tmp_path):
    """A private copy of the verified run folder, free to damage."""
    dst = tmp_path / "run"
    shutil.copytree(base_run, dst)
    return dst


@pytest.fixture
def no_token(monkeypatch, tmp_path):
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token-here"))


@pytest.fixture
def token(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_test_token_0123456789")
    return "hf_test_token_0123456789"


class RecordingApi:
    """Stands in for HfApi at its method boundary: records each call, optionally answers with an error."""

    def __init__(self, fail=None):
        self.calls = []
        self.fail = fail or {}

    def _call(self, name, kwargs):
        self.calls.append((name, kwargs))
        if name in self.fail:
            raise self.fail[name]
        return type("CommitInfo", (), {"commit_url": "https://huggingface.co/org/name/commit/abc"})()

    def create_repo(self, **kwargs):
        return self._call("create_repo", kwargs)

    def create_branch(self, **kwargs):
        return self._call("create_branch", kwargs)

    def create_commit(self, **kwargs):
        return self._call("create_commit", kwargs)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


# --- the manifest -----------------------------------------------------------------------------------------


def test_manifest_records_hashes_sources_versions_and_report_tables(base_run):
    manifest = json.loads((base_run / "manifest.json").read_text())
    report = json.loads((base_run / "report.json").read_text())

    assert set(manifest["files"]) == ARTIFACT
    for rel, entry in manifest["files"].items():
        data = (base_run / rel).read_bytes()
        assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}, rel
    assert manifest["source"] == {"repo_id": SOURCE_REPO, "revision": "main", "commit": SOURCE_COMMIT,
                                  "fabricated": False}
    assert str(base_run.parent) not in json.dumps(manifest)  # no path of the exporting machine is published
    assert manifest["license"] == {"license": "apache-2.0", "from": "the source checkpoint's model card"}
    assert manifest["recipe"]["name"] == "rope-mini" and manifest["recipe"]["verify"]["seeds"] == [0, 1]
    assert manifest["overrides"] == OVERRIDES
    import executorch.version

    assert manifest["versions"]["torch"] == torch.__version__
    assert manifest["versions"]["cuda"] == torch.version.cuda
    assert manifest["versions"]["executorch"].split("+")[0] == executorch.version.__version__.split("+")[0]
    try:
        lerobot = metadata.version("lerobot")
    except metadata.PackageNotFoundError:
        lerobot = None
    assert manifest["versions"]["lerobot"] == lerobot
    assert manifest["gpu"]["built_for"] == {"name": "NVIDIA H200", "compute_capability": "9.0"}
    assert manifest["gpu"]["verified_on"] == {"name": "NVIDIA H200", "compute_capability": "9.0"}
    for section in ("verification", "rewrites"):
        assert manifest[section] == report[section], section
    assert manifest["audit"] == {k: v for k, v in report["audit"].items() if k != "path"}
    assert manifest["rewrites"]["forward"][0]["counts"] == {"aten.mul.Tensor": 2, "aten.view_as_complex.default": 2}


def test_verification_record_holds_metrics_of_the_real_comparison(base_run, exported):
    """The numbers in report.json (and so in the manifest) are the exported program's distance from float64
    eager, recomputed here from their definitions."""
    program, reference = exported
    rows = read_manifest(base_run)["verification"]["rows"]
    assert len(rows) == 6 and all(r["ok"] for r in rows)
    with torch.no_grad():
        check_rows(rows, program, reference)


def check_rows(rows, program, reference) -> None:
    for r in rows:
        (x,) = METHOD.example_inputs(r["sizes"], seed=r["seed"])
        got = program.module()(x).double()
        ref = reference(x.double())
        assert r["max_abs"] == pytest.approx(float((got - ref).abs().max()), rel=1e-12, abs=1e-300)
        assert r["rel_l2"] == pytest.approx(float((got - ref).norm() / ref.norm()), rel=1e-12, abs=1e-300)
        assert r["cosine"] == pytest.approx(float((got * ref).sum() / (got.norm() * ref.norm())), rel=1e-12)
        assert r["shape"] == [1, r["sizes"]["seq"], 8]
        assert 0 < r["rel_l2"] < 1e-5  # float32 against float64: rounding-level, never exactly zero


# --- staging and the card ---------------------------------------------------------------------------------


def test_dry_run_stages_the_exact_folder_without_token_or_network(run, no_token, capsys):
    api = RecordingApi()
    plan = publishing.publish_run(run, "my-lab/rope-mini-cuda", dry_run=True, api=api)

    assert api.calls == []
    staged = run / "publish"
    assert plan.staged_dir == staged
    files = tree(staged)
    assert set(files) == ARTIFACT | {"manifest.json", "README.md"}
    for rel in ARTIFACT | {"manifest.json"}:
        assert files[rel] == (run / rel).read_bytes(), rel
    assert [(f.path_in_repo, f.size, f.sha256) for f in plan.files] == \
        [(rel, len(files[rel]), hashlib.sha256(files[rel]).hexdigest()) for rel in sorted(files)]
    assert plan.total_bytes == sum(len(b) for b in files.values())

    assert publish.main([str(run), "--repo-id", "my-lab/rope-mini-cuda", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would commit to https://huggingface.co/my-lab/rope-mini-cuda" in out
    for rel, data in files.items():
        line = next(ln for ln in out.splitlines() if f" {rel} " in ln)
        assert f" {len(data)} " in line and hashlib.sha256(data).hexdigest() in line


def test_model_card_states_metadata_audit_verification_and_how_to_run(run, no_token):
    publishing.publish_run(run, "my-lab/rope-mini-cuda", dry_run=True)
    card = (run / "publish" / "README.md").read_text()
    report = json.loads((run / "report.json").read_text())

    head, body = card.split("---\n", 2)[1:]
    meta = yaml.safe_load(head)
    assert meta["license"] == "apache-2.0"
    assert meta["base_model"] == SOURCE_REPO
    assert {"robotics", "lerobot", "executorch", "cuda"} <= set(meta["tags"])
    assert meta["library_name"] == "executorch" and meta["pipeline_tag"] == "robotics"

    assert "executor_runner --model_path model.pte --data_path aoti_cuda_blob.ptd" in body
    assert "-DEXECUTORCH_BUILD_CUDA=ON" in body
    # exported with 1.2.0, which the audit says cannot load it: the card builds the first release that can
    assert "git clone --branch v1.4.1 " in body
    assert "this builds ExecuTorch 1.4.1, which the audit above says loads the artifact" in body
    assert "hf download my-lab/rope-mini-cuda" in body
    # audit: one row per release of zoo/data/runtimes.json, from report.json
    assert "| 1.2 (1.2.0) | no | `aoti_torch_dtype_float16` |" in body
    assert "| 1.3 (1.3.1) | no | `aoti_torch_dtype_float16` |" in body
    assert "| 1.4 (1.4.1) | yes | none |" in body
    assert "Loadable by: ExecuTorch 1.4, 1.5." in body
    # verification: every row of report.json with its numbers
    assert "**passed** (6 of 6 comparisons within tolerance)" in body
    for r in report["verification"]["rows"]:
        row = (f"| forward | {r['seed']} | seq={r['sizes']['seq']} | y | {r['max_abs']:.3e} | {r['rel_l2']:.3e} | "
               f"{r['cosine']:.8f} | yes |")
        assert row in body
    assert "NVIDIA H200 (compute capability 9.0, sm_90)" in body
    # what it computes and what stays on the host
    assert "| `forward` | `x`: float32 [1, seq, 8] | `y` |" in body
    assert "`seq` in [2, 16]" in body
    for row in HOST_ROWS:
        assert row in body
    assert "`processors/policy_preprocessor.json`" in body
    # provenance and hashes
    assert SOURCE_COMMIT in body and "`verify.seeds=[0,1]`" in body
    assert "aten.view_as_complex.default x2" in body
    for rel in ARTIFACT:
        assert f"| `{rel}` |" in body and sha(run / rel) in body


# --- the commit handed to huggingface_hub ----------------------------------------------------------------


def test_commit_operations_are_exactly_the_staged_files(run, token):
    api = RecordingApi()
    plan = publishing.publish_run(run, "my-lab/rope-mini-cuda", revision="cuda-sm90", private=True, api=api)

    assert [name for name, _ in api.calls] == ["create_repo", "create_branch", "create_commit"]
    repo_call, branch_call, commit_call = (kw for _, kw in api.calls)
    assert repo_call == {"repo_id": "my-lab/rope-mini-cuda", "token": token, "private": True,
                         "repo_type": "model", "exist_ok": True}
    assert branch_call["branch"] == "cuda-sm90" and branch_call["exist_ok"] is True
    assert commit_call["revision"] == "cuda-sm90" and commit_call["token"] == token
    assert commit_call["repo_id"] == "my-lab/rope-mini-cuda"
    assert SOURCE_COMMIT[:12] in commit_call["commit_message"]
    sent = {op.path_in_repo: Path(op.path_or_fileobj).read_bytes() for op in commit_call["operations"]}
    assert len(sent) == len(commit_call["operations"])
    assert sent == tree(run / "publish")
    for rel in ARTIFACT:
        assert sent[rel] == (run / rel).read_bytes()
    assert plan.pushed and plan.commit_url == "https://huggingface.co/org/name/commit/abc"


def test_main_branch_needs_no_branch_creation(run, token):
    api = RecordingApi()
    publishing.publish_run(run, "my-lab/rope-mini-cuda", api=api)
    assert [name for name, _ in api.calls] == ["create_repo", "create_commit"]
    assert api.calls[0][1]["private"] is False


# --- refusals ---------------------------------------------------------------------------------------------


def refusal(run, capsys, *extra) -> str:
    code = publish.main([str(run), "--repo-id", "my-lab/rope-mini-cuda", *extra])
    err = capsys.readouterr().err
    assert code == PublishRefused.exit_code != 0 and err.startswith("error: ")
    return err


def test_refuses_a_run_whose_verification_failed(tmp_path, exported, capsys, token):
    # the "artifact" keeps bfloat16 precision: relative L2 about 1e-3, far above float32's 1e-5
    record = verification(exported, degrade=lambda y: y.to(torch.bfloat16).to(torch.float32))
    assert not record["passed"]
    run = build_run(tmp_path / "failed", exported, record)
    api = RecordingApi()
    with pytest.raises(PublishRefused, match=r"verification failed \(6 of 6 comparisons out of tolerance\)"):
        publishing.publish_run(run, "my-lab/rope-mini-cuda", api=api)
    assert api.calls == [] and not (run / "publish").exists()
    err = refusal(run, capsys)
    assert "forward seed 0 y: relative L2" in err and "> tolerance 1.0e-05" in err


def test_refuses_a_run_never_verified(tmp_path, exported, capsys, token):
    run = build_run(tmp_path / "unverified", exported, None)
    assert "verification never ran" in refusal(run, capsys)


def test_dry_run_of_an_unverified_run_previews_its_card_marked_unverified(tmp_path, exported, capsys, no_token):
    run = build_run(tmp_path / "unverified", exported, None)
    plan = publishing.publish_run(run, "my-lab/rope-mini-cuda", dry_run=True)
    card = (run / "publish" / "README.md").read_text()
    assert "**Unverified preview.**" in card and "verified against eager PyTorch" not in card
    assert [f.path_in_repo for f in plan.files] == ["README.md"]  # no artifact file is staged
    assert "not verified" in capsys.readouterr().err
    with pytest.raises(PublishRefused, match="verification never ran"):  # the push itself is still refused
        publishing.publish_run(run, "my-lab/rope-mini-cuda", api=RecordingApi())


def test_refuses_a_stale_manifest(run, capsys, token):
    report = RunFolder(run).read_report()
    report.data["verification"]["rows"][0]["max_abs"] *= 2
    RunFolder(run).write_report(report)
    assert "manifest.json is stale: its verification differs" in refusal(run, capsys)


@pytest.mark.parametrize("damage, expected", [
    (lambda run: (run / "aoti_cuda_blob.ptd").write_bytes(b"\x00" + (run / "aoti_cuda_blob.ptd").read_bytes()[1:]),
     "aoti_cuda_blob.ptd: sha256 "),
    (lambda run: (run / "processors" / "policy_preprocessor.json").unlink(),
     "processors/policy_preprocessor.json: listed in manifest.json but missing"),
    (lambda run: (run / "processors" / "extra.json").write_text("{}"),
     "processors/extra.json: present but not in manifest.json"),
])
def test_refuses_files_that_differ_from_the_manifest(run, capsys, token, damage, expected):
    listed = read_manifest(run)["files"]["aoti_cuda_blob.ptd"]["sha256"]
    damage(run)
    err = refusal(run, capsys)
    assert expected in err
    if "sha256" in expected:
        assert f"{sha(run / 'aoti_cuda_blob.ptd')} differs from manifest.json's {listed}" in err
    assert not (run / "publish").exists()


def test_refuses_without_a_token_before_any_network_call(run, capsys, no_token):
    api = RecordingApi()
    with pytest.raises(PublishRefused, match="no Hugging Face token") as info:
        publishing.publish_run(run, "my-lab/rope-mini-cuda", api=api)
    assert "hf auth login" in str(info.value) and "HF_TOKEN" in str(info.value)
    assert api.calls == [] and not (run / "publish").exists()
    assert "no Hugging Face token" in refusal(run, capsys)


def hub_error(status: int, message: str, url: str) -> HfHubHTTPError:
    """An error exactly as huggingface_hub raises it for a Hub response with this status and message."""
    response = httpx.Response(status, request=httpx.Request("POST", url), headers={"X-Error-Message": message},
                              json={"error": message})
    with pytest.raises(HfHubHTTPError) as info:
        hf_raise_for_status(response)
    return info.value


@pytest.mark.parametrize("status, step, message, hint", [
    (403, "create_repo", 'You don\'t have the rights to create a model under the namespace "my-lab"',
     "cannot write to 'my-lab'"),
    (401, "create_repo", "Invalid credentials in Authorization header", "hf auth login"),
    (404, "create_commit", "Repository not found", "check --repo-id"),
])
def test_refuses_a_repo_the_user_cannot_write_to(run, token, status, step, message, hint):
    api = RecordingApi(fail={step: hub_error(status, message, "https://huggingface.co/api/repos/create")})
    with pytest.raises(PublishRefused) as info:
        publishing.publish_run(run, "my-lab/rope-mini-cuda", api=api)
    text = str(info.value)
    assert f"(HTTP {status})" in text and message in text and hint in text
    assert api.calls[-1][0] == step


def test_refuses_a_malformed_repo_id(run, token):
    with pytest.raises(PublishRefused, match="bad repo id"):
        publishing.publish_run(run, "not a repo id", api=RecordingApi())
