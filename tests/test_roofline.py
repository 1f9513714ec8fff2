"""The roofline of the chunk bench (zoo.bench.roofline) against hand-worked counts, and the strongest-PyTorch
candidate (zoo.bench.graphed) against the eager rewritten programs it compiles."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from zoo.bench import chunk, chunk_tables
from zoo.bench.roofline import CallRecorder, Rates, chunk_floor, nbytes, program_flops, weight_bytes


class Attend(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 32)

    def forward(self, x, q, mask):
        plain = nn.functional.scaled_dot_product_attention(q, q, q)
        masked = nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        return self.proj(x), plain, masked


def _inputs():
    return [torch.randn(8, 64), torch.randn(1, 2, 16, 8), torch.ones(1, 1, 16, 16, dtype=torch.bool)]


def test_flops_of_a_linear_and_two_attentions_by_hand():
    module = torch.export.export(Attend(), tuple(_inputs())).module()
    # Linear 8x64 @ 64x32: 2*M*N*K. Attention (B=1, H=2, L=S=16, E=8): Q K^T and P V, 2*B*H*L*S*E each.
    linear = 2 * 8 * 64 * 32
    attention = 2 * (2 * 1 * 2 * 16 * 16 * 8)
    assert program_flops(module, _inputs()) == linear + 2 * attention


def test_flops_are_counted_from_shapes_alone():
    """A runtime's GPU handle has a shape and a dtype, not data: the count is the same."""
    module = torch.export.export(Attend(), tuple(_inputs())).module()
    handles = [SimpleNamespace(shape=tuple(t.shape), dtype=str(t.dtype).replace("torch.", "")) for t in _inputs()]
    assert program_flops(module, handles) == program_flops(module, _inputs())


def test_weight_bytes_count_a_shared_storage_once():
    shared = nn.Linear(10, 10, bias=False)
    holder = nn.Module()
    holder.a, holder.b = shared, shared
    holder.register_buffer("table", torch.zeros(5, dtype=torch.bfloat16))
    assert weight_bytes(holder) == 10 * 10 * 4 + 5 * 2


def test_nbytes_of_tensors_and_handles():
    assert nbytes(torch.zeros(3, 4, dtype=torch.bfloat16)) == 24
    assert nbytes(SimpleNamespace(shape=(2, 1024), dtype="bfloat16")) == 4096
    assert nbytes("not a tensor") == 0


def test_floor_is_the_larger_of_bytes_and_flops():
    rates = Rates(copy_gbps=4000.0, gemm_tflops=800.0)
    # 9.66 GB at 4 TB/s = 2.415 ms; 1 TFLOP at 800 TFLOP/s = 1.25 ms: memory decides.
    assert rates.floor_ms(9_660_000_000, 10**12) == pytest.approx(2.415)
    assert rates.bound(9_660_000_000, 10**12) == "memory"
    assert rates.floor_ms(10**6, 8 * 10**12) == pytest.approx(10.0)
    assert rates.bound(10**6, 8 * 10**12) == "compute"


class CountingBackend:
    """A backend whose step doubles ``x`` and hands ``pool`` back updated."""

    def __init__(self):
        self.calls = 0

    def _ordered(self, method, inputs):
        return [inputs["x"], inputs["pool"]]

    def call(self, method, **inputs):
        self.calls += 1
        return {"y": inputs["x"] * 2, "pool_next": inputs["pool"] + 1}


def test_recorded_calls_leave_the_state_handed_back_out_of_the_bytes():
    backend = CountingBackend()
    recorder = CallRecorder(backend, flops_of=lambda m, inputs: 1000, weights_of=lambda m: 4096,
                            state={"step": {"pool_next": "pool"}}, sync=lambda: None)
    x, pool = torch.zeros(16), torch.zeros(256)
    with recorder:
        backend.call("step", x=x, pool=pool)  # not recording: passes through, uncounted
        recorder.recording = True
        for _ in range(3):
            backend.call("step", x=x, pool=pool)
    backend.call("step", x=x, pool=pool)  # after the block: the backend's own call again, unrecorded
    assert backend.calls == 5
    (cost,) = recorder.costs.values()
    # weights 4096 + inputs (16 + 256) * 4 + the output y (16 * 4); pool_next is the state handed back
    assert (cost.calls, cost.bytes_moved, cost.flops) == (3, 4096 + 272 * 4 + 64, 1000)
    rates = Rates(copy_gbps=1.0, gemm_tflops=1.0)
    floor = chunk_floor([cost], rates, chunks=3)
    assert floor["calls_per_chunk"] == {"step": 1.0}
    assert floor["floor_ms"] == pytest.approx(rates.floor_ms(cost.bytes_moved, cost.flops))


def test_a_backend_that_says_where_its_calls_went_gets_a_split_per_method():
    from zoo.bench.chunk_runners import split_rows
    from zoo.runtimes.executorch import CallTiming

    class SplittingBackend(CountingBackend):
        def call(self, method, **inputs):
            self.last_call = CallTiming(write=0.1 * self.calls, execute=10.0, runtime_io=0.5, pipe=1.0, read=0.2)
            return super().call(method, **inputs)

    backend = SplittingBackend()
    recorder = CallRecorder(backend, flops_of=lambda m, inputs: 1000, weights_of=lambda m: 0,
                            state={"step": {"pool_next": "pool"}}, sync=lambda: None)
    recorder.recording = True
    with recorder:
        for _ in range(3):
            backend.call("step", x=torch.zeros(4), pool=torch.zeros(4))
    row = next(iter(recorder.costs.values())).as_dict(Rates(copy_gbps=1.0, gemm_tflops=1.0))
    # write was 0.0, 0.1 and 0.2 ms: its median 0.1; the other parts were the same every call.
    assert row["split_ms"] == pytest.approx({"write": 0.1, "execute": 10.0, "runtime_io": 0.5, "pipe": 1.0,
                                             "read": 0.2})
    row["median_ms"] = 12.0
    results = {"policies": [{"policy": "p", "candidates": {
        "runner": {"roofline": {"methods": [{"method": "step", "median_ms": 10.5}]}},
        "executorch": {"roofline": {"methods": [row]}}}}]}
    header, line = split_rows(results)
    assert header[:6] == ["policy", "candidate", "method", "runner ms", "median ms", "difference"]
    assert line == ["p", "executorch", "step", "10.500", "12.000", "+1.500", "10.000", "0.500", "1.000", "0.100",
                    "0.200"]
    assert split_rows({"policies": [{"policy": "p", "candidates": {"runner": {}}}]}) == []


