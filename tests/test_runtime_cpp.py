"""The real zoo_runner binary (runtime/cpp), on the CPU, over a program with portable kernels only.

Runs where a runner is built and named by $ZOO_ET_RUNNER (a portable build from `scripts/build_runtime.sh SRC
OUT --cpu` is enough; a CUDA build runs portable programs too); skipped otherwise. The program is exported
here with plain ``to_edge(...).to_executorch()`` and its weights as external constants, so the runner loads a
``.pte`` and a ``.ptd`` as it does for a CUDA artifact. The reference is the eager module.
Checked: single-call mode (outputs and the timing summary, inputs put on the device once and outputs kept
there), the session over a pipe, a plan that feeds outputs into later calls inside the runner (held by name:
zeros, $NAME, keep:NAME, fetch, names, drop), which graph inputs the program plans (one lowered with them left
out gets the caller's memory), the build facts (--info: release, protocol, patches), and the runner's own
refusals: a wrong input dtype or count, a foreign tensor file, a missing .ptd, a bad output mode or name.
On a machine without a GPU (a CUDA build runs portable programs too) held values stay in host memory.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from zoo.runtimes import executorch as et_runtime
from zoo.core.errors import RuntimeCallFailed
from zoo.contract.tensor_file import read_tensor, write_tensor
from support import portable_program

RUNNER = os.environ.get(et_runtime.RUNNER_ENV)
pytestmark = pytest.mark.skipif(not RUNNER or not Path(RUNNER).is_file(),
                                reason=f"no built zoo_runner (set {et_runtime.RUNNER_ENV}; scripts/build_runtime.sh)")


MODULES = portable_program.modules()


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    return portable_program.build(tmp_path_factory.mktemp("program"), MODULES)


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([RUNNER, *args], capture_output=True, text=True, timeout=300)


def summary(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


gather_inputs = portable_program.gather_inputs
close = portable_program.close


def test_info_names_the_build():
    info = summary(run("--info"))
    assert info["ok"] and info["executorch_version"].startswith("1.")
    assert info["release"] == ".".join(info["executorch_version"].split(".")[:2]) and info["protocol"] == 2
    assert isinstance(info["patches"], list)
    if info["cuda"]:
        assert "CudaBackend" in info["backends"]
        assert set(info["features"]) <= {"cublas-gemm"}  # without cuBLAS the configure warns and leaves it out
    else:
        assert info["weight_sharing_across_methods"].startswith("not applicable")
        assert info["features"] == []  # the cuBLAS shims go into the CUDA backend's shim library


def test_single_call_mode_writes_outputs_and_times(program, tmp_path):
    pte, ptd = program
    inputs = gather_inputs(0)
    files = [str(write_tensor(tmp_path / f"in{i}.zt", t)) for i, t in enumerate(inputs)]
    out = tmp_path / "out"
    out.mkdir()
    proc = run("--model", str(pte), "--data", str(ptd), "--method", "gather", "--inputs", ",".join(files),
               "--warmup", "2", "--iters", "5", "--outputs", str(out))
    s = summary(proc)
    assert proc.returncode == 0 and s["ok"], proc.stderr
    want = MODULES["gather"](*inputs)
    got = [read_tensor(p) for p in s["outputs"]]
    assert close(got[0], want[0]) and torch.equal(got[1], want[1])
    assert s["mode"] == "single" and s["iters"] == 5 and 0 < s["min_ms"] <= s["median_ms"] <= s["p90_ms"] <= s["max_ms"]
    assert s["loaded"] == ["action_step", "gather", "video_step"] and s["load_ms"] > 0
    assert s["shapes"] == [[3, 3], [3]] and s["dtypes"] == ["float32", "int64"]


def test_session_over_the_pipe_matches_eager(program):
    pte, ptd = program
    with et_runtime.RuntimeSession(pte, ptd, executable=RUNNER, require_cuda=False) as session:
        for seed in range(3):
            inputs = gather_inputs(seed)
            got, want = session.call("gather", inputs), MODULES["gather"](*inputs)
            assert close(got[0], want[0]) and torch.equal(got[1], want[1])
        pool = torch.zeros(5, 4)
        g = torch.Generator().manual_seed(5)
        want_pool = pool
        for step in range(4):
            m = ("video_step", "action_step")[step % 2]
            values, slots = torch.randn(2, 4, generator=g), torch.randperm(5, generator=g)[:2]
            readout, pool = session.call(m, [values, slots, pool])
            want_readout, want_pool = MODULES[m](values, slots, want_pool)
            assert close(readout, want_readout) and torch.equal(pool, want_pool)


def test_plan_feeds_the_pool_inside_the_runner(program, tmp_path):
    pte, ptd = program
    g = torch.Generator().manual_seed(11)
    steps, want, pool = [], [], torch.zeros(5, 4)
    for step in range(5):
        m = ("video_step", "action_step")[step % 2]
        values, slots = torch.randn(2, 4, generator=g), torch.randperm(5, generator=g)[:2]
        steps.append((m, [values, slots, torch.zeros(5, 4) if step == 0 else (step - 1, 1)]))
        readout, pool = MODULES[m](values, slots, pool)
        want.append((readout, pool))
    result = et_runtime.run_plan(pte, ptd, steps, executable=RUNNER, require_cuda=False, keep_dir=tmp_path / "plan")
    assert result.summary["ok"] and result.summary["steps"] == 5 and len(result.step_ms) == 5
    for (readout, pool), got in zip(want, result.outputs):
        assert close(got[0], readout) and torch.equal(got[1], pool)
    plan = (tmp_path / "plan" / "plan.txt").read_text()
    assert "keep:r3_1" in plan and "$r3_1" in plan  # step 4 read step 3's pool inside the runner, by name


def test_wrong_input_dtype_is_named_before_the_runtime_sees_it(program, tmp_path):
    pte, ptd = program
    x, idx, mask = gather_inputs(0)
    files = [str(write_tensor(tmp_path / f"in{i}.zt", t)) for i, t in enumerate((x, idx.int(), mask))]
    proc = run("--model", str(pte), "--data", str(ptd), "--method", "gather", "--inputs", ",".join(files))
    s = summary(proc)
    assert proc.returncode == 4 and not s["ok"]
    assert s["error"] == "method gather: input 1 is int32, the method takes int64"
    proc = run("--model", str(pte), "--data", str(ptd), "--method", "gather", "--inputs", ",".join(files[:2]))
    assert proc.returncode == 4 and "takes 3 inputs, 2 were given" in summary(proc)["error"]


def test_a_foreign_input_file_is_refused(program, tmp_path):
    pte, ptd = program
    bad = tmp_path / "x.pt"
    torch.save(torch.zeros(5, 4), bad)
    proc = run("--model", str(pte), "--data", str(ptd), "--method", "gather", "--inputs", f"{bad},{bad},{bad}")
    assert proc.returncode == 2 and "not a zoo tensor file (wrong magic)" in summary(proc)["error"]


def test_a_missing_ptd_fails_to_load_with_the_runtime_saying_why(program):
    pte, _ = program
    proc = run("--model", str(pte), "--method", "gather", "--inputs", "unused.zt")
    s = summary(proc)
    assert proc.returncode == 3 and s["stage"] == "load" and "cannot load method" in s["error"]
    assert proc.stderr.strip(), "ExecuTorch's log (compiled in) should say what is missing"
    with pytest.raises(RuntimeCallFailed, match="cannot load method"):
        et_runtime.RuntimeSession(pte, None, executable=RUNNER, require_cuda=False)


def test_bad_command_lines(program):
    pte, ptd = program
    for args, words in ((["--model", str(pte)], "either --method"), (["--frobnicate"], "unknown argument"),
                        (["--model", str(pte), "--plan", "-", "--inputs", "a.zt"], "--inputs belongs to --method")):
        proc = run(*args)
        assert proc.returncode == 2 and words in summary(proc)["error"]


_pool_calls = portable_program.pool_calls


def _eager_pools(calls):
    pool, out = torch.zeros(5, 4), []
    for m, values, slots in calls:
        readout, pool = MODULES[m](values, slots, pool)
        out.append((readout, pool))
    return out


def test_a_plan_holds_the_pool_by_name(program, tmp_path):
    pte, ptd = program
    calls = _pool_calls(4)
    lines = ["zeros pool float32 [5,4]"]
    for i, (m, values, slots) in enumerate(calls):
        v, s_ = write_tensor(tmp_path / f"v{i}.zt", values), write_tensor(tmp_path / f"s{i}.zt", slots)
        lines.append(f"{m} {v} {s_} $pool -> host keep:pool")
    lines += [f"fetch pool {tmp_path / 'pool.zt'}", "names", "drop pool", "names"]
    (tmp_path / "plan.txt").write_text("\n".join(lines) + "\n")
    proc = run("--model", str(pte), "--data", str(ptd), "--plan", str(tmp_path / "plan.txt"),
               "--outputs", str(tmp_path))
    replies = [json.loads(line) for line in proc.stdout.splitlines()]
    assert proc.returncode == 0 and replies[-1]["ok"], proc.stdout + proc.stderr
    calls_made = [r for r in replies if "step" in r]
    for reply, (readout, _) in zip(calls_made, _eager_pools(calls)):
        assert reply["kept"] == ["pool"] and reply["outputs"][1] is None and reply["rescued"] == []
        assert close(read_tensor(reply["outputs"][0]), readout)
    assert torch.equal(read_tensor(tmp_path / "pool.zt"), _eager_pools(calls)[-1][1])
    names = [r for r in replies if r.get("command") == "names"]
    assert names[0]["values"] == [{"name": "pool", "shape": [5, 4], "dtype": "float32",
                                   "device": bool(names[0]["values"][0]["device"])}] and names[1]["values"] == []
    assert replies[-1]["steps"] == 4 and replies[-1]["named_values"] == 0


def test_the_session_keeps_the_pool_in_the_runner(program):
    pte, ptd = program
    calls = _pool_calls(5, seed=4)
    with et_runtime.RuntimeSession(pte, ptd, executable=RUNNER, require_cuda=False) as session:
        assert session.ready["memory_planned"]["video_step"] == {"inputs": [True, True, True],
                                                                  "outputs": [True, True]}
        pool = session.zeros("pool", (5, 4), torch.float32)
        for (m, values, slots), (readout, _) in zip(calls, _eager_pools(calls)):
            got, pool = session.call(m, [values, slots, pool], keep={1: "pool"})
            assert close(got, readout)
        assert torch.equal(pool.fetch(), _eager_pools(calls)[-1][1])
        assert session.stats["rescued"] == 0


def test_bad_output_modes_and_names_are_refused(program, tmp_path):
    pte, ptd = program
    v, s_ = write_tensor(tmp_path / "v.zt", torch.zeros(2, 4)), write_tensor(tmp_path / "s.zt", torch.tensor([0, 1]))
    p = write_tensor(tmp_path / "p.zt", torch.zeros(5, 4))
    for line, words in ((f"video_step {v} {s_} {p} -> host", "returns 2 outputs, 1 output modes were given"),
                        (f"video_step {v} {s_} {p} -> host keep", "bad output mode keep"),
                        (f"video_step {v} {s_} $nothing", "no value named nothing"),
                        (f"video_step {v} {s_} {p} -> host drop\nvideo_step {v} {s_} @0:1", "kept output 1 on the "
                         "GPU or dropped it"),
                        ("zeros x float99 [2]", "unknown dtype float99")):
        (tmp_path / "plan.txt").write_text(line + "\n")
        proc = run("--model", str(pte), "--data", str(ptd), "--plan", str(tmp_path / "plan.txt"))
        assert proc.returncode == 4 and words in summary(proc)["error"], (line, proc.stdout)


def test_single_mode_with_inputs_on_the_device_and_outputs_kept(program, tmp_path):
    pte, ptd = program
    values, slots = torch.randn(2, 4), torch.tensor([4, 0])
    pool = torch.randn(5, 4)
    files = [str(write_tensor(tmp_path / f"in{i}.zt", t)) for i, t in enumerate((values, slots, pool))]
    proc = run("--model", str(pte), "--data", str(ptd), "--method", "video_step", "--inputs", ",".join(files),
               "--device-inputs", "2", "--keep-outputs", "1", "--warmup", "1", "--iters", "3",
               "--outputs", str(tmp_path))
    s = summary(proc)
    assert proc.returncode == 0 and s["ok"], proc.stdout + proc.stderr
    assert s["device_inputs"] == [2] and s["kept_outputs"] == [1]
    want = MODULES["video_step"](values, slots, pool)
    got = [read_tensor(p) for p in s["outputs"]]  # the first call's, the kept one copied back after it
    assert close(got[0], want[0]) and torch.equal(got[1], want[1])
    assert 0 < s["median_execute_ms"] <= s["median_ms"]
    proc = run("--model", str(pte), "--data", str(ptd), "--method", "video_step", "--inputs", ",".join(files),
               "--keep-outputs", "7")
    assert proc.returncode == 2 and "positions below 2" in summary(proc)["error"]


def test_inputs_left_out_of_memory_planning_take_the_callers_memory(tmp_path):
    """A program lowered as zoo lowers (graph inputs not planned; outputs planned here, as portable kernels write
    into them): the runner says so, and binds its own memory to the inputs."""
    from executorch.exir import ExecutorchBackendConfig, to_edge
    from executorch.exir.passes import MemoryPlanningPass

    from zoo.contract.artifact import ensure_flatc

    ensure_flatc()
    example = (torch.randn(2, 4), torch.tensor([1, 3]), torch.zeros(5, 4))
    config = ExecutorchBackendConfig(memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False))
    prog = to_edge({"video_step": torch.export.export(MODULES["video_step"], example)}).to_executorch(config)
    (tmp_path / "model.pte").write_bytes(prog.buffer)
    calls = _pool_calls(3, seed=8)
    with et_runtime.RuntimeSession(tmp_path / "model.pte", None, executable=RUNNER, require_cuda=False) as session:
        assert session.ready["memory_planned"]["video_step"]["inputs"] == [False, False, False]
        pool, want = session.zeros("pool", (5, 4), torch.float32), torch.zeros(5, 4)
        for _, values, slots in calls:
            got, pool = session.call("video_step", [values, slots, pool], keep={1: "pool"})
            readout, want = MODULES["video_step"](values, slots, want)
            assert close(got, readout)
        assert torch.equal(pool.fetch(), want) and session.stats["host_copies"] == 0
