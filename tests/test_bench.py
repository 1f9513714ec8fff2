"""The benchmark harness on the CPU: statistics against hand-worked values, timing on clocks that known work
advances (no test depends on the wall clock), input rotation, warm-up exclusion, target judgements, rendering, the
rotary microbenchmark's maths, and ``python -m zoo bench`` on a small saved run folder. No test here times
the artifact; the GPU tests at the end only run where CUDA is present."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
import torch
from torch import nn

from zoo import bench
from zoo.contract.io_spec import DynamicDim, IoSpec
from zoo.bench import (
    Candidate,
    PerfCounterTimer,
    Stats,
    bench_method,
    judge_at_least,
    judge_at_most,
    measure,
    percentile,
)
from zoo.bench.rotary import ComplexRope, RotaryCase, angle_table, bench_case, parse_case, rewritten_rope, rope_bytes
from zoo.bench.seeded import parse_unit
from zoo.core.errors import NoGpuError, ZooError
from zoo.rewrites.complex_to_real import replace_complex_with_real
from zoo.policies.base import InputSpec

# --------------------------------------------------------------------------------------------------------
# Statistics


def test_stats_of_one_to_ten_match_hand_worked_values():
    s = Stats.from_samples([7, 1, 10, 3, 2, 9, 4, 8, 6, 5])  # order must not matter
    assert s.n == 10
    assert s.median == pytest.approx(5.5)
    assert s.p10 == pytest.approx(1.9)  # position 0.9 between 1 and 2
    assert s.p90 == pytest.approx(9.1)  # position 8.1 between 9 and 10
    assert s.mean == pytest.approx(5.5)
    assert s.stdev == pytest.approx(math.sqrt(82.5 / 9))  # sample stdev: sum of squares 82.5 over n-1
    assert s.spread() == pytest.approx((9.1 - 1.9) / 5.5)


def test_percentile_edges_and_single_sample():
    assert percentile([4.0], 0.9) == 4.0
    assert percentile([1.0, 3.0], 0.5) == 2.0
    assert percentile([1.0, 3.0], 1.0) == 3.0
    one = Stats.from_samples([2.5])
    assert (one.median, one.p10, one.p90, one.stdev, one.n) == (2.5, 2.5, 2.5, 0.0, 1)
    with pytest.raises(ValueError):
        Stats.from_samples([])


# --------------------------------------------------------------------------------------------------------
# measure(): a virtual clock the measured function advances by the work it does


class VirtualClock:
    """A timer whose clock moves only when the measured function says it worked (1 unit = 1 ms)."""

    name = "virtual"

    def __init__(self):
        self.now = 0.0
        self.syncs = 0

    def work(self, units: float) -> None:
        self.now += units

    def start(self):
        return self.now

    def stop(self, token):
        return (token, self.now)

    def sync(self):
        self.syncs += 1

    def elapsed_ms(self, marks):
        return [end - begin for begin, end in marks]


def test_measure_rotates_inputs_in_order_and_excludes_warmup():
    clock = VirtualClock()
    calls = []
    events = []

    def fn(item):
        calls.append(item)
        # The first three calls are slow (compilation, cold caches); timed calls must not see them.
        clock.work(100.0 if len(calls) <= 3 else 1.0)

    stats = measure(fn, ["a", "b", "c"], warmup=3, runs=6, timer=clock,
                    on_warm=lambda: events.append(len(calls)))
    assert calls == ["a", "b", "c"] + ["a", "b", "c", "a", "b", "c"]
    assert events == [3]  # on_warm ran once, after the warm-up and before any timed call
    assert stats.n == 6 and stats.median == 1.0 and stats.p90 == 1.0 and stats.stdev == 0.0


def test_measure_of_known_work_gives_the_work_ratio():
    clock = VirtualClock()
    inputs = [2, 3, 4, 5]  # work units per input: the median of 2,3,4,5 is 3.5

    small = measure(lambda n: clock.work(n), inputs, warmup=1, runs=8, timer=clock)
    large = measure(lambda n: clock.work(3 * n), inputs, warmup=1, runs=8, timer=clock)
    assert small.median == 3.5 and large.median == 10.5
    assert large.median / small.median == pytest.approx(3.0)
    got = bench.ratios({"artifact": {"stats": small.as_dict()}, "eager": {"stats": large.as_dict()},
                        "compile": {"stats": small.as_dict()}})
    assert got["artifact/eager"] == pytest.approx(1 / 3)
    assert got["artifact/compile"] == pytest.approx(1.0)


def test_measure_rejects_bad_counts():
    with pytest.raises(ValueError):
        measure(lambda _: None, [None], warmup=0, runs=0, timer=PerfCounterTimer())
    with pytest.raises(ValueError):
        measure(lambda _: None, [], warmup=0, runs=3, timer=PerfCounterTimer())


class SleepClock:
    """A clock in seconds that only a sleep moves: ``sleep(s)`` advances it by exactly ``s``."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_host_timer_turns_clock_seconds_into_milliseconds_per_call():
    # Deterministic (no timed unit tests): the host timer reads a clock that known sleeps advance.
    clock = SleepClock()
    timer = PerfCounterTimer(clock)
    short = measure(lambda _: clock.sleep(0.002), [None], warmup=1, runs=15, timer=timer)
    long = measure(lambda _: clock.sleep(0.006), [None], warmup=1, runs=15, timer=timer)
    assert short.median == pytest.approx(2.0) and short.n == 15 and short.stdev == pytest.approx(0.0, abs=1e-9)
    assert long.median == pytest.approx(6.0)
    assert long.median / short.median == pytest.approx(3.0)
    assert PerfCounterTimer().clock is time.perf_counter  # the real one reads the wall clock


