"""On a CUDA machine: the policy check with the **artifact** backend, at tiny size. zoo.runner drives each tiny
run's shipped ``.so`` files through torch's AOTI runner against LeRobot's own policy, eager, on the same GPU,
over 3 action chunks of seeded synthetic observations: the very check ``zoo.export.policy_check`` runs as the
pipeline's ``policy_check_gpu`` stage after verification.

Run folders: ``ZOO_GPU_RUNS=/path/runs`` reuses already-lowered ones (``/path/runs/<recipe>``, e.g. what
``python -m zoo.export fast-wam-tiny --output-dir /path/runs/fast-wam-tiny`` left on this GPU machine; for the
bf16 case ``/path/runs/<recipe>-bf16``, exported with ``unit.dtype=bfloat16``), so a GPU run does not lower
the tiny recipes twice. A recipe whose folder is not there is exported and lowered here, into a temporary folder.

* The same check with ``cuda_graphs=True`` (each method replayed as a CUDA graph, ``zoo.runner.graphs``).
* float32 units: per chunk relative L2 <= ``policy_check.tolerance.gpu_float32`` (1e-4) under full float32 (no
  TF32). Verification measured 2e-7 to 3e-6 per method call; a chunk is 10 (Fast-WAM) or 74 (LingBot-VA) calls,
  each fed the previous one's output, so the per-call error may grow along the chunk; the table printed shows it.
* bf16 units (zoo's bf16 rule, per chunk): the artifact's distance from LeRobot float32 is at most 1.25 x
  LeRobot bf16's own distance from it, with cosine >= 0.99.
* LingBot-VA in the "buffer" layout (``lowering.kv_pool=buffer``, folder ``<recipe>-kv-buffer``): the KV pool is
  buffers inside both DiT methods' ``.so``, one copy shared by torch's AOTI containers
  (``zoo.runtimes.aoti.SharedConstants``); launched and as CUDA graphs, over two episodes on one runner.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.policies,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

pytest.importorskip("lerobot")

from zoo.export import pipeline  # noqa: E402
from zoo.export.policy_check import check_run, checkpoint_in_reach  # noqa: E402
from zoo.contract.recipes import load_recipe  # noqa: E402
from zoo.contract.run_folder import RunFolder  # noqa: E402

from support.run_export import export_run  # noqa: E402

RECIPES = ("fast-wam-tiny", "lingbot-va-tiny")
BF16 = ["unit.dtype=bfloat16"]
KV_BUFFER = ["lowering.kv_pool=buffer", "policy_check.episodes=2"]


def lowered_run(name: str, overrides, tmp_path: Path, label: str = ""):
    """(recipe, run folder): from ZOO_GPU_RUNS when it holds a lowered run of this recipe, else made here."""
    folder = name + (f"-{label}" if label else "-bf16" if overrides else "")
    given = os.environ.get("ZOO_GPU_RUNS")
    if given and RunFolder(Path(given) / folder).pte.is_file():
        run = RunFolder(Path(given) / folder)
        recipe = run.load_recipe()
        assert recipe.name == name and recipe.unit.dtype == ("bfloat16" if "unit.dtype=bfloat16" in overrides
                                                            else "float32"), run.path
        return recipe, run
    recipe = load_recipe(name, list(overrides))
    run = RunFolder(tmp_path / folder)
    export_run(recipe, run.path)
    report = pipeline.lower_run(run.path)
    assert report.get("status") == "verified", report.get("error")
    return recipe, run


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["launched", "cuda-graphs"])
@pytest.mark.parametrize("name", RECIPES)
def test_artifact_runner_matches_lerobot_float32(name, cuda_graphs, tmp_path):
    """With ``cuda_graphs``, every method replayed from its captured graph, the state in the backend's buffers: the
    same LeRobot reference and tolerance."""
    recipe, run = lowered_run(name, (), tmp_path)
    with checkpoint_in_reach(recipe) as checkpoint:
        result = check_run(run, recipe, checkpoint, backend="artifact", device="cuda", cuda_graphs=cuda_graphs)
    print(result.table())
    assert result.rule == "float32" and len(result.rows) == recipe.policy_check.chunks + 1
    assert result.ok, result.table()


@pytest.mark.parametrize("name", RECIPES)
def test_artifact_runner_bf16_rule(name, tmp_path):
    recipe, run = lowered_run(name, BF16, tmp_path)
    with checkpoint_in_reach(recipe) as checkpoint:
        result = check_run(run, recipe, checkpoint, backend="artifact", device="cuda")
    print(result.table())
    assert result.rule == "bf16" and all(r.eager_rel_l2 is not None for r in result.rows)
    assert result.ok, result.table()


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["launched", "cuda-graphs"])
def test_artifact_runner_buffer_layout_shares_the_pool_and_matches_lerobot(cuda_graphs, tmp_path):
    """The export, lowering, verification (each runtime shares the pool by name) and GPU policy check of the
    buffer layout, then the check here: one pool for both methods' containers, the actions LeRobot's."""
    recipe, run = lowered_run("lingbot-va-tiny", KV_BUFFER, tmp_path, label="kv-buffer")
    assert run.read_host_settings().kv_pool.layout == "buffer"
    with checkpoint_in_reach(recipe) as checkpoint:
        result = check_run(run, recipe, checkpoint, backend="artifact", device="cuda", cuda_graphs=cuda_graphs)
    print(result.table())
    assert result.rule == "float32" and len(result.rows) == 2 * (recipe.policy_check.chunks + 1)
    assert result.ok, result.table()
