"""The command lines: `python -m zoo list`, `python -m zoo.export` end to end on the tiny recipes (CPU, no
network), and every kind of bad input exiting non-zero with a clear message and nothing half-written."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

import zoo.__main__ as zoo_main
from zoo.cli import export as zoo_export
from zoo.export import pipeline
from zoo.contract.recipes import load_recipe, recipe_names

from support.environment import TEST_RECIPES

FAILED_RUN = ["export.log", "recipe.yaml", "report.json", "report.md"]  # all a failed run leaves in its folder


def toy(name: str) -> str:
    return str(TEST_RECIPES / f"{name}.yaml")


def files(folder: Path):
    return sorted(p.name for p in folder.iterdir())


# --------------------------------------------------------------------------------------------------------
# python -m zoo list / dispatch


def test_list_shows_every_recipe(capsys):
    assert zoo_main.main(["list"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["name", "family", "hub", "id", "methods", "dtype", "notes"]
    for name in recipe_names():
        recipe = load_recipe(name)
        row = next(line for line in lines if line.split()[0] == name)
        assert recipe.source.repo_id in row and recipe.unit.methods[0] in row and recipe.unit.dtype in row


def test_list_pattern(capsys):
    assert zoo_main.main(["list", "*-tiny"]) == 0
    # Notes wrap onto continuation lines, which start blank: a row starts with its name.
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()[2:] if not line.startswith(" ")]
    assert names == recipe_names(pattern="*-tiny") and names


def test_list_pattern_without_match(capsys):
    assert zoo_main.main(["list", "nothing-like-this*"]) == 2
    assert "error: no recipe matches 'nothing-like-this*'" in capsys.readouterr().err


def test_no_command_prints_help(capsys):
    assert zoo_main.main([]) == 2
    out = capsys.readouterr().out
    for command in ("list", "export", "lower", "audit", "publish", "bundle"):
        assert command in out


def test_missing_command_module_is_explained(monkeypatch, capsys):
    monkeypatch.setitem(zoo_main.DELEGATES, "frobnicate", ("zoo.no_such_module", "main", "test"))
    assert zoo_main.main(["frobnicate", "x"]) == 2
    err = capsys.readouterr().err
    assert "`python -m zoo frobnicate` is not available" in err and "zoo.no_such_module" in err


def test_zoo_export_delegates(monkeypatch):
    seen = {}

    def fake_main(argv, prog):
        seen.update(argv=argv, prog=prog)
        return 7

    monkeypatch.setattr(zoo_export, "main", fake_main)
    assert zoo_main.main(["export", "llama-rope-tiny", "unit.dtype=bfloat16", "--output-dir", "x"]) == 7
    assert seen == {"argv": ["llama-rope-tiny", "unit.dtype=bfloat16", "--output-dir", "x"],
                    "prog": "python -m zoo export"}


# --------------------------------------------------------------------------------------------------------
# python -m zoo.export: bad input


def test_unknown_recipe(tmp_path, capsys):
    assert zoo_export.main(["llama-rope-tinny", "--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "error: unknown recipe 'llama-rope-tinny'" in err
    assert "did you mean: llama-rope-tiny" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override, words", [
    ("unit.dtyp=bfloat16", "did you mean unit.dtype"),
    ("verify.seeds=abc", "verify.seeds takes a list of int, not 'abc'"),
    ("unit.dtype=float16", "unit.dtype='float16' is not allowed"),
])
def test_bad_override(tmp_path, capsys, override, words):
    assert zoo_export.main([toy("toy-rope"), override, "--output-dir", str(tmp_path / "run")]) == 2
    assert words in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_repo_not_in_cache_while_offline(tmp_path, capsys, toy_family):
    # HF_HUB_OFFLINE=1 and an empty cache (tests/support/environment.py): a recipe that pulls instead of fabricating.
    run = tmp_path / "run"
    code = zoo_export.main([toy("toy-rope"), "source.fabricate=false", "source.revision=v7", "--output-dir", str(run)])
    captured = capsys.readouterr()
    assert code == 2
    assert "error: 'zoo-test/toy-rope' at revision 'v7' is not in the Hub cache" in captured.err
    assert "python -m zoo bundle" in captured.err and "source.local_dir=" in captured.err
    assert re.search(r"^pull\s+failed", captured.out, re.M)  # the summary table names the failed stage
    assert files(run) == FAILED_RUN
    assert json.loads((run / "report.json").read_text())["failed_stage"] == "pull"


def test_ctrl_c_exits_130_and_leaves_no_half_written_files(tmp_path, capsys, toy_family, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "cpu_check", interrupted)
    run = tmp_path / "run"
    assert zoo_export.main([toy("toy-pool"), "--output-dir", str(run)]) == 130
    err = capsys.readouterr().err
    assert "interrupted during cpu_check (Ctrl-C)" in err and "Traceback" not in err
    assert files(run) == FAILED_RUN
    assert json.loads((run / "report.json").read_text())["status"] == "interrupted"
    md = (run / "report.md").read_text()
    assert md.splitlines()[2] == "**Status: interrupted during cpu_check (Ctrl-C)**"
    assert f"- next: `{sys.executable} -m zoo.export" in md or "- next: `python -m zoo.export" in md


def test_unknown_method_is_refused_before_anything_is_fabricated_or_written(tmp_path, capsys, toy_family,
                                                                          monkeypatch):
    from zoo.export import tiny_hub

    run = tmp_path / "run"
    run.mkdir()
    (run / "report.json").write_text('{"status": "verified", "stages": []}')  # an earlier run, to keep
    monkeypatch.setattr(tiny_hub, "fabricate", lambda *a, **k: pytest.fail("fabricated before the refusal"))
    assert zoo_export.main([toy("toy-pool"), "unit.methods=[nope]", "--output-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert "unit.methods=['nope']" in err and "set unit.methods: ['write', 'read']" in err
    assert files(run) == ["report.json"] and not list(tmp_path.glob(".run.*"))


def test_export_toy_recipe_prints_summary(tmp_path, capsys, toy_family):
    run = tmp_path / "run"
    # Options may sit between the overrides.
    assert zoo_export.main([toy("toy-pool"), "--output-dir", str(run), "verify.seeds=[5]"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^cpu_check\s+done", out, re.M) and re.search(r"^lower\s+skipped", out, re.M)
    assert f"run folder: {run.resolve()}  (done)" in out
    assert f"python -m zoo lower {run.resolve()}" in out
    assert "seeds:\n  - 5" in (run / "recipe.yaml").read_text()  # the resolved recipe, override applied


# --------------------------------------------------------------------------------------------------------
# The tiny recipes end to end, as the README runs them (subprocess, offline, CPU): each exported once for the
# session (support/shared_runs.py), the runner tests read the same runs


def check_finished_run(run: Path, methods) -> dict:
    data = json.loads((run / "report.json").read_text())
    assert data["status"] == "done"
    assert {s["stage"]: s["status"] for s in data["stages"]}["cpu_check"] == "done"
    assert data["cpu_check"]["passed"] and data["cpu_check"]["failed"] == 0
    for name in ("recipe.yaml", "source.json", "io_spec.json", "host_settings.json", "report.md"):
        assert (run / name).is_file(), name
    for method in methods:
        assert (run / f"exported.{method}.pt2").is_file() and (run / f"rewritten.{method}.pt2").is_file()
    assert len(json.loads((run / "source.json").read_text())["commit"]) == 40
    return data


@pytest.mark.policies
def test_llama_rope_tiny_end_to_end(tiny_runs):
    # The README's main job, run once for the session as the README writes it, in a fresh clone.
    exported = tiny_runs("llama-rope-tiny")
    exported.check_exported()
    run = exported.path
    assert re.search(r"^cpu_check\s+done", exported.stdout, re.M)
    assert f"python -m zoo lower {run.resolve()}" in exported.stdout
    data = check_finished_run(run, ["forward"])
    # No action loop, no policy to check: said on the CPU and for the GPU.
    assert data["policy_check"]["cpu"]["status"] == data["policy_check"]["gpu"]["status"] == "not applicable"
    # What was saved runs: the rewritten program agrees with the exported one on fresh tokens.
    exported = torch.export.load(str(run / "exported.forward.pt2"))
    rewritten = torch.export.load(str(run / "rewritten.forward.pt2"))
    tokens = torch.randint(0, 256, (1, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = exported.module()(tokens), rewritten.module()(tokens)
    assert a.shape == (1, 37, 256)
    assert float((a.double() - b.double()).norm() / a.double().norm()) <= 1e-5


@pytest.mark.policies
@pytest.mark.parametrize("recipe", ["lingbot-va-tiny", "fast-wam-tiny"])
def test_policy_tiny_recipes_end_to_end(tiny_runs, recipe):
    exported = tiny_runs(recipe)
    exported.check_exported()
    run = exported.path
    data = check_finished_run(run, load_recipe(recipe).unit.methods)
    assert list((run / "processors").iterdir())  # LeRobot's normalisation processors travel with the run
    # The policy check: the eager runner against LeRobot's select_action, 3 whole chunks and one more action.
    assert {s["stage"]: s["status"] for s in data["stages"]}["policy_check"] == "done"
    check = data["policy_check"]["cpu"]
    assert check["passed"] and check["rule"] == "float32" and len(check["rows"]) == 4
    assert all(row["ok"] and row["rel_l2"] <= 1e-5 for row in check["rows"])
    # Chunks grouped as the runner predicts them (the recipes' action chunks), and the table says so.
    steps = {"lingbot-va-tiny": [12, 16, 16, 1], "fast-wam-tiny": [32, 32, 32, 1]}[recipe]
    assert [row["steps"] for row in check["rows"]] == steps and "chunk" in check["table"]
    assert re.search(r"^policy_check\s+done", exported.stdout, re.M)
    # What LeRobot and diffusers print as they load (a print() to stdout, a logger configured on import, before
    # the run's log exists) goes to the run's log, not the terminal.
    terminal, log = exported.stdout + exported.stderr, (run / "export.log").read_text()
    for line in ("Loading weights from local directory", "Unable to import `torchao` Tensor objects"):
        assert line not in terminal and line in log, line


# --------------------------------------------------------------------------------------------------------
# Corrupted llama checkpoints: wrong type, missing/mismatched/truncated weights


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    from zoo.policies.llama import unit as llama

    recipe = load_recipe("llama-rope-tiny")
    repos = llama.fabricate_checkpoint(recipe, tmp_path_factory.mktemp("llama"))
    return repos[recipe.source.repo_id]


def corrupted(llama_checkpoint: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "ckpt"
    shutil.copytree(llama_checkpoint, folder)
    return folder


def rewrite_tensors(folder: Path, change) -> str:
    """Apply ``change(tensors) -> name`` to model.safetensors; return the name of the tensor it touched."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    name = change(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return name


