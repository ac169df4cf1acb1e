"""Round-start (anchor) sub-sampling for long rollouts (docs/methods.md, "EDR").

Each round start needs its own drafter block, so in long rollouts at most `max_anchors` of
them carry gradient: drawn by systematic PPS sampling (exactly min(max_anchors, #drawable)
distinct rows, each with inclusion probability exactly pi_n) on sizes, either the
round-start occupancy or `gradient_sizes` (estimated row gradient norms, the default), or
uniformly (`sample_round_starts_uniformly`, which needs no occupancies). Sampled rows are
weighted by `1 / pi_n`, so loss and gradient stay unbiased; the last round start (it only
drafts x_L) is never a candidate. Why each choice: docs/methods.md ("EDR").
`draw_scored_round_starts` is what a training step asks for: the PPS draw of every long
rollout from its detached scores.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from blockdraft.objectives.edr.recursion import occupancy_and_value, state_occupancy

Tensor = torch.Tensor
SCORED_SAMPLERS = ("gradient", "occupancy")


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


def greedy_gradient_moments(acceptance: Tensor) -> Tensor:
    """`[..., K, 3]` logit-gradient moments (`||dA||^2`, `||dc||^2`, `<dA, dc>`) of greedy
    EDR's proposals (`A = q(x)`, `c = 1 - A`), from the acceptance alone: `dc = -dA` and
    `||d q(x) / d logits|| = q(x) ||e_x - q||` lies between `A (1 - A)` and `sqrt(2) A
    (1 - A)`, so `(A (1 - A))^2 (1, 1, -1)` (stop tokens, whose cost is 0, are treated
    like the others: sizes change only the variance)."""
    a = acceptance.detach().to(torch.float64)
    spread = (a * (1 - a)) ** 2
    return torch.stack([spread, spread, -spread], dim=-1)


def gradient_sizes(
    occupancy: Tensor, td: Tensor, moments: Tensor, occupancy_share: float = 0.1
) -> Tensor:
    """PPS sizes `[..., L-1]` for the `gradient` round-start sampler: a `1 -
    occupancy_share` share proportional to `sum_h omega_{n,n+h} ||dc_{n,h} + td_{n,h}
    dA_{n,h}||` (logit space) plus an `occupancy_share` share proportional to the
    round-start occupancy, per rollout.

    Why: the sampled estimate's variance is smallest when rows are drawn in proportion
    to the norm of their gradient, and row n's gradient is `sum_h omega_{n,n+h} (grad
    c_{n,h} + td_{n,h} grad A_{n,h})` (`edr_surrogate`). Its logit-space part comes from
    the recursion outputs the occupancy sampler already has (`occupancy_and_value`'s
    occupancy `[..., L-1, K+1]` and td `[..., L-1, K]`) and per-proposal `moments`
    `[..., L-1, K, 3]` = (`||dA||^2`, `||dc||^2`, `<dA, dc>`): `greedy_gradient_moments`,
    or `edr.acceptance.scores_with_gradient_moments` from the sampling-mode scoring pass. On trained
    drafters these sizes leave 1.35-5x less variance than occupancy sizes at the same
    budget (docs/training.md). The occupancy share keeps every row with a positive
    occupancy drawable, so the gradient estimate stays exactly unbiased even where the
    estimate is 0 but the true gradient is not."""
    if not 0.0 < occupancy_share <= 1.0:
        raise ValueError(f"occupancy_share must be in (0, 1], got {occupancy_share!r}")
    k = td.shape[-1]
    if occupancy.shape[-1] != k + 1 or moments.shape != (*td.shape, 3):
        raise ValueError(
            f"occupancy {tuple(occupancy.shape)}, td {tuple(td.shape)} and moments "
            f"{tuple(moments.shape)} must be [..., L-1, K+1], [..., L-1, K], [..., L-1, K, 3]"
        )
    omega = occupancy.detach().to(torch.float64)
    d = td.detach().to(torch.float64)
    m = moments.detach().to(torch.float64)
    norm = (m[..., 1] + 2 * d * m[..., 2] + d**2 * m[..., 0]).clamp_min(0).sqrt()
    spread = (omega[..., :k] * norm).sum(-1)
    start = omega[..., 0]

    def share(x: Tensor) -> Tensor:
        total = x.sum(-1, keepdim=True)
        return torch.where(total > 0, x / total.clamp_min(torch.finfo(x.dtype).tiny), 0.0)

    spread_share, start_share = share(spread), share(start)
    # a rollout whose estimate is 0 everywhere falls back to the occupancy alone
    weight = torch.where(spread.sum(-1, keepdim=True) > 0, 1.0 - occupancy_share, 0.0)
    return weight * spread_share + (1.0 - weight) * start_share


def dense_row_weights(indices: Tensor, inclusion_weights: Tensor, num_rows: int) -> Tensor:
    """`[num_rows]` vector with `inclusion_weights` at `indices` and 0 elsewhere."""
    if indices.shape != inclusion_weights.shape or indices.dim() != 1:
        raise ValueError("indices and inclusion_weights must be 1-D tensors of the same length")
    out = torch.zeros(num_rows, dtype=inclusion_weights.dtype, device=inclusion_weights.device)
    out[indices] = inclusion_weights
    return out


def draw_scored_round_starts(
    sampler: str,
    acceptance: Tensor,
    cost: Tensor,
    rows: Sequence[int],
    max_anchors: int,
    generators: Sequence[torch.Generator | None],
    moments: Tensor | None = None,
) -> list[tuple[Tensor, Tensor]]:
    """`(rows drawn [m], dense inclusion weights [rows[j]])` per rollout, `max_anchors` of
    its `rows[j]` usable round starts drawn by PPS (`sample_round_starts`) on the sizes
    `sampler` names ("gradient": `gradient_sizes`; "occupancy": round-start occupancy).

    `acceptance`, `cost` `[B, R, K]` (host): each rollout's detached scores of its usable
    rows, zero below (the dead last row and padding); rollout j has `rows[j] + 1` round
    starts. `moments [B, R, K, 3]`: the proposals' logit-gradient moments for the
    gradient sampler (sampling mode: `scores_with_gradient_moments`); None derives them
    from A (`greedy_gradient_moments`). `generators[j]` draws rollout j."""
    if sampler not in SCORED_SAMPLERS:
        raise ValueError(f"sampler must be one of {', '.join(SCORED_SAMPLERS)}, got {sampler!r}")
    lengths = torch.tensor([r + 1 for r in rows])
    if sampler == "gradient":
        state = occupancy_and_value(acceptance, cost, lengths)
        grads = greedy_gradient_moments(acceptance) if moments is None else moments
        sizes = gradient_sizes(state.occupancy, state.td, grads)
    else:
        sizes = state_occupancy(acceptance, lengths)[..., 0]
    drawn = []
    for j, r in enumerate(rows):
        idx, w = sample_round_starts(sizes[j, :r], max_anchors, generators[j])
        drawn.append((idx, dense_row_weights(idx, w.double(), r)))
    return drawn
