"""Exact offline evaluator: drafter quality on fixed target rollouts.

From each rollout's acceptance tensor `[L-1, K]` (`A = min(1, q/p)` when sampling,
`1[argmax q = x]` when greedy) it computes exact expectations over speculative decoding's
accept/reject randomness given the rollout, without decoding: expected rounds, MAL (a
ratio of sums over the set, like tau), AR_k and T_{>=k}. Every drafter is scored on the
same rollouts, so comparisons are paired (`paired_comparison`, one bootstrap draw for
both). Definitions: docs/methods.md ("The offline evaluator").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from blockdraft.bootstrap_ci import paired_ratio_replicates, percentile_interval, ratio_ci
from blockdraft.objectives.edr.recursion import pad_rollouts, proposal_masks, state_occupancy

Tensor = torch.Tensor


@dataclass(frozen=True)
class OfflineStats:
    """Exact offline statistics of one drafter on a rollout set (module docstring)."""

    num_rollouts: int
    tokens: int
    expected_rounds: float
    mal: float
    ar_k: list[float]
    t_ge_k: list[float]
    per_rollout_rounds: Tensor


@dataclass(frozen=True)
class PairedComparison:
    """Drafter B against drafter A on the same rollouts; `diff = mal_b - mal_a`,
    `rel_gain = mal_b / mal_a - 1`, percentile bootstrap 95% CIs over rollouts."""

    mal_a: float
    mal_b: float
    diff: float
    diff_ci95: tuple[float, float]
    rel_gain: float
    rel_gain_ci95: tuple[float, float]


def _packed(
    acceptances: list[Tensor] | tuple[Tensor, ...], name: str = "acceptances"
) -> tuple[Tensor, Tensor, Tensor]:
    """Pad to `[R, M, K]` float64, check values, return `(acc, lengths, exists)`."""
    if isinstance(acceptances, Tensor) or len(acceptances) == 0:
        raise ValueError(f"{name} must be a non-empty list of [L-1, K] tensors")
    try:
        acc, lengths = pad_rollouts([a.detach().to(torch.float64) for a in acceptances])
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None
    exists, _ = proposal_masks(lengths, acc.shape[1], acc.shape[2])
    used = acc[exists]
    if not bool(torch.isfinite(used).all()) or bool((used < 0).any()) or bool((used > 1).any()):
        raise ValueError(f"{name}: acceptance probabilities must be finite and in [0, 1]")
    acc = torch.where(exists, acc, torch.zeros((), dtype=acc.dtype))
    return acc, lengths, exists


def _rounds(acc: Tensor, lengths: Tensor) -> Tensor:
    with torch.no_grad():
        return state_occupancy(acc, lengths)[..., 0].sum(-1)


def offline_stats(acceptances: list[Tensor]) -> OfflineStats:
    """Expected rounds, MAL, AR_k and T_{>=k} of one drafter over a rollout set."""
    acc, lengths, exists = _packed(acceptances)
    k = acc.shape[2]
    with torch.no_grad():
        omega = state_occupancy(acc, lengths)
    reach = omega[..., :k] * exists
    accepted = reach * acc
    per_rollout = omega[..., 0].sum(-1)
    tokens = int((lengths - 1).clamp_min(0).sum())
    rounds = float(per_rollout.sum())
    reach_k, accepted_k = reach.sum((0, 1)), accepted.sum((0, 1))
    ar = [float(a / r) if r > 0 else math.nan for a, r in zip(accepted_k, reach_k, strict=True)]
    return OfflineStats(
        num_rollouts=len(acceptances),
        tokens=tokens,
        expected_rounds=rounds,
        mal=tokens / rounds if rounds > 0 else math.nan,
        ar_k=ar,
        t_ge_k=[float(v) for v in accepted_k],
        per_rollout_rounds=per_rollout,
    )


def mal_ci(
    acceptances: list[Tensor], n_boot: int = 2000, seed: int = 0, level: float = 0.95
) -> tuple[float, tuple[float, float]]:
    """MAL of one drafter and its percentile bootstrap CI over rollouts."""
    acc, lengths, _ = _packed(acceptances)
    rounds = _rounds(acc, lengths)
    if float(rounds.sum()) <= 0:
        raise ValueError("acceptances: no drafting rounds (every rollout has L = 1)")
    tokens = (lengths - 1).clamp_min(0).to(torch.float64)
    return ratio_ci(tokens, rounds, n_boot=n_boot, seed=seed, level=level)


def paired_comparison(
    acc_a: list[Tensor], acc_b: list[Tensor], n_boot: int = 2000, seed: int = 0
) -> PairedComparison:
    """Compare drafter B with drafter A on the same rollouts (paired bootstrap).

    The two lists must describe the same rollouts (same L per rollout); the drafters may
    have different block sizes K."""
    a, len_a, _ = _packed(acc_a, "acc_a")
    b, len_b, _ = _packed(acc_b, "acc_b")
    if len_a.shape != len_b.shape or not bool((len_a == len_b).all()):
        raise ValueError("acc_a and acc_b must cover the same rollouts (same number and lengths L)")
    rounds_a, rounds_b = _rounds(a, len_a), _rounds(b, len_b)
    if float(rounds_a.sum()) <= 0:
        raise ValueError("no drafting rounds to compare (every rollout has L = 1)")
    tokens = (len_a - 1).clamp_min(0).to(torch.float64)
    mal_a = float(tokens.sum() / rounds_a.sum())
    mal_b = float(tokens.sum() / rounds_b.sum())
    rep_a, rep_b = paired_ratio_replicates(tokens, rounds_a, rounds_b, n_boot=n_boot, seed=seed)
    return PairedComparison(
        mal_a=mal_a,
        mal_b=mal_b,
        diff=mal_b - mal_a,
        diff_ci95=percentile_interval(rep_b - rep_a, 0.95),
        rel_gain=mal_b / mal_a - 1,
        rel_gain_ci95=percentile_interval(rep_b / rep_a - 1, 0.95),
    )
