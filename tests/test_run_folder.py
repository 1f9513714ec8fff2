"""The run folder contract (zoo/run_folder.py): every file at its documented place, what is written is what is
read back, a run replaces an earlier one whole, and no other module spells the folder's file names."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest
import torch

from zoo.errors import LoweringError, ZooError
from zoo.report import RunReport
from zoo.run_folder import RunFolder

ROOT = Path(__file__).resolve().parent.parent


def test_every_file_is_where_the_documented_layout_puts_it(tmp_path):
    run = RunFolder(tmp_path)
    layout = {  # README.md and docs/ARCHITECTURE.md, "The run folder"
        run.recipe_file: "recipe.yaml", run.source_file: "source.json", run.io_spec_file: "io_spec.json",
        run.host_settings_file: "host_settings.json", run.processors_dir: "processors",
        run.report_json: "report.json", run.report_md: "report.md", run.manifest_file: "manifest.json",
        run.publish_dir: "publish", run.pte: "model.pte", run.ptd: "aoti_cuda_blob.ptd",
        run.program("exported", "video_step"): "exported.video_step.pt2",
        run.program("reference_fp32", "forward"): "reference_fp32.forward.pt2",
        run.program("rewritten", "forward"): "rewritten.forward.pt2",
        run.so_file("action_step"): "so/action_step.so",
        run.weights_file("action_step"): "so/action_step.weights.blob",
        run.io_order_file("action_step"): "so/action_step.io.json",
    }
    assert {path.relative_to(tmp_path).as_posix(): name for path, name in layout.items()} == \
        {name: name for name in layout.values()}
    with pytest.raises(ValueError, match="program kind"):
        run.program("lowered", "forward")
    assert RunFolder(run) == run and RunFolder(str(tmp_path)).path == tmp_path


def test_what_is_written_is_read_back(tmp_path, test_recipe):
    run = RunFolder(tmp_path / "run")
    recipe = test_recipe("toy-rope", "verify.seeds=[3,4]")
    run.write_recipe(recipe)
    assert run.load_recipe().to_dict() == recipe.to_dict()
    assert run.load_recipe(["verify.seeds=[9]"]).verify.seeds == [9]
    assert run.recipe_dict()["verify"]["seeds"] == [3, 4]
    run.write_io_spec({"methods": {"forward": {"inputs": [], "outputs": ["y"]}}})
    run.write_host_settings({"steps": 4})
    assert run.read_io_spec() == {"methods": {"forward": {"inputs": [], "outputs": ["y"]}}}
    assert run.read_host_settings() == {"steps": 4}
    run.write_io_order("forward", {"input_order": [1, 0], "output_order": [0]})
    assert run.io_order("forward")["input_order"] == [1, 0]

    class Twice(torch.nn.Module):
        def forward(self, x):
            return x * 2

    program = torch.export.export(Twice(), (torch.ones(3),))
    assert run.save_program(program, "rewritten", "forward") == run.program("rewritten", "forward")
    x = torch.arange(3.0)
    assert torch.equal(run.load_program("rewritten", "forward").module()(x), x * 2)

    report = RunReport(run.path, recipe.to_dict())
    report.stage("export", "done", 1.5, "1 method")
    run.write_report(report)
    again = run.read_report()
    assert again.data == json.loads(run.report_json.read_text()) and again.stages[0]["stage"] == "export"
    assert "# zoo run: toy-rope" in run.report_md.read_text()


def test_missing_files_are_clear_errors(tmp_path):
    run = RunFolder(tmp_path)
    with pytest.raises(LoweringError, match="recipe.yaml is missing"):
        run.load_recipe()
    with pytest.raises(LoweringError, match="delegate I/O order of method 'forward' is unknown"):
        run.io_order("forward")
    assert run.read_report().stages == [] and run.recipe_dict() is None and not run.is_run()


def test_host_files_are_copied_flat_and_a_missing_one_is_refused(tmp_path):
    (tmp_path / "ckpt" / "tok").mkdir(parents=True)
    (tmp_path / "ckpt" / "policy_preprocessor.json").write_text("{}")
    (tmp_path / "ckpt" / "tok" / "vocab.txt").write_text("a b")
    run = RunFolder(tmp_path / "run")
    assert run.copy_host_files([tmp_path / "ckpt" / "policy_preprocessor.json", tmp_path / "ckpt" / "tok"]) == [
        "policy_preprocessor.json", "tok"]
    assert (run.processors_dir / "tok" / "vocab.txt").read_text() == "a b"
    with pytest.raises(ZooError, match="does not exist"):
        run.copy_host_files([tmp_path / "ckpt" / "gone.json"])


def test_a_staged_run_replaces_the_folder_whole(tmp_path):
    run = RunFolder(tmp_path / "run").prepare()
    run.path.mkdir()
    run.write_report(RunReport(run.path))
    (run.path / "rewritten.old.pt2").write_bytes(b"old")
    staging = run.new_staging()
    assert staging.path.parent == run.path.parent and staging.name.startswith(".run.partial-")
    staging.write_report(RunReport(staging.path))
    (staging.path / "left-over").write_text("x")
    staging.keep_only(["report.json", "report.md"])
    run.replace_with(staging)
    assert sorted(p.name for p in run.path.iterdir()) == ["report.json", "report.md"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no staging or old copy left behind


def test_prepare_refuses_what_is_not_a_run_and_removes_dead_staging(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ZooError, match="exists and is a file"):
        RunFolder(tmp_path / "file").prepare()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("precious")
    with pytest.raises(ZooError, match="holds no zoo run"):
        RunFolder(tmp_path / "mine").prepare()
    dead, alive = tmp_path / ".run.partial-999999999", tmp_path / f".run.partial-{os.getpid()}"
    dead.mkdir()
    alive.mkdir()
    RunFolder(tmp_path / "run").prepare()
    assert not dead.exists() and alive.exists()


# --------------------------------------------------------------------------------------------------------
# The file names live in zoo/run_folder.py (and the artifact's in zoo/artifact.py) only


NAMES = {"recipe.yaml", "source.json", "io_spec.json", "host_settings.json", "report.json", "report.md",
         "manifest.json", "model.pte", "aoti_cuda_blob.ptd"}
FOLDERS = {"processors", "publish", "so"}  # plain words: spelled as a file name only when joined into a path
FRAGMENTS = (".pt2", ".io.json", ".weights.blob", ".partial-", "*.so")
OWNERS = {"zoo/run_folder.py", "zoo/artifact.py"}
# Where a name is still spelled, and why.
STILL_SPELLED = {
    "zoo/bundle.py": "the offline bundle's own manifest.json: a bundle is not a run folder",
}


def spelled_names(path: Path):
    """String literals in ``path`` that spell a run folder file name: the name itself, a path joined from a
    folder name, or a piece of an f-string or pattern building a file name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in NAMES or (node.value != "." and any(f in node.value for f in FRAGMENTS)
                                       and len(node.value) < 40):
                found.append((node.lineno, node.value))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            if isinstance(node.right, ast.Constant) and node.right.value in FOLDERS:
                found.append((node.lineno, node.right.value))
    return found


def test_no_module_outside_the_run_folder_spells_its_file_names():
    sources = sorted(ROOT.glob("zoo/**/*.py")) + sorted(ROOT.glob("scripts/*.py"))
    spelled = {p.relative_to(ROOT).as_posix(): spelled_names(p) for p in sources}
    spelled = {k: v for k, v in spelled.items() if v and k not in OWNERS}
    assert set(spelled) == set(STILL_SPELLED), {k: v for k, v in spelled.items() if k not in STILL_SPELLED}
    assert spelled_names(ROOT / "zoo" / "run_folder.py")  # the check sees them where they are
