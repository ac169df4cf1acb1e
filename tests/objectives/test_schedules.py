"""Fixed schedules: DFlash decay and its gamma rule, uniform weights."""

from __future__ import annotations

import math

import pytest
import torch

from blockdraft.objectives import decay_weights, default_decay_gamma, uniform_weights


def test_decay_is_exp_of_minus_j_minus_one_over_gamma() -> None:
    w = decay_weights(15, 7.0, dtype=torch.float64)
    expected = [math.exp(-(j - 1) / 7.0) for j in range(1, 16)]
    assert w.tolist() == pytest.approx(expected, rel=1e-15)
    assert w[0] == 1.0


@pytest.mark.parametrize(("block_size", "gamma"), [(16, 7.0), (10, 5.0), (8, 4.0)])
def test_dflash_published_gammas(block_size: int, gamma: float) -> None:
    assert default_decay_gamma(block_size) == gamma


def test_gamma_interpolates_between_and_extrapolates_beyond_published_points() -> None:
    assert default_decay_gamma(9) == pytest.approx(4.5)
    assert default_decay_gamma(12) == pytest.approx(5 + 2 / 3)  # 2/6 of the way from 5 to 7
    assert default_decay_gamma(4) == pytest.approx(2.0)  # slope 1/2 below 10
    assert default_decay_gamma(22) == pytest.approx(9.0)  # slope 1/3 above 16
    assert default_decay_gamma(2) >= 0.5
    gammas = [default_decay_gamma(b) for b in range(2, 40)]
    assert all(b > a for a, b in zip(gammas, gammas[1:], strict=False))  # strictly increasing


def test_uniform_weights_and_bad_inputs() -> None:
    assert uniform_weights(4).tolist() == [1.0, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="num_proposals"):
        uniform_weights(0)
    with pytest.raises(ValueError, match="gamma"):
        decay_weights(3, -1.0)
    with pytest.raises(ValueError, match="gamma"):
        decay_weights(3, float("nan"))
    with pytest.raises(ValueError, match="block_size"):
        default_decay_gamma(1)
