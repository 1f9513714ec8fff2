"""Lowering on a CPU: ExecuTorch's real partitioning, serialisation and named-data layout, with only
AOTInductor's GPU compile replaced (tests/fixtures/fake_cuda.py). Checks the multi-method .pte, the .so and
weights blob taken back out of the written bytes, the delegate I/O order, atomic writes, the settings."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import zoo.export.lower.lowering as lowering
from zoo.export.lower import compile_settings, constant_plan
from zoo.contract import artifact
from zoo.export import audit
from zoo.core.errors import KernelPreflightRefused, LoweringError, NoGpuError
from zoo.contract.recipes import Lowering, Recipe, Source, Unit
from zoo.contract.run_folder import RunFolder

from support.modules import ToyPermuted

_spec = importlib.util.spec_from_file_location("zoo_test_fake_cuda",
                                               Path(__file__).resolve().parent / "fixtures" / "fake_cuda.py")
fake_cuda = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake_cuda)


class Pool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("pool", torch.zeros(16, 4))

    def forward(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        self.pool.index_copy_(0, slots, self.proj(x))
        return self.pool.sum(0)


class PassThrough(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor):
        return x * 2, y


def recipe(methods) -> Recipe:
    return Recipe(name="lowering-test", family="llama", source=Source(repo_id="none/none"),
                  unit=Unit(methods=list(methods)), lowering=Lowering(triton_kernel_mode="OFF", max_mm_configs=2))


def programs():
    with torch.no_grad():
        return {"permuted": torch.export.export(ToyPermuted(), (torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 4))),
                "pool": torch.export.export(Pool(), (torch.randn(2, 4), torch.tensor([3, 9])))}


@pytest.fixture(scope="module")
def lowered(tmp_path_factory):
    out = tmp_path_factory.mktemp("lowered")
    fake = fake_cuda.FakeCudaCompile({"pool": (fake_cuda.FIXTURE_SO / "float64.so").read_bytes()})
    progs = programs()
    before = {name: str(ep.graph) for name, ep in progs.items()}
    with pytest.MonkeyPatch.context() as mp:
        fake.install(mp)
        result = lowering.lower_to_pte(progs, out, recipe(progs))
    return {"out": out, "fake": fake, "result": result, "programs": progs, "before": before}


def test_one_pte_with_both_methods_and_one_ptd(lowered):
    out, result = lowered["out"], lowered["result"]
    assert (out / "model.pte").is_file() and (out / "aoti_cuda_blob.ptd").is_file()
    methods, named = artifact.read_pte(out / "model.pte")
    assert sorted(methods) == ["permuted", "pool"]
    assert {m.backend for m in methods.values()} == {"CudaBackend"}
    assert sorted(named) == ["permuted_so_blob", "pool_so_blob"]  # the .so files live inside the .pte
    assert sorted(e.key for e in artifact.read_ptd_entries(out / "aoti_cuda_blob.ptd")) == ["permuted_weights_blob",
                                                                          "pool_weights_blob"]
    assert result.pte_bytes == (out / "model.pte").stat().st_size
    assert result.ptd_bytes == (out / "aoti_cuda_blob.ptd").stat().st_size
    assert not list(out.glob(".*tmp*"))


def test_each_method_compiled_with_its_name_and_the_recipe_triton_mode(lowered):
    specs = lowered["fake"].compile_specs
    assert specs["permuted"] == {"method_name": b"permuted", "triton_kernel_mode": b"OFF"}
    assert specs["pool"] == {"method_name": b"pool", "triton_kernel_mode": b"OFF"}


def test_so_and_weights_come_back_out_of_the_written_bytes(lowered):
    out, fake = lowered["out"], lowered["fake"]
    for method in ("permuted", "pool"):
        assert (out / "so" / f"{method}.so").read_bytes() == fake.so_bytes(method)
        assert (out / "so" / f"{method}.weights.blob").read_bytes() == fake_cuda.weights_bytes(method)
    art = lowered["result"].methods["pool"]
    assert art.so_bytes == len(fake.so_bytes("pool"))
    assert art.weights_bytes == len(fake_cuda.weights_bytes("pool"))


def test_delegate_io_order_is_recorded_beside_the_so(lowered):
    out = lowered["out"]
    permuted = json.loads((out / "so" / "permuted.io.json").read_text())
    assert permuted["input_names"] == ["a", "b", "c"]
    assert permuted["input_order"] == [2, 1, 0]  # c (into the linear) first, then b, then a
    assert permuted["output_order"] == [0]
    pool = RunFolder(out).io_order("pool")
    assert pool["input_order"] == [0, 1] and pool["output_order"] == [0]
    # The pool buffer lives inside the pool method's .so: 16 x 4 float32, stored once per method.
    assert pool["mutable_buffers"] == {"pool": 16 * 4 * 4}
    assert lowered["result"].methods["pool"].mutable_buffers == {"pool": 256}


def _planned_io(pte: Path):
    """Per method, whether each graph input and output has planned memory, read with executorch's own
    deserializer (the flatbuffer's allocation_info)."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    program = deserialize_pte_binary(pte.read_bytes()).program
    return {plan.name: ([plan.values[i].val.allocation_info is not None for i in plan.inputs],
                        [plan.values[i].val.allocation_info is not None for i in plan.outputs])
            for plan in program.execution_plan}


def test_graph_inputs_and_outputs_get_no_planned_memory(lowered, tmp_path):
    # A GPU pointer can only be bound to an input the method does not plan (Method::set_input memcpy's into a
    # planned one), and the CUDA backend's outputs can only stay on the GPU in unplanned outputs.
    out = lowered["out"]
    assert _planned_io(out / "model.pte") == {"permuted": ([False] * 3, [False]), "pool": ([False] * 2, [False])}
    need = json.loads((out / "runtime.json").read_text())
    assert need["device_io"] is True and need["release"] == "1.2" and need["lowered_with"].startswith("1.2.")
    assert need["memory_planned"]["permuted"] == {"inputs": [False] * 3, "outputs": [False]}
    assert lowered["result"].runtime == need and "state stays on the GPU" in lowered["result"].table()
    # ExecuTorch's default, on the same program: every input and output planned (what the check tells apart)
    from executorch.exir import to_edge

    default = tmp_path / "default.pte"
    default.write_bytes(to_edge({"permuted": programs()["permuted"]}).to_executorch().buffer)
    assert _planned_io(default) == {"permuted": ([True] * 3, [True])}


def test_lowering_leaves_the_given_programs_alone(lowered):
    assert {name: str(ep.graph) for name, ep in lowered["programs"].items()} == lowered["before"]


def test_audit_reads_the_written_pte_per_method(lowered):
    result = audit.audit_artifact(lowered["out"] / "model.pte")
    by_method = {m.method: m for m in result.methods}
    assert by_method["permuted"].loadable("1.2")
    assert by_method["pool"].missing["1.2"] == ["aoti_torch_dtype_float64"]
    assert not result.loadable("1.2")
    assert audit.audit_artifact(lowered["out"]).as_dict()["releases"] == result.as_dict()["releases"]


def test_report_record_has_sizes_time_gpu_and_table(lowered):
    summary = lowered["result"].summary()
    assert summary["gpu"] == {"name": "fake GPU (CPU test)", "capability": "90"}
    assert summary["seconds"] > 0 and summary["compile_seconds"] > 0
    assert summary["options"]["max_mm_configs"] == 2 and summary["options"]["triton_kernel_mode"] == "OFF"
    assert summary["preflight"]["ok"] is True
    assert "permuted" in summary["table"] and "[2, 1, 0]" in summary["table"]


def test_interrupted_write_leaves_no_model_pte(tmp_path, monkeypatch):
    from executorch.exir.program._program import ExecutorchProgramManager

    (tmp_path / "model.pte").write_bytes(b"an earlier run's program")
    fake = fake_cuda.FakeCudaCompile({})
    fake.install(monkeypatch)

    def interrupted(self, outdir):
        (Path(outdir) / "aoti_cuda_blob.ptd").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(ExecutorchProgramManager, "write_tensor_data_to_file", interrupted)
    progs = programs()
    with pytest.raises(KeyboardInterrupt):
        lowering.lower_to_pte(progs, tmp_path, recipe(progs), run_preflight=False)
    assert not (tmp_path / "model.pte").exists()
    assert not (tmp_path / "aoti_cuda_blob.ptd").exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no staging folder or temporary left either


def test_failed_pte_write_leaves_no_model_pte(tmp_path, monkeypatch):
    from executorch.exir.program._program import ExecutorchProgramManager

    fake = fake_cuda.FakeCudaCompile({})
    fake.install(monkeypatch)

    def broken(self, fh):
        fh.write(b"\0" * 100)
        raise OSError("disk full")

    monkeypatch.setattr(ExecutorchProgramManager, "write_to_file", broken)
    progs = programs()
    with pytest.raises(OSError, match="disk full"):
        lowering.lower_to_pte(progs, tmp_path, recipe(progs), run_preflight=False)
    assert list(tmp_path.iterdir()) == []


def test_output_passed_through_is_refused_with_a_reason(tmp_path, monkeypatch):
    fake_cuda.FakeCudaCompile({}).install(monkeypatch)
    with torch.no_grad():
        progs = {"forward": torch.export.export(PassThrough(), (torch.randn(3), torch.randn(3)))}
    with pytest.raises(LoweringError, match="does not come from the delegate"):
        lowering.lower_to_pte(progs, tmp_path, recipe(progs), run_preflight=False)
    assert not (tmp_path / "model.pte").exists()


def test_preflight_runs_on_the_edge_program_the_lowering_makes(tmp_path, monkeypatch):
    # One edge step per method: the preflight judges the edge program the backend then gets, and makes none.
    import executorch.exir.program._program as et_program

    from zoo.export.lower import preflight

    fake_cuda.FakeCudaCompile({}).install(monkeypatch)
    made, judged = [], []
    real_edge, real_check = et_program._gen_edge_manager_for_partitioners, preflight.check_kernels

    def edge_step(partitioners, programs, *args, **kwargs):
        made.append(sorted(programs))
        return real_edge(partitioners, programs, *args, **kwargs)

    def check(programs, *args, **kwargs):
        judged.append({name: getattr(ep, "dialect", "ATEN") for name, ep in programs.items()})
        return real_check(programs, *args, **kwargs)

    monkeypatch.setattr(et_program, "_gen_edge_manager_for_partitioners", edge_step)
    monkeypatch.setattr(preflight, "check_kernels", check)
    progs = programs()
    result = lowering.lower_to_pte(progs, tmp_path, recipe(progs))
    assert made == [["permuted"], ["pool"]]
    assert judged == [{"permuted": "EDGE"}, {"pool": "EDGE"}]
    assert result.preflight["ok"] is True and result.preflight["nodes"] > 0


class Detached(nn.Module):
    """A program the CUDA runtime lacks a kernel for: ``detach`` becomes ``aten::detach_copy``, a fallback."""

    def forward(self, x):
        return (x * 2).detach()


def test_preflight_refuses_before_compiling(tmp_path, monkeypatch):
    fake = fake_cuda.FakeCudaCompile({})
    fake.install(monkeypatch)

    with torch.no_grad():
        progs = {"forward": torch.export.export(Detached(), (torch.randn(3),))}
    with pytest.raises(KernelPreflightRefused, match="aten::detach_copy"):
        lowering.lower_to_pte(progs, tmp_path, recipe(progs))
    assert fake.partitions == {}  # nothing reached the compile step
    assert list(tmp_path.iterdir()) == []  # nor any file


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_no_gpu_is_a_clear_error(tmp_path):
    with pytest.raises(NoGpuError, match="needs a CUDA device"):
        lowering.lower_to_pte(programs(), tmp_path, recipe(["permuted", "pool"]))


def test_inductor_settings_apply_inside_and_restore_after(monkeypatch, tmp_path):
    import torch._inductor.config as cfg

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("ZOO_INDUCTOR_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_MAX_AUTOTUNE_PRUNE_CHOICES_BASED_ON_SHARED_MEM", raising=False)
    before = (cfg.test_configs.max_mm_configs, cfg.max_autotune_prune_choices_based_on_shared_mem)
    with compile_settings.inductor_settings(3) as options:
        assert cfg.test_configs.max_mm_configs == 3
        assert cfg.max_autotune_prune_choices_based_on_shared_mem is True
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache")
        assert os.environ["TORCHINDUCTOR_MAX_AUTOTUNE_PRUNE_CHOICES_BASED_ON_SHARED_MEM"] == "1"
        assert options["inductor_cache_dir"] == str(tmp_path / "cache") and (tmp_path / "cache").is_dir()
    assert (cfg.test_configs.max_mm_configs, cfg.max_autotune_prune_choices_based_on_shared_mem) == before
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ


def _inductor_workers_ptxas() -> str:
    """What Inductor's compile workers set TRITON_PTXAS_PATH to, asked of Inductor itself in a fresh process."""
    code = ("import os\n"
            "from torch._inductor.runtime.compile_tasks import _set_triton_ptxas_path\n"
            "_set_triton_ptxas_path()\n"
            "print(os.environ.get('TRITON_PTXAS_PATH') or '')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_PTXAS_PATH"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""


def test_the_lowering_compiles_with_the_ptxas_of_inductors_compile_workers(monkeypatch):
    # Triton's cache key holds the ptxas version: with another ptxas than the workers', every autotuning choice
    # the pool compiled is compiled again in the lowering's own thread.
    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    want = _inductor_workers_ptxas()
    with compile_settings.inductor_settings(None) as options:
        assert os.environ.get("TRITON_PTXAS_PATH", "") == want
        assert (options["triton_ptxas"] or "") == want
    assert "TRITON_PTXAS_PATH" not in os.environ


def test_an_operators_ptxas_is_kept(monkeypatch, tmp_path):
    chosen = tmp_path / "ptxas"
    monkeypatch.setenv("TRITON_PTXAS_PATH", str(chosen))
    with compile_settings.inductor_settings(None) as options:
        assert os.environ["TRITON_PTXAS_PATH"] == str(chosen) == options["triton_ptxas"]
    assert os.environ["TRITON_PTXAS_PATH"] == str(chosen)


def test_flatc_is_found_and_runnable(monkeypatch):
    monkeypatch.delenv("FLATC_EXECUTABLE", raising=False)
    path = artifact.ensure_flatc()
    assert os.environ["FLATC_EXECUTABLE"] == path
    assert Path(path).name == "flatc" and os.access(path, os.X_OK)


def test_reading_a_foreign_file_is_a_zoo_error(tmp_path):
    bad = tmp_path / "model.pte"
    bad.write_bytes(b"\0" * 64)
    with pytest.raises(LoweringError, match="not a readable ExecuTorch program"):
        artifact.read_pte(bad)
    with pytest.raises(LoweringError, match="not an ExecuTorch data file"):
        artifact.read_ptd_entries(bad)


def test_a_refusal_is_the_preflight_stage_and_nothing_is_compiled(tmp_path, monkeypatch):
    from zoo.export import stages as gpu_steps
    from zoo.core.report import RunReport

    fake = fake_cuda.FakeCudaCompile({})
    fake.install(monkeypatch)

    with torch.no_grad():
        progs = {"forward": torch.export.export(Detached(), (torch.randn(3),))}
    report = RunReport(tmp_path)
    with pytest.raises(KernelPreflightRefused):
        gpu_steps.lower_step(progs, RunFolder(tmp_path / "run"), recipe(progs), report)
    assert [(s["stage"], s["status"]) for s in report.stages] == [("preflight", "failed"), ("lower", "skipped")]
    assert report.get("failed_stage") == "preflight" and fake.partitions == {}


def test_the_shared_plan_is_used_only_where_it_costs_little_gpu_memory():
    from zoo.export.lower.constant_plan import plan_constants

    class Two(nn.Module):
        """Two heads of a trunk: ``big`` shares the trunk, ``apart`` reads only its own weights."""

        def __init__(self):
            super().__init__()
            self.trunk = nn.Linear(64, 64)
            self.head_a, self.head_b = nn.Linear(64, 2), nn.Linear(64, 2)
            self.own_a, self.own_b = nn.Linear(64, 64), nn.Linear(64, 64)

    unit = Two()

    class Call(nn.Module):
        def __init__(self, fn):
            super().__init__()
            self.unit, self.fn = unit, fn

        def forward(self, x):
            return self.fn(self.unit, x)

    def export(fn):
        return torch.export.export(Call(fn), (torch.randn(2, 64),))

    shared = plan_constants({"a": export(lambda u, x: u.head_a(u.trunk(x))), "b": export(lambda u, x: u.head_b(u.trunk(x)))})
    apart = plan_constants({"a": export(lambda u, x: u.own_a(x)), "b": export(lambda u, x: u.own_b(x))})
    # By hand: the trunk (64*64+64 floats) read twice, each head (64*2+2) once; one table holds all three.
    trunk, head = (64 * 64 + 64) * 4, (64 * 2 + 2) * 4
    assert shared.gpu_growth(2) == pytest.approx(2 * (trunk + 2 * head) / (2 * trunk + 2 * head) - 1)
    assert constant_plan.plan_decision(shared, 2)["applied"] is True
    assert apart.gpu_growth(2) == pytest.approx(1.0)  # each blob would hold both methods' weights: twice the memory
    decision = constant_plan.plan_decision(apart, 2)
    assert decision["applied"] is False and "mostly different weights" in decision["why"]
    assert constant_plan.plan_decision(shared, 1)["applied"] is False


def test_methods_that_read_the_same_weights_share_a_table_and_the_others_keep_theirs():
    # LingBot-VA's chunk layout: two transformer steps read the same trunk; two encodes read an encoder of their
    # own, exported from another module. One table for all four would not pay (each .so would carry both), so
    # before grouping no weight was shared at all, the trunk included.
    from zoo.export.lower.constant_plan import plan_constants, read_constants, sharing_groups

    trunk, encoder = nn.Linear(64, 64), nn.Linear(16, 16)
    heads = nn.ModuleDict({"video": nn.Linear(64, 2), "action": nn.Linear(64, 2)})
    steps = nn.ModuleDict({"trunk": trunk, "heads": heads})

    class Step(nn.Module):
        def __init__(self, head):
            super().__init__()
            self.unit, self.head = steps, head

        def forward(self, x):
            return self.unit["heads"][self.head](self.unit["trunk"](x))

    class Encode(nn.Module):
        def __init__(self, twice):
            super().__init__()
            self.encoder, self.twice = encoder, twice

        def forward(self, x):
            y = self.encoder(x)
            return self.encoder(y) if self.twice else y

    with torch.no_grad():
        programs = {"encode_first": torch.export.export(Encode(False), (torch.randn(2, 16),)),
                    "encode": torch.export.export(Encode(True), (torch.randn(2, 16),)),
                    "video_step": torch.export.export(Step("video"), (torch.randn(2, 64),)),
                    "action_step": torch.export.export(Step("action"), (torch.randn(2, 64),))}
    reads = {m: read_constants(p) for m, p in programs.items()}
    # By hand: a step reads the trunk (64*64+64 floats) and its head (64*2+2); an encode the encoder (16*16+16).
    assert sum(reads["video_step"].values()) == ((64 * 64 + 64) + (64 * 2 + 2)) * 4
    assert sum(reads["encode"].values()) == (16 * 16 + 16) * 4
    groups = sharing_groups(reads)
    assert groups == [["encode_first", "encode"], ["video_step", "action_step"]]
    plans = [(g, plan_constants({m: programs[m] for m in g})) for g in groups]
    decision = constant_plan.plans_decision(plans)
    assert [g["applied"] for g in decision["groups"]] == [True, True] and decision["applied"] is True
    assert decision["bytes"] == ((16 * 16 + 16) + (64 * 64 + 64) + 2 * (64 * 2 + 2)) * 4  # each weight once
    assert "video_step + action_step: " in decision["why"]
    # One table for all four, as before grouping: not applied, so nothing was shared.
    assert constant_plan.plan_decision(plan_constants(programs), 4)["applied"] is False
    # Below the share, methods stay apart: the trunk is not most of what a method reads that barely uses it.
    assert sharing_groups({"a": {"t": 10, "x": 90}, "b": {"t": 10, "y": 90}}) == [["a"], ["b"]]
    assert sharing_groups({"a": {"t": 60, "x": 40}, "b": {"t": 60, "y": 40}}) == [["a", "b"]]