def test_chunk_ratios_and_their_targets():
    candidates = {"runner": {"chunk_ms": {"median": 300.0}, "roofline": {"chunk": {"floor_ms": 200.0}}},
                  "executorch": {"chunk_ms": {"median": 309.0}}, "pytorch": {"chunk_ms": {"median": 600.0}},
                  "graphs": {"chunk_ms": {"median": 450.0}},
                  "eager": {"chunk_ms": {"median": 1200.0}}, "compile": {"error": "boom"}}
    got = chunk.ratios(candidates)
    assert got == {"runner/eager": 0.25, "runner/compile": None, "runner/pytorch": 0.5,
                   "executorch/runner": pytest.approx(1.03), "runner/floor": 1.5, "graphs/pytorch": 0.75,
                   "graphs/floor": 2.25, "graphs/runner": 1.5}
    results = {"policies": [{"policy": "p", "status": "done", "ratios": got}]}
    (line,) = chunk_tables.ratio_lines(results)
    assert "runner/pytorch 0.50x (meets <= 0.7)" in line and "runner/floor 1.50x (meets <= 2.0)" in line
    assert "graphs/floor 2.25x (misses <= 2.0)" in line and "graphs/runner 1.50x (lever)" in line


@pytest.mark.e2e
def test_the_compiled_steps_compute_what_the_eager_programs_do(tiny_runs):
    """The pytorch candidate's steps, their state in persistent buffers, against the eager rewritten programs,
    call after call with the state fed back (LingBot-VA's VAE caches: an in-graph write of them once came out
    wrong, so this is the case to keep)."""
    from zoo.bench.graphed import GraphedBackend
    from zoo.contract.run_folder import RunFolder
    from zoo.runner.backends import EagerBackend
    from zoo.runner.lingbot_va import LingBotVARunner

    run = RunFolder(tiny_runs("lingbot-va-tiny").path)
    state = LingBotVARunner.device_state(run.read_host_settings())
    eager, graphed = EagerBackend(run, "cpu"), GraphedBackend(run, "cpu")
    for backend in (eager, graphed):
        backend.keep_state(state)
    io = eager.io_spec.methods
    generator = torch.Generator().manual_seed(0)
    frames = [io["vae_encode_first"].inputs[0].sample(generator, {})] + [
        io["vae_encode"].inputs[0].sample(generator, {}) for _ in range(3)]
    results = {}
    for name, backend in (("eager", eager), ("graphed", graphed)):
        out = backend.call("vae_encode_first", frames=frames[0])
        latents = [out["latent"].clone()]
        caches = {k: v for k, v in out.items() if k != "latent"}
        for f in frames[1:]:
            out = backend.call("vae_encode", frames=f, **caches)
            latents.append(out["latent"].clone())
            caches = {k: v for k, v in out.items() if k != "latent"}
        results[name] = latents
    for want, got in zip(results["eager"], results["graphed"]):
        assert float((want - got).norm() / want.norm()) < 1e-5


@pytest.mark.e2e
def test_the_compiled_steps_write_the_buffer_layouts_shared_pool_as_the_eager_programs_do(shared_cache):
    """The pytorch candidate over the "buffer" layout (the KV pool inside the DiT programs, one tensor shared by
    both): video_step and action_step alternating on drawn inputs, each call's prediction against the eager
    programs' from the same state; the pool written in place inside the compiled steps."""
    from support import shared_runs
    from zoo.bench.graphed import GraphedBackend
    from zoo.contract.run_folder import RunFolder
    from zoo.export.verify import draw_inputs
    from zoo.runner.backends import EagerBackend

    exported = shared_runs.tiny_run(shared_cache, "lingbot-va-tiny",
                                    ["lowering.kv_pool=buffer", "policy_check.episodes=2"], label="kv-buffer")
    exported.check_exported()
    run = RunFolder(exported.path)
    eager, graphed = EagerBackend(run, "cpu"), GraphedBackend(run, "cpu")
    names = run.read_host_settings().kv_pool.buffer_names()
    assert eager.sharing_problem(["video_step", "action_step"], names) is None
    assert graphed.sharing_problem(["video_step", "action_step"], names) is None
    io = eager.io_spec.methods
    for step, method in enumerate(["video_step", "action_step"] * 3):
        inputs = dict(zip([s.name for s in io[method].inputs], draw_inputs(io[method].inputs, {}, step, method)))
        want, got = eager.call(method, **inputs), graphed.call(method, **inputs)
        for name in io[method].outputs:
            assert float((want[name] - got[name]).norm() / want[name].norm()) < 1e-5, (step, method, name)
    for name in names:  # the pools the two wrote, call after call
        a, b = eager._module("video_step").get_buffer(name), graphed._module("video_step").get_buffer(name)
        assert float((a - b).norm() / a.norm()) < 1e-5, name
