"""Offline expected rounds / MAL vs a simulation of real speculative decoding.

The simulator (`tests/spec_sim.py`) runs the actual algorithm and shares no code with
the recursions. Target and drafters are seeded random tables over (position, previous
tokens), with an EOS token, for a parallel and a semi-AR drafter. Comparisons of
independent means use a two-sided 99% normal CI (z = 2.576) on the difference.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from blockdraft.evaluation.offline import offline_stats
from blockdraft.objectives.edr import (
    acceptance_and_cost,
    expected_rounds,
    occupancy_and_value,
    pad_rollouts,
)
from spec_sim import (
    block_inputs,
    enumerate_rollouts,
    greedy_rollout,
    make_problem,
    sample_rollouts,
    simulate,
)

Z99 = 2.576
EOS = 0


def _mean_se(x: torch.Tensor) -> tuple[float, float]:
    return float(x.mean()), float(x.std() / math.sqrt(x.numel()))


def _ratio_se(num: torch.Tensor, den: torch.Tensor) -> tuple[float, float]:
    """Ratio of sums and its delta-method standard error (i.i.d. units)."""
    r = float(num.sum() / den.sum())
    resid = num - r * den
    return r, float(resid.std() / (den.mean() * math.sqrt(num.numel())))


def _assert_agree(a: tuple[float, float], b: tuple[float, float], what: str) -> None:
    diff, se = a[0] - b[0], math.hypot(a[1], b[1])
    assert abs(diff) <= Z99 * se, (
        f"{what}: {a[0]:.4f} vs {b[0]:.4f}, diff {diff:.4f} > 99% CI half-width {Z99 * se:.4f}"
    )


def _simulate_many(prob, n: int, seed: int, **kw) -> tuple[torch.Tensor, torch.Tensor, list]:
    rng = random.Random(seed)
    runs = [simulate(prob, rng, **kw) for _ in range(n)]
    rounds = torch.tensor([r for r, _, _ in runs], dtype=torch.float64)
    tokens = torch.tensor([len(x) - 1 for _, x, _ in runs], dtype=torch.float64)
    return rounds, tokens, runs


@pytest.mark.parametrize("semi_ar", [False, True], ids=["parallel", "semi-ar"])
def test_sampling_offline_matches_simulation(semi_ar: bool) -> None:
    prob = make_problem(1 + semi_ar, vocab=5, max_len=12, k=3, semi_ar=semi_ar, eos_bias=-2.0)
    n = 4000
    sim_rounds, sim_tokens, runs = _simulate_many(prob, n, seed=10 + semi_ar)
    ends = [x[-1] == EOS for _, x, _ in runs]
    assert 0.15 < sum(ends) / n < 0.85, "the problem should end both at EOS and at max length"

    tokens, lengths = sample_rollouts(prob, n, torch.Generator().manual_seed(20 + semi_ar))
    draft, target, ids = block_inputs(prob, tokens)
    acc, cost = acceptance_and_cost(draft, target, ids, mode="sampling", stop_token_ids=[EOS])
    offline = expected_rounds(acc, lengths)
    rb = occupancy_and_value(acc, cost, lengths).objective  # Rao-Blackwellised cost form
    _assert_agree(_mean_se(sim_rounds), _mean_se(offline), "mean rounds (1 - A)")
    _assert_agree(_mean_se(sim_rounds), _mean_se(rb), "mean rounds (TV cost)")
    _assert_agree(_mean_se(rb - offline), (0.0, 0.0), "paired TV-cost vs 1 - A")
    off_tokens = (lengths - 1).to(torch.float64)
    _assert_agree(_ratio_se(sim_tokens, sim_rounds), _ratio_se(off_tokens, offline), "MAL")
    # the evaluator's MAL is the same ratio of sums
    stats = offline_stats([acc[i, : lengths[i] - 1] for i in range(200)])
    sub_t = offline[:200]
    assert stats.mal == pytest.approx(float(off_tokens[:200].sum() / sub_t.sum()), rel=1e-6)


@pytest.mark.parametrize("semi_ar", [False, True], ids=["parallel", "semi-ar"])
def test_tv_cost_has_the_expectation_of_the_realised_cost(semi_ar: bool) -> None:
    """Exact expectation over all rollouts of a tiny problem (no sampling noise): the
    Rao-Blackwellised cost (with its EOS handling) gives E_x[J] = E_x[expected rounds];
    the simulator's mean agrees with that exact value within a 99% CI."""
    prob = make_problem(7 + semi_ar, vocab=4, max_len=6, k=2, semi_ar=semi_ar, eos_bias=-1.0)
    tokens, lengths, weight = enumerate_rollouts(prob)
    assert weight.sum().item() == pytest.approx(1.0, abs=1e-12)
    draft, target, ids = block_inputs(prob, tokens)
    acc, cost = acceptance_and_cost(draft, target, ids, stop_token_ids=[EOS])
    exact_rounds = float((weight * expected_rounds(acc, lengths)).sum())
    exact_rb = float((weight * occupancy_and_value(acc, cost, lengths).objective).sum())
    assert exact_rb == pytest.approx(exact_rounds, rel=1e-10)
    # the stop-token treatment matters: a plain TV over the whole vocabulary, or the
    # non-stop TV without the 1 / (1 - p(S)) normalisation, is biased
    gap = (torch.softmax(target, -1) - torch.softmax(draft, -1)).clamp_min(0)
    for wrong in (gap.sum(-1), gap[..., 1:].sum(-1)):
        biased = float((weight * occupancy_and_value(acc, wrong, lengths).objective).sum())
        assert abs(biased - exact_rounds) > 1e-3
    sim_rounds, _, _ = _simulate_many(prob, 4000, seed=30 + semi_ar)
    _assert_agree(_mean_se(sim_rounds), (exact_rounds, 0.0), "simulated vs exact mean rounds")


