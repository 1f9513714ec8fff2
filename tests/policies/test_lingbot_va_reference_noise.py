"""lingbot_va.float32_reference_noise: LeRobot's float32 reference episode draws the bf16 episode's noise.

The independent reference is torch's own bf16 draw after the same seed (what LeRobot's bf16 policy draws,
modeling_lingbot_va.py:756-758), upcast; and the generator's state after it.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lerobot")
pytestmark = pytest.mark.policies

from zoo.policies import load_family  # noqa: E402

lingbot_va = load_family("lingbot_va")
# LeRobot's two draws per chunk in the tiny recipe's shapes (latents, then actions), and one under 16 values
# (torch's CPU normal kernel takes another path below 16).
SHAPES = ((1, 48, 2, 4, 4), (1, 16, 2, 4, 1), (3, 5))


def bf16_draws(seed):
    torch.manual_seed(seed)
    draws = [torch.randn(*shape, dtype=torch.bfloat16) for shape in SHAPES]
    return draws, torch.get_rng_state()


def test_float32_draws_inside_are_the_bf16_draws_upcast_and_use_the_generator_alike():
    expected, state_after = bf16_draws(7)
    torch.manual_seed(7)
    with lingbot_va.float32_reference_noise(torch.bfloat16):
        got = [torch.randn(*SHAPES[0], dtype=torch.float32),   # LeRobot's call: dtype=self.dtype (float32)
               torch.randn(SHAPES[1]),                         # no dtype: the default, float32
               torch.randn(*SHAPES[2], device="cpu")]
        assert torch.equal(torch.get_rng_state(), state_after)
    for g, e in zip(got, expected):
        assert g.dtype == torch.float32 and g.shape == e.shape
        assert torch.equal(g, e.float())
    # Without the hook the float32 draw is other noise: the thing the hook exists for.
    torch.manual_seed(7)
    plain = torch.randn(*SHAPES[0])
    assert not torch.equal(plain, expected[0].float())
    assert torch.nn.functional.cosine_similarity(plain.flatten(), expected[0].float().flatten(), dim=0) < 0.5


def test_an_explicit_generator_and_other_dtypes_are_served_as_asked():
    generator = torch.Generator().manual_seed(3)
    expected = torch.randn(4, 8, generator=generator, dtype=torch.bfloat16)
    torch.manual_seed(5)
    float64 = torch.randn(4, 8, dtype=torch.float64)
    torch.manual_seed(5)
    with lingbot_va.float32_reference_noise(torch.bfloat16):
        assert torch.equal(torch.randn(4, 8, dtype=torch.float64), float64)  # not float32: untouched
        generator.manual_seed(3)
        assert torch.equal(torch.randn(4, 8, generator=generator), expected.float())


def test_torch_randn_is_restored_after_and_on_error():
    original = torch.randn
    with lingbot_va.float32_reference_noise(torch.bfloat16):
        assert torch.randn is not original
    assert torch.randn is original
    with pytest.raises(RuntimeError, match="inside"):
        with lingbot_va.float32_reference_noise(torch.bfloat16):
            raise RuntimeError("inside")
    assert torch.randn is original
