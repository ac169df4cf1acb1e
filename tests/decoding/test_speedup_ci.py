"""`speedup_and_ci`: the decode's wall-clock speedup and its bootstrap CI over prompts,
checked against direct sums and an independent numpy bootstrap."""

from __future__ import annotations

import math

import numpy as np
import pytest

from blockdraft.decoding.result import speedup_and_ci


def _prompts(n: int, seed: int = 0) -> tuple[list[float], ...]:
    rng = np.random.default_rng(seed)
    spec_tokens = rng.integers(20, 64, n).astype(float)
    ar_tokens = spec_tokens.copy()  # T = 0: the same text
    ar_seconds = ar_tokens * rng.uniform(0.4e-3, 0.6e-3, n)
    spec_seconds = spec_tokens * rng.uniform(0.3e-3, 1.0e-3, n)  # tau differs per prompt
    return spec_tokens.tolist(), spec_seconds.tolist(), ar_tokens.tolist(), ar_seconds.tolist()


def test_point_is_the_ratio_of_tokens_per_second() -> None:
    st, ss, at, as_ = _prompts(8)
    point, (lo, hi) = speedup_and_ci(st, ss, at, as_)
    assert point == pytest.approx((sum(st) / sum(ss)) / (sum(at) / sum(as_)), rel=1e-12)
    assert lo < point < hi  # prompts differ, so the interval has width


def test_interval_matches_an_independent_bootstrap() -> None:
    """Percentiles of 20,000 numpy resamples of prompts (another RNG, another code path)
    agree with ours to Monte Carlo error (~1% of the width at this n_boot)."""
    st, ss, at, as_ = _prompts(10, seed=3)
    _, (lo, hi) = speedup_and_ci(st, ss, at, as_, n_boot=20_000, seed=1)
    cols = np.array([st, ss, at, as_]).T
    rng = np.random.default_rng(7)
    idx = rng.integers(0, len(st), size=(20_000, len(st)))
    sums = cols[idx].sum(axis=1)  # [n_boot, 4]
    ratios = (sums[:, 0] / sums[:, 1]) / (sums[:, 2] / sums[:, 3])
    ref_lo, ref_hi = np.quantile(ratios, [0.025, 0.975])
    width = ref_hi - ref_lo
    assert abs(lo - ref_lo) < 0.03 * width and abs(hi - ref_hi) < 0.03 * width


def test_identical_prompts_give_a_point_interval_and_units_do_not_matter() -> None:
    point, (lo, hi) = speedup_and_ci([40] * 5, [0.02] * 5, [40] * 5, [0.03] * 5)
    assert point == pytest.approx(1.5) and lo == pytest.approx(1.5) and hi == pytest.approx(1.5)
    st, ss, at, as_ = _prompts(8, seed=5)
    a = speedup_and_ci(st, ss, at, as_, seed=2)
    b = speedup_and_ci(st, [1e3 * x for x in ss], at, [1e3 * x for x in as_], seed=2)
    assert a[0] == pytest.approx(b[0]) and a[1] == pytest.approx(b[1])


def test_one_prompt_has_no_interval_and_no_time_is_an_error() -> None:
    point, (lo, hi) = speedup_and_ci([10], [0.01], [10], [0.02])
    assert point == pytest.approx(2.0) and math.isnan(lo) and math.isnan(hi)
    with pytest.raises(ValueError, match="timed"):
        speedup_and_ci([10], [0.0], [10], [0.02])
    with pytest.raises(ValueError, match="timed"):
        speedup_and_ci([], [], [], [])
