"""zoo.core.numerics.compare: the metrics every check rests on, against hand-worked values and numpy float64, whatever
the piece size it sums over."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from zoo.core.numerics import PIECE, compare

PIECES = [1, 2, 7, PIECE]


@pytest.mark.parametrize("piece", PIECES)
def test_a_hand_worked_case(piece):
    # diff = (3, -1): |diff| = sqrt(10); |ref| = 5, |got| = 5, got.ref = 20
    c = compare("x", torch.tensor([3.0, 4.0]), torch.tensor([0.0, 5.0]), piece=piece)
    assert c.ok
    assert c.max_abs == 3.0
    assert c.rel_l2 == pytest.approx(math.sqrt(10) / 5, rel=1e-15)
    assert c.cosine == pytest.approx(0.8, rel=1e-15)


@pytest.mark.parametrize("piece", PIECES)
def test_numpy_float64_gives_the_same_metrics(piece):
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(3, 5, 67, generator=gen, dtype=torch.float32)
    got = (ref + 1e-3 * torch.randn(ref.shape, generator=gen)).to(torch.bfloat16)
    c = compare("x", got, ref, piece=piece)
    g, r = got.to(torch.float64).numpy().ravel(), ref.to(torch.float64).numpy().ravel()
    assert c.max_abs == np.abs(g - r).max()
    assert c.rel_l2 == pytest.approx(np.linalg.norm(g - r) / np.linalg.norm(r), rel=1e-12)
    assert c.cosine == pytest.approx(g @ r / (np.linalg.norm(g) * np.linalg.norm(r)), rel=1e-12)


@pytest.mark.parametrize("piece", PIECES)
def test_a_non_finite_value_where_the_reference_is_finite_fails(piece):
    got = torch.tensor([1.0, float("nan"), 2.0, float("inf")])
    c = compare("x", got, torch.tensor([1.0, 1.0, 2.0, float("inf")]), piece=piece)
    assert not c.ok and c.why == "2 non-finite values (NaN/Inf) where the reference is finite"


@pytest.mark.parametrize("piece", PIECES)
def test_non_finite_values_the_reference_shares_are_left_out(piece):
    # Only (1, 2) against (1, 4) counts: diff (0, -2), |ref| = sqrt(17), |got| = sqrt(5), got.ref = 9.
    got = torch.tensor([1.0, float("nan"), 2.0])
    c = compare("x", got, torch.tensor([1.0, float("nan"), 4.0]), piece=piece)
    assert c.ok and c.max_abs == 2.0
    assert c.rel_l2 == pytest.approx(2 / math.sqrt(17), rel=1e-15)
    assert c.cosine == pytest.approx(9 / math.sqrt(5 * 17), rel=1e-15)


def test_a_shape_mismatch_fails():
    c = compare("x", torch.zeros(2, 3), torch.zeros(3, 2))
    assert not c.ok and "shape (2, 3) != reference (3, 2)" in c.why


def test_empty_and_identical_outputs_agree_exactly():
    assert (compare("x", torch.zeros(0), torch.zeros(0)).rel_l2, compare("x", torch.zeros(0), torch.zeros(0)).cosine) \
        == (0.0, 1.0)
    c = compare("x", torch.zeros(4), torch.zeros(4))
    assert (c.max_abs, c.rel_l2, c.cosine, c.ok) == (0.0, 0.0, 1.0, True)
