"""Round-start (anchor) sub-sampling: inclusion probabilities and unbiasedness."""

from __future__ import annotations

import math

import pytest
import torch

from blockdraft.objectives.edr import (
    dense_row_weights,
    edr_surrogate,
    gradient_sizes,
    greedy_gradient_moments,
    inclusion_probabilities,
    occupancy_and_value,
    round_start_candidates,
    sample_round_starts,
    sample_round_starts_uniformly,
)


def test_inclusion_probabilities_are_capped_pps() -> None:
    size = torch.tensor([0.0, 5.0, 1.0, 1.0, 0.5, 0.0, 2.0, 0.25], dtype=torch.float64)
    pi = inclusion_probabilities(size, 3)
    assert pi.sum().item() == pytest.approx(3.0, abs=1e-12)
    assert bool((pi <= 1).all()) and pi[0] == 0 and pi[5] == 0
    assert pi[1] == 1.0  # capped
    free = torch.tensor([2, 3, 4, 6, 7])
    ratio = pi[free] / size[free]
    assert torch.allclose(ratio, ratio[0].expand_as(ratio))  # proportional below the cap
    # more anchors than reachable starts: take every reachable start once
    assert inclusion_probabilities(size, 10).tolist() == [float(s > 0) for s in size]


def test_sample_size_and_empirical_inclusion_frequencies() -> None:
    gen = torch.Generator().manual_seed(0)
    size = torch.rand(12, generator=gen, dtype=torch.float64) ** 2
    size[3] = 0.0
    size[5] = 3.0
    size[-1] = 5.0  # the dead last row: would be capped at pi = 1 if it were a candidate
    pi = inclusion_probabilities(round_start_candidates(size), 4)
    assert pi[-1] == 0.0 and pi.sum().item() == pytest.approx(4.0)
    draws = 4000
    counts = torch.zeros(12, dtype=torch.float64)
    for _ in range(draws):
        idx, w = sample_round_starts(size, 4, gen)
        assert idx.numel() == 4 and torch.equal(idx, torch.unique(idx))
        torch.testing.assert_close(w, 1 / pi[idx])
        counts[idx] += 1
    freq = counts / draws
    se = torch.sqrt(pi * (1 - pi) / draws).clamp_min(1e-12)
    assert bool(((freq - pi).abs() <= 4.0 * se + 1e-12).all()), (freq, pi)
    assert counts[3] == 0 and counts[-1] == 0


def test_last_row_is_never_sampled_and_carries_nothing() -> None:
    """Row n = L-1 only drafts x_L: zero gradient and zero share of J, so dropping it
    from the candidates loses nothing; it is never drawn, even when every other row
    would fit (where all rows used to be taken)."""
    gen = torch.Generator().manual_seed(2)
    for length, k, max_anchors in [(2, 3, 1), (3, 1, 1), (9, 2, 3), (12, 4, 20)]:
        acc = torch.rand(length - 1, k, generator=gen, dtype=torch.float64)
        cost = torch.rand(length - 1, k, generator=gen, dtype=torch.float64)
        state = occupancy_and_value(acc, cost)
        assert state.round_start[-1] > 0  # it is a reachable round start ...
        assert state.row_value[-1] == 0  # ... without a share of J
        a = acc.clone().requires_grad_()
        c = cost.clone().requires_grad_()
        ga, gc = torch.autograd.grad(edr_surrogate(a, c), (a, c))
        assert ga[-1].abs().sum() == 0 and gc[-1].abs().sum() == 0  # ... or a gradient
        for _ in range(50):
            idx, w = sample_round_starts(state.round_start, max_anchors, gen)
            assert (length - 2) not in idx.tolist()
            assert idx.numel() == min(max_anchors, length - 2)
        # the HT estimate is still exact when every candidate fits
        if max_anchors >= length - 2:
            weights = dense_row_weights(idx, w, length - 1)
            torch.testing.assert_close(edr_surrogate(acc, cost, weights), state.objective)


