"""The lowering's orchestration on the CPU, through the same code path as the CUDA lowering
(``zoo.export.lower.lowering.lower_to_pte``): the shared constant plan, methods lowered one after another in this
process (and, with -m e2e, side by side in worker processes, compared), assembled into one model.pte +
aoti_cuda_blob.ptd, each method's .so and weights extracted to so/, then zoo's own verification of the artifact
against eager.

The per-method lowering injected here is ExecuTorch's AOTI backend compiling for the CPU
(tests/fixtures/aoti_cpu_probe.py: AotiBackend.preprocess with the device set to the CPU), run by zoo's own
per-method lowering (edge step, kernel preflight on that edge program, backend, constant plan); the shipped
.so files run in torch's AOTI CPU runner. Only the device differs from the GPU path.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from zoo.contract.io_spec import IoSpec
from zoo.contract import artifact
from zoo.export import audit
from zoo.export.lower import lowering
from zoo.export import verify
from zoo.runtimes.aoti import run_in_delegate_order
from zoo.policies.base import InputSpec
from zoo.contract.run_folder import RunFolder

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
from aoti_cpu_probe import PROBE_LOWERING, CpuRunner  # noqa: E402

DIM = 64
METHODS = ("observe", "act", "encode")


class Trunk(nn.Module):
    """A trunk both methods read (most of the weights) and a small head of each method's own, like
    LingBot-VA's transformer blocks and its per-stream embeddings and projections."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(nn.Linear(DIM, DIM), nn.GELU(), nn.Linear(DIM, DIM), nn.GELU(),
                                    nn.Linear(DIM, DIM))
        self.observe_head = nn.Linear(DIM, 2)
        self.act_head = nn.Linear(DIM, 2)
        self.table = torch.linspace(-1.0, 1.0, DIM)  # a plain tensor attribute: a lifted constant


class Observe(nn.Module):
    def __init__(self, unit: Trunk) -> None:
        super().__init__()
        self.unit = unit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.unit.observe_head(self.unit.blocks(x) + self.unit.table)


