"""On a CUDA machine: the policy check with the **artifact** backend. Each tiny recipe is exported (CPU steps),
lowered, audited and verified (``zoo.lower.lower_run``), then zoo.runner drives the shipped ``.so`` files
through torch's AOTI runner against LeRobot's own policy on the same GPU, over 3 chunks.

* float32 units: per chunk relative L2 <= 1e-4 under full float32 (no TF32). Verification measured 2e-7 to
  3e-6 per method call; a chunk is 10 (Fast-WAM) or 74 (LingBot-VA) calls, each fed the previous one's
  output, so the per-call error may grow along the chunk; the table printed shows the real numbers.
* bf16 units (zoo's bf16 rule, per chunk): the artifact's distance from LeRobot float32 is at most 1.25 x
  LeRobot bf16's own distance from it.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.policies,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

pytest.importorskip("lerobot")

from zoo.numerics import compare  # noqa: E402
from zoo.recipes import load_recipe  # noqa: E402
from zoo.runner import load  # noqa: E402
from zoo.runner.check import ProcessedPolicy, compare_episode, run_episode  # noqa: E402
from zoo.tiny_hub import fabricated_hub  # noqa: E402
from zoo.verify import full_fp32_precision  # noqa: E402

from runner_helpers import export_run  # noqa: E402

TASK = "pick up the black bowl"
CASES = {"fast-wam-tiny": ("fast_wam", 3 * 32 + 1), "lingbot-va-tiny": ("lingbot_va", 12 + 16 + 16 + 1)}
# lingbot-va-tiny's recipe lists only the DiT steps for now; the runner needs the streaming VAE methods too.
METHODS = {"lingbot-va-tiny": ["unit.methods=[video_step,action_step,vae_encode_first,vae_encode]"]}


def observations(name: str, count: int):
    g = torch.Generator().manual_seed(123)
    if name.startswith("fast-wam"):
        return [{"observation.images.image": torch.rand(3, 64, 128, generator=g),
                 "observation.state": torch.randn(8, generator=g), "task": TASK} for _ in range(count)]
    return [{"observation.images.image": torch.rand(3, 64, 64, generator=g),
             "observation.images.image2": torch.rand(3, 64, 64, generator=g), "task": TASK} for _ in range(count)]


def lowered_run(name, overrides, tmp_path):
    from zoo import lower
    from zoo.policies import load_family

    recipe = load_recipe(name, METHODS.get(name, []) + list(overrides))
    run_dir = tmp_path / name
    checkpoint = export_run(recipe, run_dir)
    report = lower.lower_run(run_dir)
    assert report.get("status") == "verified", report.get("error")
    family = load_family(recipe.family)
    with fabricated_hub(recipe):
        policy, pre, post = family.lerobot_policy(checkpoint, recipe, device="cuda")
    prompt = family.embed_prompt(policy, TASK).save(tmp_path / f"{name}.prompt.safetensors")
    return recipe, run_dir, checkpoint, (policy, pre, post), prompt


@pytest.mark.parametrize("name", sorted(CASES))
def test_artifact_runner_matches_lerobot_float32(name, tmp_path):
    _, steps = CASES[name]
    _, run_dir, _, reference, prompt = lowered_run(name, (), tmp_path)
    runner = load(run_dir, backend="artifact", device="cuda")
    runner.load_prompt(prompt)
    obs = observations(name, steps)
    with full_fp32_precision():
        expected = run_episode(ProcessedPolicy(*reference), obs, seed=0)
        result = compare_episode(runner, expected, obs, seed=0, tolerance=1e-4)
    print(result.table())
    assert result.ok, result.table()


@pytest.mark.parametrize("name", sorted(CASES))
def test_artifact_runner_bf16_rule(name, tmp_path):
    from zoo.policies import load_family

    _, steps = CASES[name]
    recipe, run_dir, checkpoint, reference, prompt = lowered_run(name, ("unit.dtype=bfloat16",), tmp_path)
    family = load_family(recipe.family)
    with fabricated_hub(recipe):
        fp32 = family.lerobot_policy(checkpoint, load_recipe(name, METHODS.get(name, [])), device="cuda")
    runner = load(run_dir, backend="artifact", device="cuda")
    runner.load_prompt(prompt)
    obs = observations(name, steps)
    with full_fp32_precision():
        ref32 = run_episode(ProcessedPolicy(*fp32), obs, seed=0)
        eager16 = run_episode(ProcessedPolicy(*reference), obs, seed=0)
        art = compare_episode(runner, ref32, obs, seed=0, tolerance=float("inf"))
    lines = []
    chunks = {}
    start = 0
    for row in art.rows:
        chunks[row.chunk] = range(start, start + row.steps)
        start += row.steps
    for row in art.rows:
        idx = list(chunks[row.chunk])
        eager = compare("eager", torch.stack([eager16[i] for i in idx]), torch.stack([ref32[i] for i in idx]))
        lines.append((row.chunk, row.rel_l2, eager.rel_l2))
    print("\n".join(f"chunk {c}: artifact bf16 vs fp32 {a:.3e}, eager bf16 vs fp32 {e:.3e}" for c, a, e in lines))
    assert all(a <= max(1.25 * e, 1e-5) for _, a, e in lines), lines