# --------------------------------------------------------------------------------------------------------
# Targets


def test_judgements_say_by_how_much_a_target_is_missed():
    assert judge_at_most(0.62, 0.7) == {"value": 0.62, "limit": 0.7, "ok": True, "text": "met (0.62 <= 0.70)"}
    miss = judge_at_most(0.81, 0.7)  # 0.81 / 0.70 = 1.157
    assert miss["ok"] is False and miss["text"] == "missed by 16% (0.81 > 0.70)"
    assert judge_at_most(1.1, 1.05)["text"] == "missed by 4.8% (1.10 > 1.05)"  # 1.1 / 1.05 = 1.0476
    assert judge_at_least(0.56, 0.70)["text"] == "missed by 20% (0.56 < 0.70)"  # 1 - 0.56 / 0.70 = 0.2
    assert judge_at_least(0.91, 0.70)["ok"] is True
    for judge in (judge_at_most, judge_at_least):
        assert judge(None, 1.0) == {"value": None, "limit": 1.0, "ok": None, "text": "not measured"}
        assert judge(math.nan, 1.0)["ok"] is None


# --------------------------------------------------------------------------------------------------------
# bench_method with candidates of known cost


def _sleeper(seconds: float, scale: float = 2.0, clock: Optional[SleepClock] = None):
    """A candidate that costs ``seconds`` per call: on ``clock`` when given (deterministic), else really."""
    def build():
        def run(args):
            (clock.sleep if clock is not None else time.sleep)(seconds)
            return [args[0] * scale]
        return run
    return build


SPEC = [InputSpec("x", "float32", [2, "n"])]