class Act(nn.Module):
    def __init__(self, unit: Trunk) -> None:
        super().__init__()
        self.unit = unit

    def forward(self, noise: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # Inputs used in the other order than given: the delegate's order differs from the signature's.
        return self.unit.act_head(self.unit.blocks(x) * self.unit.table) + noise


class Encoder(nn.Module):
    """A method with weights of its own, from another module (LingBot-VA's VAE encode beside its transformer
    steps): it gets its own table, and the trunk's two methods still share theirs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.conv = nn.Linear(DIM, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.conv(x))


IO = {"observe": {"inputs": [{"name": "x", "dtype": "float32", "shape": [3, DIM], "sampler": "normal"}],
                  "outputs": ["obs"]},
      "act": {"inputs": [{"name": "noise", "dtype": "float32", "shape": [3, 2], "sampler": "normal"},
                         {"name": "x", "dtype": "float32", "shape": [3, DIM], "sampler": "normal"}],
              "outputs": ["action"]},
      "encode": {"inputs": [{"name": "x", "dtype": "float32", "shape": [3, DIM], "sampler": "normal"}],
                 "outputs": ["latent"]}}


def programs():
    unit = Trunk()
    modules = {"observe": Observe(unit), "act": Act(unit)}
    with torch.no_grad():
        return {"observe": torch.export.export(modules["observe"], (torch.randn(3, DIM),)),
                "act": torch.export.export(modules["act"], (torch.randn(3, 2), torch.randn(3, DIM))),
                "encode": torch.export.export(Encoder(), (torch.randn(3, DIM),))}


def run_folder(path: Path):
    """A run folder as the export step leaves it (recipe, io_spec, exported programs), and the recipe."""
    run = RunFolder(path)
    path.mkdir(parents=True)
    (path / "recipe.yaml").write_text(OmegaConf.to_yaml({
        "name": "orchestration-toy", "family": "llama", "source": {"repo_id": "none/none"},
        "unit": {"methods": list(METHODS), "dtype": "float32"},
        "lowering": {"triton_kernel_mode": "OFF"}, "verify": {"seeds": [0, 1]}}))
    run.write_io_spec(IoSpec.from_json({"format": 1, "dtype": "float32", "methods": IO}, "io_spec.json"))
    for method, program in programs().items():
        run.save_program(program, "exported", method)
    return run, run.load_recipe()


def verified(run, recipe):
    return verify.verify_artifact(run, recipe, device="cpu", runner_factory=CpuRunner, runtimes=["aoti"])


def lower_toy(root: Path, name: str, workers: int) -> dict:
    run, recipe = run_folder(root / name)
    lines = []
    result = lowering.lower_to_pte(programs(), run, recipe, workers=workers, method_lowering=PROBE_LOWERING,
                                   say=lines.append)
    return {"run": run, "recipe": recipe, "result": result, "lines": lines}


@pytest.fixture(scope="module")
def lowered(tmp_path_factory):
    """The unit lowered one method after another in this process (``workers=1``): the same plan, backend and
    assembly as worker processes run (tests/test_lowering_workers.py covers the processes), at half the time."""
    return lower_toy(tmp_path_factory.mktemp("orchestration"), "sequential", 1)


@pytest.fixture(scope="module")
def parallel(tmp_path_factory):
    """The same unit lowered with two methods at once, in two worker processes."""
    return lower_toy(tmp_path_factory.mktemp("orchestration-parallel"), "parallel", 2)


@pytest.mark.e2e  # a second CPU lowering of the unit, in worker processes (~1 minute on 2 cores)
def test_parallel_and_sequential_lowerings_verify_alike_against_eager(parallel, lowered):
    par, seq = parallel, lowered
    lowered = {"parallel": par, "sequential": seq}
    assert par["result"].workers == {"count": 2, "why": "asked for", "in_process": False, "reused": []}
    assert seq["result"].workers["in_process"] is True
    assert any(line.startswith("lowering observe: worker ") for line in par["lines"])  # a worker process each
    assert "save_programs" in par["result"].summary()["stage_seconds"]  # what the workers read
    got = {k: verified(v["run"], v["recipe"]) for k, v in lowered.items()}
    assert got["parallel"].ok and got["sequential"].ok
    rows = {k: [(r.method, r.seed, r.output, r.max_abs, r.rel_l2, r.cosine) for r in v.rows] for k, v in got.items()}
    assert rows["parallel"] == rows["sequential"]
    assert seq["run"].ptd.read_bytes() == par["run"].ptd.read_bytes()  # the same .ptd, whichever way
    assert sorted({(m, s) for m, s, *_ in rows["parallel"]}) == sorted((m, s) for m in METHODS for s in (0, 1))
    # Against eager directly as well, with the inputs verification draws (the .so takes act's inputs permuted).
    eager = {m: p.module() for m, p in programs().items()}
    for method in METHODS:
        order = par["run"].io_order(method)
        specs = [InputSpec(**d) for d in IO[method]["inputs"]]
        inputs = verify.draw_inputs(specs, {}, 0, method)
        files = artifact.reusable_method_files(par["run"].pte, par["run"].ptd, par["run"].so_dir, [method])
        # The lowering's result names those same files and orders (scripts and GPU tests run the .so from it).
        art = par["result"].methods[method]
        assert art.files(par["run"].path) == (files[method]["so"], files[method]["weights"])
        assert art.delegate_order == {k: order[k] for k in ("input_order", "output_order")}
        got_out = run_in_delegate_order(CpuRunner(method, files[method]["so"], files[method]["weights"],
                                                         "cpu"), order, inputs)
        torch.testing.assert_close(got_out[0], eager[method](*inputs), rtol=1e-5, atol=1e-5)
    assert par["run"].io_order("act")["input_order"] == [1, 0]


def test_the_artifact_verifies_against_eager(lowered):
    # What the runtime needs, read from the .so files: no shim of zoo's own build.
    assert json.loads(lowered["run"].runtime_file.read_text())["features"] == []
    got = verified(lowered["run"], lowered["recipe"])
    assert got.ok
    assert sorted({(r.method, r.seed) for r in got.rows}) == sorted((m, s) for m in METHODS for s in (0, 1))


def test_the_ptd_holds_the_shared_weights_once(lowered):
    result = lowered["result"]
    weights = result.weights
    assert weights["plan"]["applied"] is True and weights["stored_once"] is True
    # Two groups: the trunk's methods share one table, the encoder keeps its own.
    assert [g["methods"] for g in weights["plan"]["groups"]] == [["observe", "act"], ["encode"]]
    assert [g["applied"] for g in weights["plan"]["groups"]] == [True, False]
    assert weights["segments"] == [["observe_weights_blob", "act_weights_blob"], ["encode_weights_blob"]]
    # Independently of the plan's own count: the parameter bytes the methods use, from the eager modules.
    unit, encoder = Trunk(), Encoder()
    trunk_bytes = sum(p.numel() * p.element_size() for p in unit.parameters()) + unit.table.numel() * 4
    used = trunk_bytes + sum(p.numel() * p.element_size() for p in encoder.parameters())
    assert result.ptd_bytes <= 1.05 * used
    assert weights["shared_bytes"] == weights["entries"]["act_weights_blob"] > 0.9 * trunk_bytes
    assert "observe = act (one segment)" in result.table()


def test_the_shared_blob_is_extracted_once_and_reused_while_unchanged(lowered, tmp_path):
    run = lowered["run"]
    observe, act = run.weights_file("observe"), run.weights_file("act")
    assert os.stat(observe).st_ino == os.stat(act).st_ino  # one file, two names
    assert lowered["result"].methods["act"].shares_weights_with == "observe"
    reused = artifact.reusable_method_files(run.pte, run.ptd, run.so_dir, list(METHODS))
    assert reused is not None and reused["act"]["weights"] == act and reused["observe"]["so"] == run.so_file("observe")
    # A copied run folder (other files), a .ptd written over, an edited .so: extracted again, never reused.
    copy = RunFolder(tmp_path / "copy")
    shutil.copytree(run.path, copy.path)
    assert artifact.reusable_method_files(copy.pte, copy.ptd, copy.so_dir, list(METHODS)) is None
    same = tmp_path / "same.ptd"
    shutil.copyfile(run.ptd, same)
    shutil.copyfile(same, run.ptd)  # the same bytes, but another write
    assert artifact.reusable_method_files(run.pte, run.ptd, run.so_dir, list(METHODS)) is None
    files = artifact.extract_method_files(run.pte, run.ptd, run.so_dir)
    assert artifact.reusable_method_files(run.pte, run.ptd, run.so_dir, list(METHODS)) is not None
    with open(files["observe"]["so"], "r+b") as fh:
        fh.seek(100)
        fh.write(b"\0")
    assert artifact.reusable_method_files(run.pte, run.ptd, run.so_dir, list(METHODS)) is None


def test_the_lowering_record_has_per_method_times_the_plan_and_the_preflight(lowered):
    summary = lowered["result"].summary()
    for method in METHODS:
        record = summary["methods"][method]
        assert record["seconds"] > 0 and {"edge", "preflight", "backend", "to_executorch"} <= set(record["stage_seconds"])
        # The trunk's methods follow their group's table; the encoder, alone in its group, has none.
        assert record["constants"].get("plan_order") is (None if method == "encode" else True)
    assert summary["methods"]["act"]["constants"]["added"] >= 2  # observe's head, which act's graph never reads
    assert summary["preflight"]["ok"] is True and summary["preflight"]["nodes"] > 0
    stages = summary["stage_seconds"]
    # In this process no program is saved for a worker to read (the e2e case's workers add "save_programs").
    assert {"plan", "methods", "assemble", "extract"} <= set(stages) and "save_programs" not in stages
    # The stages are disjoint parts of the lowering's wall time.
    assert sum(stages[k] for k in ("plan", "methods", "assemble", "extract")) <= summary["seconds"]
    assert not list(lowered["run"].path.glob(".lowering.tmp-*"))  # parts and saved programs gone
    # The method's own output names, not the ones the lowered program gives its delegate's outputs.
    assert json.loads(lowered["run"].io_order_file("act").read_text())["output_names"] == list(
        programs()["act"].graph_signature.user_outputs)


def test_the_audit_states_what_each_runtime_does_with_the_weights(lowered):
    run = lowered["run"]
    facts = audit.weights_facts(run.path)
    blob, own = facts["blobs"]["act"], facts["blobs"]["encode"]
    assert facts["shared"] is True and facts["blobs"] == {"observe": blob, "act": blob, "encode": own}
    assert facts["segments"] == [["observe", "act"], ["encode"]]
    assert facts["gpu_bytes_each_method_own_copy"] == 2 * blob + own and facts["gpu_bytes_one_copy"] == blob + own
    assert facts["ptd_bytes"] == run.ptd.stat().st_size
