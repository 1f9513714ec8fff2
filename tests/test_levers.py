"""The lever table (zoo.bench.levers, benchmarks/lever_table.py) on chunk-bench files written by hand: the ratios
are worked out here from the medians, and runs timed with other settings are refused."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

from zoo.bench.levers import Variant, lever_rows, verdict_rows

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "lever_table.py"
SETTINGS = {"chunks": 3, "episodes": 1, "seed": 0, "tiny": False, "seeded": False, "only": "bench"}


def candidate(chunk: float, methods: dict, floors: dict = None) -> dict:
    return {"chunk_ms": {"median": chunk, "p10": chunk, "p90": chunk}, "vs_eager_rel_l2": 5e-3,
            "roofline": {"methods": [{"method": m, "median_ms": ms, "floor_ms": (floors or {}).get(m, 1.0)}
                                     for m, ms in methods.items()]}}


def write_variant(folder: Path, runner: dict, executorch: dict = None, check: dict = None, **settings) -> Path:
    folder.mkdir(parents=True)
    candidates = {"runner": runner} | ({"executorch": executorch} if executorch else {})
    results = {"command": f"bench {folder.name}", "environment": {"gpu": "test GPU"},
               "settings": {**SETTINGS, **settings},
               "policies": [{"policy": "lingbot_va", "status": "done", "candidates": candidates,
                             "ptd_bytes": 3 * 2**20}]}
    (folder / "chunk_latency.json").write_text(json.dumps(results))
    if check is not None:
        (folder / "policy_check.json").write_text(json.dumps({"policies": [{"policy": "lingbot_va",
                                                                            "policy_check": check}]}))
    return folder


def test_each_lever_is_its_median_over_the_baselines(tmp_path):
    base = write_variant(tmp_path / "base", candidate(400.0, {"action_step": 4.0, "video_step": 5.0},
                                                      {"action_step": 0.5}),
                         candidate(500.0, {"action_step": 6.0, "video_step": 7.0}))
    lever = write_variant(tmp_path / "buffer", candidate(300.0, {"action_step": 3.0, "video_step": 5.5}),
                          candidate(450.0, {"action_step": 4.5, "video_step": 7.0}))
    rows = lever_rows([Variant.read("base", base), Variant.read("buffer", lever)], "lingbot_va")
    assert rows[0] == ["candidate", "what", "base ms", "buffer ms", "buffer/base", "floor ms"]
    by = {(r[0], r[1]): r[2:] for r in rows[1:]}
    assert by[("runner", "chunk")] == ["400.000", "300.000", "0.750x", "-"]
    assert by[("runner", "action_step")] == ["4.000", "3.000", "0.750x", "0.500"]
    assert by[("runner", "video_step")] == ["5.000", "5.500", "1.100x", "1.000"]
    assert by[("executorch", "chunk")] == ["500.000", "450.000", "0.900x", "-"]
    assert by[("executorch", "action_step")] == ["6.000", "4.500", "0.750x", "0.500"]


def test_a_lever_that_failed_shows_no_ratio_and_its_check(tmp_path):
    base = write_variant(tmp_path / "base", candidate(400.0, {"action_step": 4.0}),
                         check={"status": "passed", "result": {"pooled": {"rel_l2": 0.019, "bound": 0.024}}})
    broken = tmp_path / "split_kv"
    broken.mkdir()
    (broken / "chunk_latency.json").write_text(json.dumps({
        "command": "bench split_kv", "settings": SETTINGS,
        "policies": [{"policy": "lingbot_va", "status": "failed", "error": "verification failed", "candidates": {}}]}))
    variants = [Variant.read("base", base), Variant.read("split_kv", broken)]
    by = {(r[0], r[1]): r[2:] for r in lever_rows(variants, "lingbot_va")[1:]}
    assert by[("runner", "chunk")] == ["400.000", "-", "-", "-"]
    verdicts = verdict_rows(variants, "lingbot_va")
    assert verdicts[1] == ["base", "done", "3.0", "5.00e-03", "passed", "1.900e-02", "2.400e-02"]
    assert verdicts[2] == ["split_kv", "failed", "-", "-", "not run", "-", "-"]


def run_script(monkeypatch, *args) -> int:
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *args])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    return exit_info.value.code


def test_the_script_writes_the_table_and_refuses_other_settings(tmp_path, monkeypatch, capsys):
    base = write_variant(tmp_path / "base", candidate(400.0, {"action_step": 4.0}))
    lever = write_variant(tmp_path / "buffer", candidate(200.0, {"action_step": 2.0}))
    other = write_variant(tmp_path / "other", candidate(200.0, {"action_step": 2.0}), chunks=4)
    out = tmp_path / "table"
    assert run_script(monkeypatch, "--out", str(out), f"base={base}", f"buffer={lever}") == 0
    assert "| runner | chunk | 400.000 | 200.000 | 0.500x | - |" in (out / "levers.md").read_text()
    assert json.loads((out / "levers.json").read_text())["tables"]["lingbot_va"]["levers"][1][4] == "0.500x"
    assert run_script(monkeypatch, "--out", str(out), f"base={base}", f"other={other}") == 2
    assert "other settings than base (chunks)" in capsys.readouterr().err
    assert run_script(monkeypatch, "--out", str(out), f"base={base}", f"gone={tmp_path / 'gone'}") == 2
    assert "chunk_latency.json is missing" in capsys.readouterr().err


def test_depth_overrides_keep_the_real_width_at_fewer_blocks():
    """The overrides load into the real recipes; Fast-WAM's DiT configs keep every field of LeRobot's defaults
    but the depth (an override replaces a dict whole, so a field left out would be lost)."""
    from lerobot.policies.fastwam.configuration_fastwam import FastWAMConfig

    from zoo.bench.seeded import depth_overrides, fast_wam_config
    from zoo.contract.recipes import load_recipe

    lingbot = load_recipe("lingbot-va", depth_overrides("lingbot_va", load_recipe("lingbot-va"), 4))
    assert lingbot.unit.options.policy_config["num_layers"] == 4
    assert lingbot.unit.options.policy_config["ffn_dim"] == 14336
    fast = load_recipe("fast-wam", depth_overrides("fast_wam", load_recipe("fast-wam"), 3))
    config, defaults = fast_wam_config(fast), FastWAMConfig(base_model_id=None, device="cpu")
    for key in ("video_dit_config", "action_dit_config"):
        assert dict(getattr(config, key)) == {**getattr(defaults, key), "num_layers": 3}
    with pytest.raises(ValueError, match="layers must be >= 1"):
        depth_overrides("lingbot_va", lingbot, 0)
