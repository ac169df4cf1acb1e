"""Exact offline evaluator (METHODS.md §3): drafter quality on fixed target rollouts.

Input per rollout: the acceptance tensor `[L-1, K]` of a drafter (layout of
`blockdraft.objectives.edr`; `A = min(1, q/p)` for sampling, `1[argmax q = x]` for
greedy). Everything below is an exact expectation over the accept/reject randomness
of speculative decoding given the rollout -- no decoding is run -- and, because every
drafter is scored on the same rollouts, comparisons between drafters are paired.

Definitions (all totals are over the rollout set):
- `tokens`: tokens emitted by drafting rounds, `sum (L - 1)` (x_1 comes from prefill).
- `expected_rounds`: `sum_rollouts sum_n omega_{n,n+1}`; `mal = tokens / expected_rounds`
  (a ratio of sums, so long rollouts weigh in proportion to their tokens, like tau).
- `ar_k[k-1]`: P(proposal k accepted | proposals 1..k-1 accepted) as a ratio of expected
  counts: `sum omega_{n,n+k} A_{n,n+k} / sum omega_{n,n+k}`, over the rounds in which
  proposal k *exists*, i.e. `n + k <= L` (near the end of a rollout a round has only
  `L - n` proposals: the generation stops at x_L, later proposals are never verified).
  NaN if proposal k never exists.
- `t_ge_k[k-1]`: expected number of rounds (total over the set) that accept at least k
  proposals, `sum omega_{n,n+k} A_{n,n+k}`. `T_{>=0}` would be `expected_rounds`; the
  tokens satisfy `tokens = expected_rounds + sum_k t_ge_k - E[#rounds accepting x_L]`
  (a round that accepts x_L emits no extra token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from blockdraft.bootstrap import paired_ratio_replicates, percentile_interval, ratio_ci
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