def test_anchor_sampled_loss_and_gradient_are_unbiased() -> None:
    """Mean over many anchor draws of the weighted surrogate (value and gradient w.r.t.
    acceptance and cost) matches the full computation within a Bonferroni-corrected
    normal CI (overall ~99%)."""
    gen = torch.Generator().manual_seed(1)
    length, k, max_anchors, draws = 24, 3, 5, 2000
    acc = 0.2 + 0.75 * torch.rand(length - 1, k, generator=gen, dtype=torch.float64)
    cost = torch.rand(length - 1, k, generator=gen, dtype=torch.float64)
    a_full, c_full = acc.clone().requires_grad_(), cost.clone().requires_grad_()
    full = edr_surrogate(a_full, c_full)
    g_acc, g_cost = torch.autograd.grad(full, (a_full, c_full))

    occ = occupancy_and_value(acc, cost).round_start
    weights = torch.stack(
        [
            dense_row_weights(*sample_round_starts(occ, max_anchors, gen), length - 1)
            for _ in range(draws)
        ]
    )
    a_rep = acc.expand(draws, -1, -1).clone().requires_grad_()
    c_rep = cost.expand(draws, -1, -1).clone().requires_grad_()
    losses = edr_surrogate(a_rep, c_rep, weights, reduction="none")  # one estimate per draw
    ga, gc = torch.autograd.grad(losses.sum(), (a_rep, c_rep))
    estimates = torch.cat([losses.detach().unsqueeze(1), ga.flatten(1), gc.flatten(1)], dim=1)
    truth = torch.cat([full.detach().view(1), g_acc.flatten(), g_cost.flatten()])
    mean, se = estimates.mean(0), estimates.std(0) / math.sqrt(draws)
    z = 3.0 + math.sqrt(2 * math.log(truth.numel()))  # conservative Bonferroni bound
    exact = se < 1e-12  # rows that are always taken (pi = 1) or never matter
    assert bool(((mean - truth).abs()[exact] < 1e-10).all())
    assert bool(((mean - truth).abs()[~exact] <= z * se[~exact]).all())
    # the estimates do vary (the test would notice a missing 1/pi weight)
    assert (~exact).sum() > truth.numel() // 2
    unweighted = edr_surrogate(
        a_rep.detach(), c_rep.detach(), (weights > 0).double(), reduction="none"
    )
    assert abs(unweighted.mean().item() - full.item()) > 5 * unweighted.std().item() / math.sqrt(
        draws
    )


def test_sampling_errors() -> None:
    with pytest.raises(ValueError, match="max_anchors"):
        sample_round_starts(torch.ones(4), 0)
    with pytest.raises(ValueError, match="non-negative"):
        sample_round_starts(torch.tensor([1.0, -1.0]), 1)
    with pytest.raises(ValueError, match="1-D"):
        sample_round_starts(torch.ones(2, 2), 1)
    idx, w = sample_round_starts(torch.zeros(0), 3)
    assert idx.numel() == 0 and w.numel() == 0


def test_uniform_sampler_draws_m_distinct_rows_each_with_probability_m_over_n() -> None:
    """Frequencies over 4,000 draws of 3 of 7 rows: every row within 4.5 binomial standard
    errors of 3/7 (Bonferroni over 7 rows: a false alarm ~5e-5), the weights are N/m, and
    too many anchors take every row once with weight 1."""
    gen = torch.Generator().manual_seed(2)
    n, m, draws = 7, 3, 4000
    counts = torch.zeros(n)
    for _ in range(draws):
        idx, w = sample_round_starts_uniformly(n, m, gen)
        assert idx.tolist() == sorted(set(idx.tolist())) and idx.numel() == m
        assert w.tolist() == [n / m] * m
        counts[idx] += 1
    p = m / n
    se = math.sqrt(p * (1 - p) / draws)
    assert bool(((counts / draws - p).abs() < 4.5 * se).all()), (counts / draws).tolist()
    idx, w = sample_round_starts_uniformly(4, 10, gen)
    assert idx.tolist() == [0, 1, 2, 3] and w.tolist() == [1.0] * 4
    assert sample_round_starts_uniformly(0, 2, gen)[0].numel() == 0
    with pytest.raises(ValueError, match="max_anchors"):
        sample_round_starts_uniformly(4, 0)
    with pytest.raises(ValueError, match="num_candidates"):
        sample_round_starts_uniformly(-1, 2)


