"""EDR, Expected Decoding Rounds (docs/methods.md, "EDR"): the public import point.

Split by concern: `acceptance.py` (per-proposal acceptance A and cost c from logits),
`recursion.py` (occupancy / value recursions, the exact objective), `kernels.py` and
`reference.py` (those recursions compiled, and as a readable torch reference),
`round_starts.py` (round-start sub-sampling with inverse-inclusion weights), and here the
TD-form training loss `edr_surrogate`. A training step imports this package, never its
modules (tests/test_structure.py): what it needs is exported here. Layouts:
docs/architecture.md ("objectives").
"""

from __future__ import annotations

import torch

from blockdraft.objectives.edr.acceptance import (
    acceptance_and_cost,
    candidate_scores,
    greedy_soft_from_logprobs,
    sampling_scores_and_moments,
    support_scores,
    target_support,
)
from blockdraft.objectives.edr.recursion import (
    as_batch,
    expected_rounds,
    occupancy_and_value,
    pad_rollouts,
    proposal_masks,
    rounds_objective,
    state_occupancy,
)
from blockdraft.objectives.edr.round_starts import (
    dense_row_weights,
    draw_scored_round_starts,
    gradient_sizes,
    greedy_gradient_moments,
    inclusion_probabilities,
    round_start_candidates,
    sample_round_starts,
    sample_round_starts_uniformly,
)

Tensor = torch.Tensor
REDUCTIONS = ("sum", "mean", "none")


def edr_surrogate(
    acceptance: Tensor,
    cost: Tensor,
    row_weights: Tensor | None = None,
    *,
    lengths: Tensor | None = None,
    reduction: str = "sum",
) -> Tensor:
    """TD-form EDR loss whose gradient equals that of the exact rounds objective J.

    Per decision state `(n, t)` with t < L it adds
    `sg(omega_{n,t}) * (c_{n,t} + A_{n,t} * sg(V_{n,t+1} - V_{t,t+1}))` (paper Thm. 2),
    where V_{n,t+1} is the value of the next proposal state, or of the bonus state
    (`1 + V_{t+1,t+2}`) after proposal K; both values are 0 once t+1 = L, so the last
    live proposal of a rollout only gets the immediate-cost gradient. omega and V come
    from `occupancy_and_value` on detached inputs, so no gradient flows through the
    recursions. A detached offset makes the *value* exact as well: without weights the
    result equals J (the expected number of rounds when `c = 1 - A`).

    `row_weights` (`[L-1]`, or `[B, L-1]` for batches) weights
    each round-start row, e.g. `1/pi` on rows drawn by `sample_round_starts` and 0
    elsewhere: value and gradient are then Horvitz-Thompson estimates of J and its
    gradient (each row carries its share `row_value` of J; J's leading 1 is added
    unweighted), unbiased over the draw.
    Rows with weight 0 need valid detached inputs but their gradient is never used.

    Returns a scalar for one rollout; for batches `reduction` picks sum/mean over
    rollouts or the per-rollout `[B]` values (`"none"`)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    acc, cst, lengths, single = as_batch(acceptance, cost, lengths)
    assert cst is not None
    batch, rows, k = acc.shape
    state = occupancy_and_value(acc, cst, lengths)
    _, live = proposal_masks(lengths, rows, k)
    zero = torch.zeros((), dtype=acc.dtype, device=acc.device)
    acc, cst = torch.where(live, acc, zero), torch.where(live, cst, zero)

    # the recursions are float64; the loss terms need only the input dtype
    omega, td = state.occupancy[..., :k].to(acc.dtype), state.td.to(acc.dtype)
    terms = omega * (cst + acc * td)
    row_td = terms.sum(-1)
    row_loss = row_td - row_td.detach() + state.row_value.to(acc.dtype)
    if row_weights is not None:
        weights = torch.as_tensor(row_weights, device=acc.device).detach().to(acc.dtype)
        expected = (rows,) if single else (batch, rows)
        if weights.shape != expected:
            raise ValueError(
                f"row_weights must have shape {expected} (dense, 0 = row not sampled), "
                f"got {tuple(weights.shape)}"
            )
        if not bool(torch.isfinite(weights).all()) or bool((weights < 0).any()):
            raise ValueError("row_weights must be finite and non-negative")
        row_loss = row_loss * weights.view(batch, rows)
    # J's leading 1 (the first round, certain for L >= 2) is charged to no row, so it is
    # never re-weighted and rows without gradient (the last one) can stay unsampled
    per_rollout = row_loss.sum(-1) + (lengths >= 2).to(row_loss.dtype)
    if single:
        return per_rollout[0]
    if reduction == "sum":
        return per_rollout.sum()
    if reduction == "mean":
        return per_rollout.mean()
    return per_rollout


__all__ = [
    "acceptance_and_cost",
    "candidate_scores",
    "greedy_soft_from_logprobs",
    "dense_row_weights",
    "draw_scored_round_starts",
    "gradient_sizes",
    "greedy_gradient_moments",
    "edr_surrogate",
    "expected_rounds",
    "inclusion_probabilities",
    "occupancy_and_value",
    "pad_rollouts",
    "round_start_candidates",
    "rounds_objective",
    "sample_round_starts",
    "sample_round_starts_uniformly",
    "sampling_scores_and_moments",
    "state_occupancy",
    "support_scores",
    "target_support",
]