@pytest.mark.parametrize("semi_ar", [False, True], ids=["parallel", "semi-ar"])
def test_greedy_soft_offline_matches_simulation(semi_ar: bool) -> None:
    """Greedy target, drafter sampling from q: acceptance is exactly q(x_t) ("greedy EDR").
    Prompts: x_1 uniform over non-EOS tokens; the offline side averages them exactly."""
    prob = make_problem(
        3 + semi_ar, vocab=6, max_len=14, k=4, semi_ar=semi_ar, eos_bias=-1.0, greedy_margin=1.5
    )
    firsts = list(range(1, prob.vocab))
    rolls = [greedy_rollout(prob, f) for f in firsts]
    tokens = torch.ones(len(rolls), prob.max_len, dtype=torch.long)
    for i, r in enumerate(rolls):
        tokens[i, : len(r)] = torch.tensor(r)
    lengths = torch.tensor([len(r) for r in rolls])
    assert len(set(map(tuple, rolls))) > 1
    draft, _, ids = block_inputs(prob, tokens)
    acc, _ = acceptance_and_cost(draft, None, ids, mode="greedy_soft", stop_token_ids=[EOS])
    offline = expected_rounds(acc, lengths)  # exact per prompt

    rng = random.Random(40 + semi_ar)
    n = 4000
    sim_rounds, sim_tokens = (
        torch.zeros(n, dtype=torch.float64),
        torch.zeros(n, dtype=torch.float64),
    )
    expect = torch.zeros(n, dtype=torch.float64)
    for i in range(n):
        j = rng.randrange(len(firsts))
        rounds, x, _ = simulate(prob, rng, verify="greedy", drafter="sample", first=firsts[j])
        assert x == rolls[j]  # greedy verification reproduces the target's greedy output
        sim_rounds[i], sim_tokens[i], expect[i] = rounds, len(x) - 1, offline[j]
    exact_mean = float(offline.mean())
    _assert_agree(_mean_se(sim_rounds), (exact_mean, 0.0), "greedy mean rounds")
    # paired with the exact value of the drawn prompt: tighter check of the same identity
    _assert_agree(_mean_se(sim_rounds - expect), (0.0, 0.0), "greedy rounds minus exact per prompt")
    exact_mal = float((lengths - 1).sum() / offline.sum())
    _assert_agree(_ratio_se(sim_tokens, sim_rounds), (exact_mal, 0.0), "greedy MAL")


@pytest.mark.parametrize("semi_ar", [False, True], ids=["parallel", "semi-ar"])
def test_greedy_hard_is_exact_per_rollout(semi_ar: bool) -> None:
    """Argmax drafter vs greedy target is deterministic: offline values are the counts."""
    prob = make_problem(
        5 + semi_ar, vocab=6, max_len=16, k=3, semi_ar=semi_ar, eos_bias=-1.0, greedy_margin=2.0
    )
    rng = random.Random(0)
    accs, rounds, per_k = [], [], [0] * prob.k
    for first in range(1, prob.vocab):
        count, x, accepted = simulate(prob, rng, verify="greedy", drafter="argmax", first=first)
        tokens = torch.tensor([x + [1] * (prob.max_len - len(x))])
        draft, _, ids = block_inputs(prob, tokens)
        acc, _ = acceptance_and_cost(draft, None, ids, mode="greedy_hard")
        accs.append(acc[0, : len(x) - 1])
        rounds.append(count)
        for a in accepted:
            for k in range(1, a + 1):
                per_k[k - 1] += 1
    stats = offline_stats(accs)
    assert stats.per_rollout_rounds.tolist() == pytest.approx(rounds, abs=1e-9)
    assert stats.t_ge_k == pytest.approx(per_k, abs=1e-9)
    assert sum(per_k) > 0 and sum(rounds) > len(rounds)
    acc_b, lens = pad_rollouts(accs)
    assert expected_rounds(acc_b, lens).tolist() == pytest.approx(rounds, abs=1e-9)