def test_bench_method_ratios_targets_and_agreement_from_one_run():
    clock = SleepClock()
    cands = [Candidate("eager", _sleeper(0.006, clock=clock)),
             Candidate("artifact", _sleeper(0.002, 2.0 * (1 + 1e-3), clock=clock)),
             Candidate("compile", _sleeper(0.002, clock=clock))]
    [result] = bench_method("step", SPEC, [{"n": 3}], cands, warmup=2, runs=10, device="cpu", input_sets=3,
                            timer=PerfCounterTimer(clock))
    c = result["candidates"]
    assert result["sizes"] == {"n": 3} and result["input_sets"] == 3
    assert all(c[name]["stats"]["n"] == 10 for name in ("eager", "artifact", "compile"))
    assert c["eager"]["stats"]["median"] == pytest.approx(6.0) and c["artifact"]["stats"]["median"] == pytest.approx(2.0)
    assert result["ratios"]["artifact/eager"] == pytest.approx(1 / 3)
    assert result["ratios"]["artifact/compile"] == pytest.approx(1.0)
    assert result["targets"]["artifact/eager"]["ok"] is True
    assert result["targets"]["memory artifact/eager"]["ok"] is None  # no device memory on the CPU
    # artifact = 2x(1 + 1e-3) against eager 2x: relative L2 1e-3 and cosine 1, whatever x is.
    agree = result["agreement"]["artifact"]
    assert agree["worst_rel_l2"] == pytest.approx(1e-3, rel=1e-4)
    assert agree["min_cosine"] == pytest.approx(1.0, abs=1e-9)
    assert result["agreement"]["compile"]["worst_rel_l2"] == 0.0


def test_a_failing_or_skipped_candidate_is_reported_and_the_rest_are_measured():
    torn_down = []

    def broken():
        raise RuntimeError("missing fallback kernel\nsecond line")

    cands = [Candidate("eager", _sleeper(0.0005)),
             Candidate("artifact", broken, teardown=lambda: torn_down.append(True)),
             Candidate("compile", lambda: None, skipped="--no-compile")]
    results = bench_method("step", SPEC, [{"n": 2}, {"n": 4}], cands, warmup=1, runs=3, device="cpu", input_sets=2)
    assert [r["sizes"] for r in results] == [{"n": 2}, {"n": 4}]
    for r in results:
        assert r["candidates"]["artifact"] == {"error": "build failed: RuntimeError: missing fallback kernel"}
        assert r["candidates"]["compile"] == {"skipped": "--no-compile"}
        assert r["candidates"]["eager"]["stats"]["n"] == 3
        assert r["ratios"]["artifact/eager"] is None and r["targets"]["artifact/eager"]["text"] == "not measured"
    assert torn_down == [True]


def test_carried_state_is_the_inputs_handed_back_and_its_copy_is_timed_against_the_artifact():
    specs = [InputSpec("x", "float32", [4]), InputSpec("k_pool", "float32", [2, "n", 8]),
             InputSpec("v_pool", "bfloat16", [2, "n", 8])]
    outputs = ["pred", "k_pool_next", "v_pool_next"]
    assert bench.carried_inputs(specs, outputs) == [1, 2]
    assert bench.carried_inputs(specs, ["pred"]) == []
    timed = [{"sizes": {"n": 3}, "candidates": {"artifact": {"stats": {"median": 2.0}}}},
             {"sizes": {"n": 5}, "candidates": {"artifact": {"skipped": "the artifact runs only on a CUDA device"}}}]
    assert bench.carried_state_cost("step", specs, ["pred"], timed, warmup=1, runs=4, device="cpu") == []
    rows = bench.carried_state_cost("step", specs, outputs, timed, warmup=1, runs=4, device="cpu", input_sets=2)
    assert [r["sizes"] for r in rows] == [{"n": 3}, {"n": 5}]
    # 2*3*8 float32 + 2*3*8 bfloat16 = 192 + 96 bytes; at n=5: 320 + 160.
    assert [r["bytes"] for r in rows] == [288, 480] and rows[0]["inputs"] == ["k_pool", "v_pool"]
    assert rows[0]["copy"]["n"] == 4 and rows[0]["error"] is None
    assert rows[0]["fraction_of_artifact"] == pytest.approx(rows[0]["copy"]["median"] / 2.0)
    assert rows[1]["fraction_of_artifact"] is None  # no artifact time at that size: no share claimed
    text = bench.render({"carried_state": rows}, markdown=True)
    assert "State passed in and out" in text and "k_pool, v_pool" in text