def test_gradient_sizes_against_a_loop_and_their_floor() -> None:
    """Sizes = 0.9 x the normalised spread sum_h omega ||dc + td dA|| + 0.1 x the
    normalised round-start occupancy, per rollout (checked with plain Python loops, on
    random moments and on greedy EDR's `(A (1 - A))^2 (1, 1, -1)`, where the spread is
    sum_h omega |td - 1| A (1 - A)); a row with positive occupancy but no spread stays
    drawable, a rollout without any spread falls back to the occupancy alone, and rows
    that are never round starts stay 0."""
    g = torch.Generator().manual_seed(3)
    acc = torch.rand(2, 9, 3, generator=g, dtype=torch.float64)
    acc[0, 2] = 1.0  # A (1 - A) = 0 on a whole row: no spread, occupancy share only
    acc[1] = 1.0  # a rollout without any spread
    cost = 1 - acc
    lengths = torch.tensor([10, 7])  # rollout 1 ends early: its rows 6.. are never reached
    state = occupancy_and_value(acc, cost, lengths)
    omega, td = state.occupancy.tolist(), state.td.tolist()
    a2 = torch.rand(2, 9, 3, generator=g, dtype=torch.float64)
    b2 = torch.rand(2, 9, 3, generator=g, dtype=torch.float64)
    cross = (a2 * b2).sqrt() * (2 * torch.rand(2, 9, 3, generator=g, dtype=torch.float64) - 1)
    random_moments = torch.stack([a2, b2, cross], dim=-1)
    a = acc.tolist()
    cases = [
        (random_moments, lambda b, n, h: (float(b2[b, n, h]) + 2 * td[b][n][h] * float(
            cross[b, n, h]) + td[b][n][h] ** 2 * float(a2[b, n, h])) ** 0.5),
        (greedy_gradient_moments(acc), lambda b, n, h: abs(td[b][n][h] - 1) * a[b][n][h] * (
            1 - a[b][n][h])),
    ]  # fmt: skip
    for moments, norm in cases:
        sizes = gradient_sizes(state.occupancy, state.td, moments)
        for b in range(2):
            spread = [sum(omega[b][n][h] * norm(b, n, h) for h in range(3)) for n in range(9)]
            start = [omega[b][n][0] for n in range(9)]
            if sum(spread) > 0:
                expected = [
                    0.9 * s / sum(spread) + 0.1 * o / sum(start)
                    for s, o in zip(spread, start, strict=True)
                ]
            else:
                expected = [o / sum(start) for o in start]
            torch.testing.assert_close(sizes[b], torch.tensor(expected, dtype=torch.float64))
        assert float(sizes[0].sum()) == pytest.approx(1.0)
        # A = 1 everywhere: rounds start only at 0 and 4; no other row is ever a round start
        assert torch.equal(sizes[1] > 0, state.occupancy[1, :, 0] > 0)
        assert (sizes[1] > 0).nonzero().flatten().tolist() == [0, 4]
    assert greedy_gradient_moments(acc)[0, 2].abs().sum() == 0  # no spread: floor only
    assert gradient_sizes(state.occupancy, state.td, greedy_gradient_moments(acc))[0, 2] > 0
    with pytest.raises(ValueError, match="occupancy_share"):
        gradient_sizes(state.occupancy, state.td, random_moments, occupancy_share=0.0)
    with pytest.raises(ValueError, match="must be"):
        gradient_sizes(state.occupancy[..., :3], state.td, random_moments)
