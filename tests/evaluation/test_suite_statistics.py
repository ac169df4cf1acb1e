"""The suite's statistics: per-benchmark numbers equal `eval` / `compare`'s, the mean over
benchmarks is the plain mean, and its stratified-bootstrap CI covers the true mean at the
stated rate (Monte Carlo)."""

from __future__ import annotations

import math

import pytest
import torch

from blockdraft.evaluation.offline import mal_ci, offline_stats, paired_comparison
from blockdraft.evaluation.suite_statistics import BenchmarkRounds, suite_statistics


def _acceptances(rollouts: int, k: int, level: float, seed: int) -> list[torch.Tensor]:
    """`rollouts` acceptance tensors; lengths depend on `rollouts` only (the same rollouts
    for every drafter), values on `seed` and `level`."""
    lengths = torch.randint(6, 30, (rollouts,), generator=torch.Generator().manual_seed(rollouts))
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(int(n) - 1, k, generator=g) * level).clamp(0, 1) for n in lengths]


def _bench(accs: list[list[torch.Tensor]]) -> BenchmarkRounds:
    tokens = torch.tensor([float(a.shape[0]) for a in accs[0]], dtype=torch.float64)
    rounds = torch.stack([offline_stats(a).per_rollout_rounds for a in accs])
    return BenchmarkRounds(tokens, rounds)


def test_per_benchmark_numbers_equal_eval_and_compare():
    benches = []
    for b in range(3):
        rollouts = 12 + 5 * b
        benches.append(
            [
                _acceptances(rollouts, 4, lvl, seed=10 * b + i)
                for i, lvl in enumerate((0.6, 0.9, 1.0))
            ]
        )
    st = suite_statistics([_bench(a) for a in benches], n_boot=500, seed=3)
    for b, accs in enumerate(benches):
        for d, acc in enumerate(accs):
            point, ci = mal_ci(acc, n_boot=500, seed=3)
            assert st.mal[b][d] == pytest.approx(point, rel=1e-12)
            assert st.mal_ci95[b][d] == pytest.approx(ci, rel=1e-12)
        c = paired_comparison(accs[0], accs[2], n_boot=500, seed=3)
        g = st.gain(0, 2, b)
        assert g.rel == pytest.approx(c.rel_gain, rel=1e-12)
        assert g.rel_ci95 == pytest.approx(c.rel_gain_ci95, rel=1e-12)
    for d in range(3):
        assert st.mean[d] == pytest.approx(sum(st.mal[b][d] for b in range(3)) / 3, rel=1e-12)
    g = st.gain(0, 1)
    assert g.rel == pytest.approx(st.mean[1] / st.mean[0] - 1, rel=1e-12)
    lo, hi = st.mean_ci95[1]
    assert lo < st.mean[1] < hi


def test_a_drafter_against_itself_gains_exactly_zero():
    acc = _acceptances(20, 3, 0.8, seed=1)
    st = suite_statistics([_bench([acc, acc])], n_boot=300)
    assert st.gain(0, 1).rel_ci95 == (0.0, 0.0)
    assert st.gain(0, 1, 0).rel_ci95 == (0.0, 0.0)


def test_mean_ci_covers_the_true_mean_at_about_95_percent():
    """Rollouts i.i.d. per benchmark with tokens t ~ U{20..59} and rounds t * u,
    u ~ U(lo_b, hi_b) independent of t, so benchmark b's MAL (a ratio of expectations) is
    exactly 1 / E[u] = 2 / (lo_b + hi_b); the 95% CI of the mean over benchmarks must cover
    their mean in ~95% of 300 independent suites. Binomial SE at 300 trials is 1.3%; the
    window [0.89, 0.99] is > 4 SE from 0.95 on either side (percentile bootstrap of a ratio
    at R = 40 undercovers slightly)."""
    ranges = [(0.2, 0.5), (0.3, 0.9), (0.5, 0.7)]
    truth = sum(2 / (lo + hi) for lo, hi in ranges) / len(ranges)
    g = torch.Generator().manual_seed(0)
    covered, trials = 0, 300
    for t in range(trials):
        benches = []
        for lo, hi in ranges:
            tokens = torch.randint(20, 60, (40,), generator=g).to(torch.float64)
            u = lo + (hi - lo) * torch.rand(40, generator=g, dtype=torch.float64)
            benches.append(BenchmarkRounds(tokens, (tokens * u)[None]))
        st = suite_statistics(benches, n_boot=400, seed=t)
        lo, hi = st.mean_ci95[0]
        covered += lo <= truth <= hi
    rate = covered / trials
    assert 0.89 <= rate <= 0.99, rate
    assert not math.isnan(rate)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="same drafters"):
        suite_statistics(
            [
                BenchmarkRounds(torch.ones(3), torch.ones(2, 3)),
                BenchmarkRounds(torch.ones(3), torch.ones(1, 3)),
            ]
        )
    with pytest.raises(ValueError, match=r"\[D, R\]"):
        BenchmarkRounds(torch.ones(3), torch.ones(2, 4))
    with pytest.raises(ValueError, match="no drafting rounds"):
        BenchmarkRounds(torch.zeros(3), torch.zeros(1, 3))
