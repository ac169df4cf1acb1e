"""The baseline split and its per-round oracle, against brute force.

Accepted lengths are checked against enumerating every accept/reject outcome of a round,
group shares and means against plain loops, and the oracle's exact MAL against walking
each greedy rollout round by round (which first reproduces the evaluator's own MAL for a
single drafter, so the walk's conventions are the evaluator's)."""

from __future__ import annotations

import itertools

import pytest
import torch

from blockdraft.evaluation.lookup_split import (
    accepted_lengths,
    group_index,
    group_labels,
    lookup_split,
    per_round_oracle,
)
from blockdraft.evaluation.offline import offline_stats

K = 5


def _greedy_rollouts(seed: int, n: int = 12) -> list[torch.Tensor]:
    """0/1 acceptance tensors `[L-1, K]` of random lengths, slot-1 acceptance ~ 0.6."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        rows = int(torch.randint(1, 40, (1,), generator=g))
        out.append((torch.rand(rows, K, generator=g) < 0.6).double())
    return out


def _walk(acc: list[torch.Tensor], pick=None) -> float:  # type: ignore[no-untyped-def]
    """MAL by decoding each rollout round by round at T = 0: a round at position n accepts
    the leading accepted proposals that exist (n + h <= L), then the target's token; `pick`
    chooses, per round, which of several acceptance tensors proposes."""
    tokens = rounds = 0
    for r in range(len(acc[0] if pick else acc)):
        rows = [a[r] for a in acc] if pick else [acc[r]]
        length = rows[0].shape[0] + 1
        tokens += length - 1
        n = 1
        while n <= length - 1:
            counts = []
            for row in rows:
                c = 0
                while c < K and n + c + 1 <= length and row[n - 1, c] > 0.5:
                    c += 1
                counts.append(c)
            n += (max(counts) if pick else counts[0]) + 1
            rounds += 1
    return tokens / rounds


def test_the_walk_reproduces_the_evaluators_mal():
    acc = _greedy_rollouts(0)
    assert _walk(acc) == pytest.approx(offline_stats(acc).mal, rel=1e-12)


def test_oracle_mal_equals_taking_the_longer_prefix_each_round():
    base, other = _greedy_rollouts(1), _greedy_rollouts(2)
    for b, o in zip(base, other, strict=True):  # same rollouts: same lengths
        o.resize_(b.shape).copy_((torch.rand(b.shape) < 0.5).double())
    oracle = offline_stats(per_round_oracle(base, other)).mal
    assert oracle == pytest.approx(_walk([base, other], pick=True), rel=1e-12)
    assert oracle > max(offline_stats(base).mal, offline_stats(other).mal)  # not vacuous here


def test_accepted_length_is_the_expected_prefix_over_all_outcomes():
    g = torch.Generator().manual_seed(3)
    acc = torch.rand(10, 4, generator=g, dtype=torch.float64)
    for i in range(6):  # round starts with all 4 proposals inside the rollout
        expected = 0.0
        for outcome in itertools.product([0, 1], repeat=4):
            p = 1.0
            for a, o in zip(acc[i].tolist(), outcome, strict=True):
                p *= a if o else 1 - a
            prefix = next((j for j, o in enumerate(outcome) if not o), 4)
            expected += p * prefix
        assert float(accepted_lengths(acc)[i]) == pytest.approx(expected, rel=1e-12)


def test_proposals_past_the_end_do_not_count():
    """The last round starts have fewer than K tokens left; whatever the tensor holds past
    them (the scorer clamps positions there) is not accepted."""
    acc = torch.ones(4, K, dtype=torch.float64)  # 5 tokens: starts with 4, 3, 2, 1 left
    assert accepted_lengths(acc).tolist() == [4.0, 3.0, 2.0, 1.0]


def test_groups_shares_and_means_match_plain_loops():
    base, drafted = _greedy_rollouts(4), _greedy_rollouts(5)
    for b, d in zip(base, drafted, strict=True):
        d.resize_(b.shape).copy_((torch.rand(b.shape) < 0.7).double())
    split = lookup_split([base, drafted], ["ngram", "d"])
    starts = [
        (b[i], d[i], b.shape[0] - i)
        for b, d in zip(base, drafted, strict=True)
        for i in range(b.shape[0])
    ]

    def lead(row: torch.Tensor, left: int) -> int:
        return next((j for j, a in enumerate(row.tolist()[:left]) if a < 0.5), min(K, left))

    groups = {}
    for b, d, left in starts:
        n = lead(b, left)
        label = "0" if n == 0 else "1-3" if n <= 3 else "4" if n < K else str(K)
        groups.setdefault(label, []).append((n, lead(d, left)))
    assert split["round_starts"] == len(starts)
    assert {g["baseline_accepts"] for g in split["groups"]} == set(groups)
    for g in split["groups"]:
        members = groups[g["baseline_accepts"]]
        mean = [sum(m[i] for m in members) / len(members) for i in (0, 1)]
        assert g["share"] == pytest.approx(len(members) / len(starts))
        assert g["mean_accepted"]["ngram"] == pytest.approx(mean[0])
        assert g["mean_accepted"]["d"] == pytest.approx(mean[1])


def test_group_labels_name_what_each_group_holds():
    assert group_labels(7) == ["0", "1-3", "4-6", "7"]
    assert group_labels(5) == ["0", "1-3", "4", "5"]
    assert group_labels(3) == ["0", "1-2", "", "3"]
    lengths = torch.tensor([0.0, 1.0, 2.0, 3.0])
    assert group_index(lengths, 3).tolist() == [0, 1, 1, 3]