def test_inputs_are_distinct_seeded_sets_of_the_spec_shapes():
    specs = [InputSpec("x", "float32", [2, "n"]), InputSpec("slots", "int64", [3], "randperm:10")]
    sets = bench.draw_inputs(specs, {"n": 5}, 4, "cpu")
    again = bench.draw_inputs(specs, {"n": 5}, 4, "cpu")
    assert len(sets) == 4 and all(s[0].shape == (2, 5) and s[1].dtype == torch.int64 for s in sets)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(sets, again))  # seeded: reproducible
    assert not torch.equal(sets[0][0], sets[1][0])  # distinct tensors, so no set is served from cache
    assert bench.set_bytes(specs, {"n": 5}) == 2 * 5 * 4 + 3 * 8
    assert bench.auto_input_sets(1 << 20, "cpu") == 4


def test_size_cases_vary_each_dynamic_dim_within_its_range():
    spec = IoSpec(dtype="float32", methods={}, dynamic={"seq": DynamicDim(min=2, max=2048)}, example_sizes={"seq": 3})
    assert bench.size_cases(spec, {}) == [{"seq": 3}]
    assert bench.size_cases(spec, bench.parse_sizes(["seq=128,512", "seq=2048"])) == [
        {"seq": 128}, {"seq": 512}, {"seq": 2048}]
    with pytest.raises(ZooError, match="outside the range"):
        bench.size_cases(spec, {"seq": [4096]})
    with pytest.raises(ZooError, match="not a dynamic dim"):
        bench.size_cases(spec, {"batch": [2]})
    with pytest.raises(ZooError, match="bad --sizes"):
        bench.parse_sizes(["seq128"])


# --------------------------------------------------------------------------------------------------------
# Rendering


def _record(median, peak=None):
    return {"stats": {"median": median, "p10": median * 0.9, "p90": median * 1.2, "mean": median, "stdev": 0.1,
                      "n": 50}, "peak_bytes": peak}


