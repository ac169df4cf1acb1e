"""Round-start (anchor) sub-sampling for long rollouts (METHODS.md §2, "Anchors").

Each round start n needs its own drafter block, so for long rollouts only a subset of
at most `max_anchors` starts carries gradient. Starts are drawn with probability
proportional to their round-start occupancy `omega_{n,n+1}` (capped at 1), and the
sampled rows are weighted by `1 / pi_n` (Horvitz-Thompson), which keeps both the loss
and its gradient unbiased.

Why PPS on occupancy: every term of row n of the EDR loss and of its gradient carries
the factor `omega_{n,n+1}`, so rows that are rarely round starts matter little; rows with
zero occupancy contribute exactly zero and are never drawn (no bias). The last row
(n = L-1) is not a candidate either: its only proposal drafts x_L, which is emitted
whatever happens, so it carries no gradient and no share of the objective (`row_value`
is 0 there; J's leading 1 is charged to no row), and a drafter block spent on it would
be wasted (`round_start_candidates`). The design is systematic sampling over a random
permutation: it returns exactly `min(max_anchors, #candidates with positive occupancy)`
distinct rows and each row's inclusion probability is exactly `pi_n`.

`sample_round_starts_uniformly` is the alternative that needs no occupancies (simple
random sampling, `pi_n = m / N`), so the gradient pass can score the sampled rows itself
(`objective.anchor_sampler: uniform`, `training/edr_step.py`): cheaper steps, noisier
gradients.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def inclusion_probabilities(size: Tensor, max_anchors: int) -> Tensor:
    """`pi_n = min(1, c * size_n)` with c chosen so that `sum pi = min(max_anchors,
    #positive)`; float64 `[L-1]`."""
    if size.dim() != 1:
        raise ValueError(f"round_start_occupancy must be 1-D [L-1], got shape {tuple(size.shape)}")
    if isinstance(max_anchors, bool) or not isinstance(max_anchors, int) or max_anchors < 1:
        raise ValueError(f"max_anchors must be a positive int, got {max_anchors!r}")
    w = size.detach().to(torch.float64)
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError("round_start_occupancy must be finite and non-negative")
    positive = w > 0
    m = min(max_anchors, int(positive.sum()))
    pi = torch.zeros_like(w)
    if m == 0:
        return pi
    if m == int(positive.sum()):  # every reachable start fits: take all of them
        return positive.to(torch.float64)
    capped = torch.zeros_like(positive)
    while True:
        free = positive & ~capped
        scale = (m - int(capped.sum())) / w[free].sum()
        over = free & (w * scale >= 1)
        if not bool(over.any()):
            pi[free] = w[free] * scale
            pi[capped] = 1.0
            return pi.clamp(max=1.0)
        capped |= over


def round_start_candidates(round_start_occupancy: Tensor) -> Tensor:
    """PPS sizes of the round-start rows `[L-1]`: the occupancy, float64, with the dead
    last row (n = L-1, no gradient, no share of J) set to 0 so it is never drawn."""
    size = round_start_occupancy.detach().to(torch.float64).clone()
    if not bool(torch.isfinite(size).all()) or bool((size < 0).any()):
        raise ValueError("round_start_occupancy must be finite and non-negative")
    if size.dim() == 1 and size.numel():
        size[-1] = 0.0
    return size


def sample_round_starts(
    round_start_occupancy: Tensor, max_anchors: int, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Draw at most `max_anchors` round starts (0-based rows of the `[L-1, K]` tensors),
    never the last row (module docstring).

    Returns `(indices [m] long, sorted; inclusion_weights [m] = 1 / pi)` with
    `pi = inclusion_probabilities(round_start_candidates(occupancy), max_anchors)`.
    Scatter the weights into a dense `[L-1]` vector (zeros elsewhere, see
    `dense_row_weights`) and pass it as `row_weights` to `edr_surrogate`."""
    if round_start_occupancy.dim() != 1:
        raise ValueError(
            f"round_start_occupancy must be 1-D [L-1], got shape "
            f"{tuple(round_start_occupancy.shape)}"
        )
    pi = inclusion_probabilities(round_start_candidates(round_start_occupancy), max_anchors)
    device = round_start_occupancy.device
    m = int(round(float(pi.sum())))
    if m == 0:
        return torch.zeros(0, dtype=torch.long, device=device), torch.zeros(
            0, dtype=torch.float64, device=device
        )
    perm = torch.randperm(pi.numel(), generator=generator, device="cpu")
    cum = torch.cumsum(pi.cpu()[perm], dim=0)
    u = torch.rand((), generator=generator, dtype=torch.float64, device="cpu")
    points = u + torch.arange(m, dtype=torch.float64)
    pos = torch.searchsorted(cum, points, right=True).clamp(max=pi.numel() - 1)
    idx = torch.unique(perm[pos])  # sorted; duplicates only possible through rounding
    weights = 1.0 / pi.cpu()[idx]
    dtype = (
        round_start_occupancy.dtype if round_start_occupancy.is_floating_point() else torch.float32
    )
    return idx.to(device), weights.to(
        device=device, dtype=torch.promote_types(dtype, torch.float32)
    )


def sample_round_starts_uniformly(
    num_candidates: int, max_anchors: int, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Draw `min(max_anchors, num_candidates)` of the rows `0 .. num_candidates-1`
    uniformly without replacement: `(indices [m] long, sorted; inclusion_weights [m] =
    num_candidates / m)`, float64, on the CPU.

    Why a second sampler: PPS on occupancy needs the occupancies *before* it draws, so a
    no-grad pass must score every round start and the sampled rows are then drafted a
    second time with gradient. Drawing first without looking at the rollout lets the
    gradient pass score the sampled rows and the no-grad pass only the others; the
    Horvitz-Thompson weights (every row's inclusion probability is exactly m / N) keep
    loss and gradient unbiased all the same, at the variance of simple random sampling.
    Callers pass the usable rows only (the dead last row is not a candidate)."""
    if isinstance(max_anchors, bool) or not isinstance(max_anchors, int) or max_anchors < 1:
        raise ValueError(f"max_anchors must be a positive int, got {max_anchors!r}")
    if (
        isinstance(num_candidates, bool)
        or not isinstance(num_candidates, int)
        or num_candidates < 0
    ):
        raise ValueError(f"num_candidates must be a non-negative int, got {num_candidates!r}")
    m = min(max_anchors, num_candidates)
    idx = torch.randperm(num_candidates, generator=generator)[:m].sort().values
    return idx, torch.full((m,), num_candidates / m if m else 0.0, dtype=torch.float64)


def dense_row_weights(indices: Tensor, inclusion_weights: Tensor, num_rows: int) -> Tensor:
    """`[num_rows]` vector with `inclusion_weights` at `indices` and 0 elsewhere."""
    if indices.shape != inclusion_weights.shape or indices.dim() != 1:
        raise ValueError("indices and inclusion_weights must be 1-D tensors of the same length")
    out = torch.zeros(num_rows, dtype=inclusion_weights.dtype, device=inclusion_weights.device)
    out[indices] = inclusion_weights
    return out