def export_local(folder: Path, run: Path, capsys):
    code = zoo_export.main(["llama-rope-tiny", f"source.local_dir={folder}", "--output-dir", str(run)])
    captured = capsys.readouterr()
    assert code == 2, captured.err
    assert files(run) == FAILED_RUN  # nothing half-written: no programs, no io_spec
    report = json.loads((run / "report.json").read_text())
    assert report["status"] == "failed"
    return captured.err, report


@pytest.mark.policies
def test_wrong_policy_type(llama_checkpoint, tmp_path, capsys):
    folder = corrupted(llama_checkpoint, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="bert", architectures=["BertModel"])
    (folder / "config.json").write_text(json.dumps(config))
    err, report = export_local(folder, tmp_path / "run", capsys)
    assert "error:" in err and "bert" in err and "model_type" in err
    assert report["failed_stage"] == "build"


@pytest.mark.policies
def test_missing_tensor(llama_checkpoint, tmp_path, capsys):
    folder = corrupted(llama_checkpoint, tmp_path)

    def drop(tensors):
        name = sorted(n for n in tensors if ".layers.1." in n)[0]
        del tensors[name]
        return name

    name = rewrite_tensors(folder, drop)
    err, report = export_local(folder, tmp_path / "run", capsys)
    assert "error:" in err and name in err and "missing" in err
    assert report["failed_stage"] == "build"


@pytest.mark.policies
def test_mismatched_tensor_shape(llama_checkpoint, tmp_path, capsys):
    folder = corrupted(llama_checkpoint, tmp_path)

    def shrink(tensors):
        name = sorted(n for n in tensors if n.endswith("mlp.up_proj.weight"))[0]
        tensors[name] = tensors[name][:-1].contiguous()  # one output row short
        return name

    name = rewrite_tensors(folder, shrink)
    err, _ = export_local(folder, tmp_path / "run", capsys)
    assert "error:" in err and name in err and "shape" in err


@pytest.mark.policies
def test_truncated_weights(llama_checkpoint, tmp_path, capsys):
    folder = corrupted(llama_checkpoint, tmp_path)
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    err, _ = export_local(folder, tmp_path / "run", capsys)
    assert "error:" in err and "model.safetensors" in err


@pytest.mark.policies
def test_local_dir_without_weights(llama_checkpoint, tmp_path, capsys):
    folder = corrupted(llama_checkpoint, tmp_path)
    (folder / "model.safetensors").unlink()
    err, report = export_local(folder, tmp_path / "run", capsys)
    assert "lacks model.safetensors" in err and report["failed_stage"] == "pull"