def test_markdown_and_json_tables_show_ratios_and_misses(tmp_path):
    cands = {"artifact": _record(8.1, 300 * 2**20), "eager": _record(10.0, 200 * 2**20), "compile": _record(7.0)}
    method = {"method": "forward", "sizes": {"seq": 128}, "candidates": cands, "what": {"eager": "op by op"},
              "agreement": {"artifact": {"worst_rel_l2": 8.7e-3, "min_cosine": 0.99996, "outputs": 1}}}
    method.update(bench.judge_method(cands))
    result = {"name": "llama-rope", "environment": {"gpu": "NVIDIA H200", "torch": "2.11.0", "cuda": "13.0",
                                                    "executorch": "1.2.0"},
              "settings": {"runs": 50, "warmup": 10, "timer": "cuda_events"}, "methods": [method],
              "export_cost": {"export": 5.9, "lower": 262.0, "verify": None},
              "artifact_sizes": {"model.pte": 3 * 2**20}, "inf_value": math.inf,
              "copy_bandwidth": {"gbps": 4000.0, "bytes": 2 << 30},
              "rotary": [{"case": "wide", "shape": [2, 8192, 24, 128], "dtype": "bfloat16",
                          "eager": {"stats": _record(2.0)["stats"]}, "pairs": {"stats": _record(0.5)["stats"]},
                          "speedup": 4.0, "pairs_gbps": 2240.0, "target": judge_at_least(0.56, 0.70)}]}
    md = bench.render(result, markdown=True)
    row = next(line for line in md.splitlines() if line.startswith("| forward"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:5] == ["forward", "seq=128", "8.100 [7.290-9.720]", "10.000 [9.000-12.000]", "7.000 [6.300-8.400]"]
    assert cells[5] == "0.81 missed by 16%"  # 0.81 / 0.70
    assert cells[6] == "1.16 missed by 10%"  # 8.1 / 7.0 = 1.157 vs 1.05
    assert cells[7:10] == ["300.0", "200.0", "1.50 missed by 50%"]
    assert cells[10] == "rel L2 8.7e-03, cos 0.99996"
    assert "NVIDIA H200" in md and "| lower | 262.0 |" in md and "| size of model.pte | 3.0 MiB |" in md
    assert "- forward (seq=128) artifact/eager: missed by 16% (0.81 > 0.70)" in md
    rotary = next(line for line in md.splitlines() if line.startswith("| wide"))
    assert [c.strip() for c in rotary.strip("|").split("|")][5:] == ["4.00x", "2240.0", "56.0% missed by 20%"]
    assert "- rotary wide: fraction of copy bandwidth missed by 20% (0.56 < 0.70)" in md
    assert "device copy bandwidth 4000.0 GB/s" in md
    text = bench.render(result, markdown=False)
    assert "|" not in text and "0.81 missed by 16%" in text

    bench.write_results(result, tmp_path / "b.json", tmp_path / "b.md")
    back = json.loads((tmp_path / "b.json").read_text())
    assert back["inf_value"] is None  # JSON has no inf
    assert back["methods"][0]["targets"]["artifact/compile"]["ok"] is False
    assert (tmp_path / "b.md").read_text().startswith("# zoo bench: llama-rope")


# --------------------------------------------------------------------------------------------------------
# The rotary microbenchmark


def _complex128_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Independent reference: interleaved pairs as complex128 times e^{i angle}, in double precision."""
    b, length, h, d = x.shape
    z = torch.complex(x[..., 0::2].double(), x[..., 1::2].double())
    rot = torch.polar(torch.ones_like(angles), angles)[:length].view(1, length, 1, d // 2)
    out = z * rot
    return torch.stack([out.real, out.imag], dim=-1).flatten(3)


@pytest.fixture(scope="module")
def rope_program():
    angles = angle_table(6, 8)
    module = ComplexRope(angles)
    return angles, module, rewritten_rope(module, torch.randn(2, 6, 3, 8))


def test_rewritten_rope_is_real_pairs_and_matches_complex128(rope_program):
    angles, module, program = rope_program
    assert not any(v.is_complex() for v in list(program.state_dict.values()) + list(program.constants.values()))
    x = torch.randn(2, 6, 3, 8, generator=torch.Generator().manual_seed(1))
    got = program.module()(x)
    ref = _complex128_rope(x, angles)
    assert got.dtype == torch.float32
    assert float((got.double() - ref).norm() / ref.norm()) < 1e-6  # float32 table and maths


def test_rotation_of_a_hand_worked_case():
    # Pair 0 turns by pi/2: (1, 0) -> (0, 1); pair 1 by pi: (0, 1) -> (0, -1).
    module = ComplexRope(torch.tensor([[math.pi / 2, math.pi]], dtype=torch.float64))
    x = torch.tensor([1.0, 0.0, 0.0, 1.0]).view(1, 1, 1, 4)
    program = rewritten_rope(module, x)
    out = program.module()(x).flatten()
    assert torch.allclose(out, torch.tensor([0.0, 1.0, 0.0, -1.0]), atol=1e-6)


def test_rope_bytes_hand_worked():
    # x [2, 3, 4, 8] bf16: 384 bytes read + 384 written; table 3 rows x 4 pairs x 2 x float32 = 96.
    assert rope_bytes((2, 3, 4, 8), torch.bfloat16) == 864
    assert rope_bytes((1, 2048, 9, 64), torch.float32) == 2 * 2048 * 9 * 64 * 4 + 2048 * 32 * 2 * 4


def test_rotary_case_on_cpu_reports_bandwidth_fraction_and_agreement():
    case = RotaryCase("tiny", (2, 16, 4, 8), "float32")
    r = bench_case(case, "cpu", runs=5, warmup=1, copy_gbps=2.0, compile=False, input_sets=2)
    assert r["bytes_per_call"] == rope_bytes(case.shape, torch.float32)
    seconds = r["pairs"]["stats"]["median"] * 1e-3
    assert r["pairs_gbps"] == pytest.approx(r["bytes_per_call"] / seconds / 1e9)
    assert r["copy_fraction"] == pytest.approx(r["pairs_gbps"] / 2.0)
    assert r["target"]["limit"] == 0.70 and r["target"]["ok"] is (r["copy_fraction"] >= 0.70)
    assert r["agreement"]["rel_l2"] < 1e-6  # rewritten pairs vs complex64 eager, both float32
    assert "not compiled" in r["pairs"]["what"]


def test_parse_case():
    assert parse_case("2,8192,24,128").shape == (2, 8192, 24, 128)
    for bad in ("2,8192,24", "2,8192,24,127", "a,b,c,d", "0,1,1,2"):
        with pytest.raises(ZooError, match="bad rotary shape"):
            parse_case(bad)


# --------------------------------------------------------------------------------------------------------
# python -m zoo bench on a saved run folder (CPU: eager only, the artifact needs CUDA)


class TinyRopeUnit(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.rope = ComplexRope(angle_table(16, 8))

    def forward(self, x):
        return self.rope(self.proj(x))


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("bench-run")
    torch.manual_seed(0)
    module = TinyRopeUnit().eval()
    seq = torch.export.Dim("seq", min=2, max=16)
    with torch.no_grad():
        ep = torch.export.export(module, (torch.randn(1, 5, 3, 8),), dynamic_shapes=({1: seq},), strict=False)
    torch.export.save(ep, str(run_dir / "exported.forward.pt2"))
    rewritten = replace_complex_with_real(ep, complex128_as="float32")
    assert rewritten.changed and not rewritten.declined
    torch.export.save(rewritten.program, str(run_dir / "rewritten.forward.pt2"))
    io_spec = {"format": 1, "dtype": "float32", "dynamic": {"seq": {"min": 2, "max": 16}}, "example_sizes": {"seq": 5},
               "methods": {"forward": {"inputs": [{"name": "x", "dtype": "float32", "shape": [1, "seq", 3, 8],
                                                   "sampler": "normal"}], "outputs": ["y"]}}}
    (run_dir / "io_spec.json").write_text(json.dumps(io_spec))
    (run_dir / "recipe.yaml").write_text("name: tiny-rope\nfamily: llama\n")
    (run_dir / "report.json").write_text(json.dumps({"stages": [
        {"stage": "export", "status": "done", "seconds": 1.5}, {"stage": "rewrite", "status": "done", "seconds": 0.5},
        {"stage": "lower", "status": "skipped", "seconds": None}]}))
    return run_dir


def test_main_benches_eager_of_a_run_folder_on_the_cpu(run_folder, tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = bench.main([str(run_folder), "--device", "cpu", "--no-compile", "--runs", "4", "--warmup", "1",
                       "--sizes", "seq=4,16", "--input-sets", "2", "--json", str(out),
                       "--markdown", str(tmp_path / "bench.md")])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["name"] == "tiny-rope" and result["format"] == bench.FORMAT
    assert [m["sizes"] for m in result["methods"]] == [{"seq": 4}, {"seq": 16}]
    for m in result["methods"]:
        assert m["candidates"]["eager"]["stats"]["n"] == 4
        assert m["candidates"]["artifact"] == {"skipped": "the artifact runs only on a CUDA device"}
        assert m["candidates"]["compile"] == {"skipped": "--no-compile"}
    assert result["export_cost"]["export"] == 1.5 and result["export_cost"]["lower"] is None
    assert "seq=16" in capsys.readouterr().out


def test_main_refuses_bad_input(run_folder, tmp_path):
    with pytest.raises(ZooError, match="does not exist"):
        bench.main([str(tmp_path / "nowhere"), "--device", "cpu"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ZooError, match="no io_spec.json"):
        bench.main([str(tmp_path / "empty"), "--device", "cpu"])
    with pytest.raises(ZooError, match="no method 'nope'"):
        bench.main([str(run_folder), "--device", "cpu", "--methods", "nope"])
    with pytest.raises(ZooError, match="--runs 0"):
        bench.main([str(run_folder), "--device", "cpu", "--runs", "0"])
    with pytest.raises(ZooError, match="outside the range"):
        bench.main([str(run_folder), "--device", "cpu", "--sizes", "seq=99"])
    with pytest.raises(ZooError, match="not a device"):
        bench.main([str(run_folder), "--device", "tpu"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for machines without a GPU")
def test_main_without_a_gpu_says_so(run_folder):
    with pytest.raises(NoGpuError, match="CUDA GPU"):
        bench.main([str(run_folder)])


def test_zoo_command_line_dispatches_bench(run_folder, tmp_path):
    from zoo.__main__ import main as zoo_main

    code = zoo_main(["bench", str(run_folder), "--device", "cpu", "--no-compile", "--runs", "2", "--warmup", "0",
                     "--input-sets", "1", "--json", str(tmp_path / "b.json"), "--markdown", str(tmp_path / "b.md")])
    assert code == 0 and (tmp_path / "b.md").read_text().count("| forward |") == 1
    assert zoo_main(["bench", str(tmp_path / "nowhere"), "--device", "cpu"]) == ZooError.exit_code


# --------------------------------------------------------------------------------------------------------
# zoo.bench.seeded: the real-size benchmarks' unit selection (its seeded weights: tests/test_fast_init.py)


def test_real_size_units_parse_sizes_and_methods():
    parse = parse_unit
    assert parse("llama:128,512").sizes == [128, 512]
    assert parse("llama").sizes == [128, 512, 2048]
    assert parse("fast_wam").methods == ["action_step"]
    assert parse("fast_wam:prefill,action_step").methods == ["prefill", "action_step"]
    assert parse("lingbot_va").methods is None  # every method of the recipe
    with pytest.raises(ZooError, match="unknown unit 'llama3'"):
        parse("llama3")
    with pytest.raises(ZooError, match="takes sequence lengths"):
        parse("llama:long")


def test_a_tiny_or_cpu_chunk_timing_is_refused_for_zoos_own_table(tmp_path):
    # Model cards quote zoo/data/chunk_latency.json: a tiny recipe's timing must not land there.
    from zoo.contract.chunk_latency import MEASURED_JSON

    before = MEASURED_JSON.read_bytes() if MEASURED_JSON.exists() else None
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_chunk.py"
    done = subprocess.run([sys.executable, str(script), "--tiny", "--device", "cpu", "--backend", "eager",
                           "--out", str(tmp_path / "out"), "--record"], capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    assert "takes only the artifact runner on a GPU at real size" in done.stderr
    assert not (tmp_path / "out").exists()
    assert (MEASURED_JSON.read_bytes() if MEASURED_JSON.exists() else None) == before


# --------------------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_events_see_known_work_ratio():
    a = torch.randn(2048, 2048, device="cuda")
    b = torch.randn(4096, 4096, device="cuda")
    timer = bench.CudaEventTimer()
    small = measure(lambda _: a @ a, [None], warmup=3, runs=20, timer=timer)
    large = measure(lambda _: b @ b, [None], warmup=3, runs=20, timer=timer)
    # 8x the flops; small matmuls use the GPU less fully, so the ratio lands between 4 and 10.
    assert 4.0 < large.median / small.median < 10.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_time_leaves_out_the_host_and_sees_known_work():
    from zoo.bench.measuring import measure_device_time

    x = [torch.randn(8 << 20, device="cuda") for _ in range(2)]  # 32 MiB each

    def slow_host_one_add(t):
        time.sleep(0.002)  # 2 ms of host work per call: queued timing would report it, device time must not
        return t + 1

    one, how = measure_device_time(slow_host_one_add, x, warmup=2, runs=10, device="cuda")
    four, _ = measure_device_time(lambda t: t + 1 + 2 + 3 + 4, x, warmup=2, runs=10, device="cuda")
    assert how.startswith("cuda_graph_replay") and one.median < 0.5  # a 64 MB add is ~20 us on a big GPU
    assert 3.0 < four.median / one.median < 5.0  # four element-wise passes over the same bytes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_top_kernels_name_the_kernel_that_takes_the_time():
    a, small = torch.randn(4096, 4096, device="cuda"), torch.randn(64, device="cuda")
    rows = bench.top_kernels(lambda args: [args[0] @ args[0], small + 1], [[a]], calls=3)
    kinds = [r for r in rows if r["kernel"].startswith("[")]
    total, first = rows[0], [r for r in rows[1:] if not r["kernel"].startswith("[")][0]
    assert total["kernel"] == "(all kernels)" and total["launches_per_call"] >= 2
    assert kinds[0]["kernel"] == "[gemm]" and kinds[0]["share"] > 0.9
    assert "gemm" in first["kernel"].lower() or "sgemm" in first["kernel"].lower() or "cutlass" in first["kernel"].lower()
    assert first["share"] > 0.9 and first["launches_per_call"] == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rotary_on_gpu_compiled_pairs_agree_and_report_a_fraction():
    from zoo.bench.rotary import run_rotary

    out = run_rotary("cuda", runs=10, warmup=3, cases=[RotaryCase("gpu", (2, 1024, 8, 64))], copy_bytes=256 << 20)
    r = out["rotary"][0]
    assert out["copy_bandwidth"]["gbps"] > 0 and 0 < r["copy_fraction"]
    assert r["agreement"]["cosine"] > 0.9999  # bf16 results of the same float32 maths


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bench_of_a_lowered_tiny_run_times_the_artifact(run_folder, tmp_path, test_recipe):
    from zoo.export.lower.lowering import lower_to_pte

    run_dir = tmp_path / "run"
    shutil.copytree(run_folder, run_dir)
    recipe = test_recipe("toy-rope", "lowering.triton_kernel_mode=OFF", "lowering.max_mm_configs=1")
    lower_to_pte({"forward": torch.export.load(str(run_dir / "rewritten.forward.pt2"))}, run_dir, recipe)
    assert bench.main([str(run_dir), "--runs", "5", "--warmup", "2", "--sizes", "seq=4,16"]) == 0
    result = json.loads((run_dir / bench.BENCH_JSON).read_text())
    for m in result["methods"]:
        art = m["candidates"]["artifact"]
        assert art["stats"]["n"] == 5 and art["peak_bytes"] > 0
        assert m["agreement"]["artifact"]["worst_rel_l2"] < 1e-5  # float32 pairs vs complex64 eager
        assert m["ratios"]["artifact/eager"] > 0 and m["ratios"]["artifact/compile"] > 0
    assert result["artifact_sizes"]["model.pte"] > 0


@pytest.mark.parametrize("name, kind", [
    # Names from the profile of a LingBot-VA artifact and of cuBLAS/cuDNN, classified by hand.
    ("_sdpa_fwd_kernel_m32", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", "attention"),
    ("triton_tem_fused_addmm_gelu_t_view_57", "gemm"),
    ("nvjet_sm90_tst_144x64_64x4_1x2_h_bz_coopA_NTN", "gemm"),
    ("triton_tem_fused_convolution_3", "convolution"),
    ("triton_poi_fused_stack_50", "copy"),  # the io KV pool written whole
    ("triton_poi_fused__to_copy_add_index_copy_select_stack_sub_view_copy_47", "copy"),
    ("Memcpy DtoD (Device -> Device)", "copy"),
    ("triton_red_fused__to_copy_add_mul_native_layer_norm_permute_copy_slice", "other"),  # a cast is no copy
    ("triton_poi_fused_transpose_copy_51", "other"),  # an ExecuTorch view op, fused
])
def test_kernel_kind_reads_what_a_kernel_does_from_its_name(name, kind):
    assert bench.kernel_kind(name) == kind


def test_kernel_rows_list_each_candidates_top_kernels():
    kernels = [{"kernel": "(all kernels)", "ms_per_call": 2.0, "launches_per_call": 12, "share": 1.0},
               {"kernel": "triton_sdpa", "ms_per_call": 1.5, "launches_per_call": 1, "share": 0.75}]
    results = [{"method": "forward", "unit": "llama", "sizes": {"seq": 2048},
                "candidates": {"artifact": {"top_kernels": kernels}, "eager": {"stats": {}}}}]
    rows = bench.kernel_rows(results)
    assert rows[1:] == [["llama: forward", "seq=2048", "artifact", "(all kernels)", "2.000", "12", "100%"],
                        ["llama: forward", "seq=2048", "artifact", "triton_sdpa", "1.500", "1", "75%"]]
