"""Offline evaluator: brute-force path enumeration, identities, paired bootstrap."""

from __future__ import annotations

import math

import pytest
import torch

from blockdraft.bootstrap_ci import paired_ratio_replicates, percentile_interval, ratio_ci
from blockdraft.evaluation.offline import OfflineStats, mal_ci, offline_stats, paired_comparison
from spec_sim import enumerate_paths


def _rollouts(seed: int, lengths: list[int], k: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand(L - 1, k, generator=gen, dtype=torch.float64) for L in lengths]


def test_stats_match_path_enumeration() -> None:
    k, lengths = 3, [1, 2, 3, 4, 5, 7, 8]
    accs = _rollouts(0, lengths, k)
    stats = offline_stats(accs)
    refs = [
        enumerate_paths(a.tolist(), a.tolist(), L, k) for a, L in zip(accs, lengths, strict=True)
    ]
    rounds = [r["rounds"] for r in refs]
    assert isinstance(stats, OfflineStats) and stats.num_rollouts == len(lengths)
    assert stats.tokens == sum(L - 1 for L in lengths)
    assert stats.per_rollout_rounds.tolist() == pytest.approx(rounds, rel=1e-12)
    assert stats.expected_rounds == pytest.approx(sum(rounds), rel=1e-12)
    assert stats.mal == pytest.approx(stats.tokens / sum(rounds), rel=1e-12)
    for j in range(k):
        reach = sum(r["reach"][j] for r in refs)
        accept = sum(r["accept"][j] for r in refs)
        assert stats.ar_k[j] == pytest.approx(accept / reach, rel=1e-12)
        assert stats.t_ge_k[j] == pytest.approx(accept, rel=1e-12)
    assert all(1.0 <= stats.mal <= k + 1 for _ in [0])


def test_token_identity_and_proposals_that_do_not_exist() -> None:
    """tokens = rounds + sum_k T_{>=k} - E[rounds accepting x_L]; AR_k is NaN when
    proposal k never exists (every rollout shorter than k + 2)."""
    k = 5
    accs = _rollouts(1, [2, 3, 4], k)
    stats = offline_stats(accs)
    assert math.isnan(stats.ar_k[4]) and stats.t_ge_k[4] == 0.0
    assert not math.isnan(stats.ar_k[2])
    accs = _rollouts(2, [10, 8, 6, 2], k)  # small: the path enumeration is exponential
    stats = offline_stats(accs)
    last = 0.0
    for a in accs:
        big_l = a.shape[0] + 1
        ref = enumerate_paths(a.tolist(), a.tolist(), big_l, k)
        last += sum(
            p * a[n - 1, h - 1].item()
            for (n, h), p in ref["visit"].items()
            if h <= k and n + h == big_l
        )
    assert stats.tokens == pytest.approx(
        stats.expected_rounds + sum(stats.t_ge_k) - last, rel=1e-12
    )


def test_ignored_entries_do_not_matter() -> None:
    accs = _rollouts(3, [6, 4], 4)
    noisy = []
    for a in accs:
        b = a.clone()
        n = torch.arange(1, a.shape[0] + 1).view(-1, 1)
        h = torch.arange(1, 5).view(1, -1)
        b[n + h > a.shape[0] + 1] = float("nan")
        noisy.append(b)
    s1, s2 = offline_stats(accs), offline_stats(noisy)
    assert s1.expected_rounds == s2.expected_rounds and s1.ar_k == s2.ar_k


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="non-empty list"):
        offline_stats([])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        offline_stats([torch.full((3, 2), 1.5)])
    with pytest.raises(ValueError, match="rollout 1"):
        offline_stats([torch.rand(3, 2), torch.rand(3, 3)])
    with pytest.raises(ValueError, match="same rollouts"):
        paired_comparison([torch.rand(3, 2)], [torch.rand(4, 2)])


# --- paired bootstrap -------------------------------------------------------------------


def test_identical_drafters_have_zero_difference() -> None:
    accs = _rollouts(4, [40, 25, 60, 12, 33, 50], 4)
    cmp = paired_comparison(accs, [a.clone() for a in accs], n_boot=500, seed=3)
    assert cmp.diff == 0.0 and cmp.rel_gain == 0.0
    assert cmp.diff_ci95 == (0.0, 0.0) and cmp.rel_gain_ci95 == (0.0, 0.0)
    assert cmp.mal_a == pytest.approx(offline_stats(accs).mal)


def test_better_drafter_has_ci_above_zero_and_seed_is_deterministic() -> None:
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(10, 80, (40,), generator=gen).tolist()
    accs = _rollouts(5, lengths, 4)
    better = [a.sqrt() for a in accs]  # elementwise higher acceptance
    cmp = paired_comparison(accs, better, n_boot=1000, seed=0)
    assert cmp.diff > 0 and cmp.diff_ci95[0] > 0 and cmp.rel_gain_ci95[0] > 0
    assert cmp.diff_ci95[0] <= cmp.diff <= cmp.diff_ci95[1]
    assert cmp.rel_gain == pytest.approx(cmp.mal_b / cmp.mal_a - 1)
    assert paired_comparison(accs, better, n_boot=1000, seed=0) == cmp
    worse = paired_comparison(better, accs, n_boot=1000, seed=0)
    assert worse.diff_ci95[1] < 0
    mal, (lo, hi) = mal_ci(accs, n_boot=1000, seed=1)
    assert lo < mal < hi and mal == pytest.approx(cmp.mal_a)


def test_bootstrap_ci_coverage_is_roughly_nominal() -> None:
    """Synthetic population of per-rollout (tokens, rounds): draw 200 samples of 60
    rollouts, count how often the 95% percentile CI covers the population ratio (and the
    paired difference). Binomial SE of the coverage is ~1.5%."""
    gen = torch.Generator().manual_seed(7)
    pop = 20000
    tokens = torch.randint(20, 300, (pop,), generator=gen).double()
    mal_a = 2.0 + 3.0 * torch.rand(pop, generator=gen, dtype=torch.float64)
    mal_b = mal_a * (1.0 + 0.1 * torch.randn(pop, generator=gen, dtype=torch.float64)).clamp(
        0.7, 1.5
    )
    rounds_a, rounds_b = tokens / mal_a, tokens / mal_b
    true_a = float(tokens.sum() / rounds_a.sum())
    true_diff = float(tokens.sum() / rounds_b.sum()) - true_a
    reps, n = 200, 60
    hit_ratio = hit_diff = 0
    for r in range(reps):
        idx = torch.randint(pop, (n,), generator=gen)
        _, (lo, hi) = ratio_ci(tokens[idx], rounds_a[idx], n_boot=400, seed=r)
        hit_ratio += lo <= true_a <= hi
        ra, rb = paired_ratio_replicates(
            tokens[idx], rounds_a[idx], rounds_b[idx], n_boot=400, seed=r
        )
        lo, hi = percentile_interval(rb - ra, 0.95)
        hit_diff += lo <= true_diff <= hi
    assert 0.88 <= hit_ratio / reps <= 0.99, hit_ratio
    assert 0.88 <= hit_diff / reps <= 0.99
