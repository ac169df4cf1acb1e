"""D-PACE position weights (docs/methods.md, "D-PACE").

Each proposal's cross-entropy is weighted by its sensitivity `w_j = q~_j dS/dq~_j` of the
smooth accepted-length surrogate `S = sum_k prod_{i<=k} q~_i`, so training effort goes to
the positions that currently limit acceptance of *this* block. The confidences are
smoothed (`q~ = (1 - alpha) q + alpha`: one bad early position cannot zero every later
weight) and the weights are detached: they steer the gradient, never carry it. Masked
positions add no term to S, act as `q~ = 1` inside the products and get weight 0.
"""

from __future__ import annotations

import torch

DPACE_VARIANTS = ("full", "cumulative", "continuation")


def _smoothed(
    q: torch.Tensor, alpha: float, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Detached `q~` (1 at masked positions) and the float mask, in >= float32."""
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"D-PACE alpha must be a number in [0, 1], got {alpha!r}")
    if q.dim() < 1 or q.shape[-1] < 1:
        raise ValueError(f"q must have shape [..., K] with K >= 1, got {tuple(q.shape)}")
    dtype = torch.promote_types(q.dtype, torch.float32)
    q = q.detach().to(dtype)
    q_tilde = (1.0 - alpha) * q + alpha
    if mask is None:
        return q_tilde, torch.ones_like(q_tilde)
    if mask.shape != q.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match q shape {tuple(q.shape)}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor (True = real proposal), got {mask.dtype}")
    real = mask.to(dtype)
    return torch.where(mask, q_tilde, torch.ones_like(q_tilde)), real


def _reverse_cumsum(x: torch.Tensor) -> torch.Tensor:
    """`out_j = sum_{m>=j} x_m` along the last dim (suffix sums)."""
    return x.flip(-1).cumsum(-1).flip(-1)


def _continuation(q_tilde: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """`f_j = sum_{k>=j, k real} prod_{i=j+1..k} q~_i`, by an exact K x K triangular cumprod.

    Computing f as `suffix_sum(P) / P_j` would divide by products that underflow when
    alpha is small; the triangular form never divides and costs O(K^2) per block, which
    is negligible next to the vocabulary-sized cross-entropy it weights.
    """
    k = q_tilde.shape[-1]
    idx = torch.arange(k, device=q_tilde.device)
    after_j = idx.view(1, k) > idx.view(k, 1)  # [j, i]: i > j
    # factors[..., j, i] = q~_i for i > j else 1; cumprod over i gives prod_{j<i'<=i} q~.
    one = torch.ones((), dtype=q_tilde.dtype, device=q_tilde.device)
    factors = torch.where(after_j, q_tilde.unsqueeze(-2), one)
    partial = factors.cumprod(-1)
    keep = idx.view(1, k) >= idx.view(k, 1)  # [j, i]: i >= j (the terms k >= j of f_j)
    terms = partial * keep.to(partial.dtype) * real.unsqueeze(-2)
    return terms.sum(-1)


def dpace_weights(
    q: torch.Tensor,
    alpha: float = 0.5,
    variant: str = "full",
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Unnormalised, detached D-PACE weights, same shape as `q` (`[..., K]`).

    `q[..., j-1]` is the drafter's probability of the target's token at proposal j.
    Variants (the paper's ablations): `"full"` `w_j = P_j f_j = sum_{m>=j} P_m`,
    `"cumulative"` `w_j = P_j` (chance to reach j), `"continuation"` `w_j = f_j`
    (value of the rest of the block given j is reached), with `P_j = prod_{i<=j} q~_i`.
    `mask` (bool, same shape; False = not a real proposal) zeroes the weight there and
    makes the position transparent in the products. Vectorised over K (no Python loop).
    At alpha = 1 (q~ = 1) the weights no longer depend on q: uniform for "cumulative",
    `#{real k >= j}` (K - j + 1 on a full block) for "full" and "continuation".
    """
    if variant not in DPACE_VARIANTS:
        raise ValueError(f"unknown D-PACE variant {variant!r}; valid: {', '.join(DPACE_VARIANTS)}")
    with torch.no_grad():
        q_tilde, real = _smoothed(q, alpha, mask)
        if variant == "continuation":
            return _continuation(q_tilde, real) * real
        reach = q_tilde.cumprod(-1)  # P_j
        if variant == "cumulative":
            return reach * real
        return _reverse_cumsum(reach * real) * real
