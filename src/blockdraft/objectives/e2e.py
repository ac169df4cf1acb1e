"""E2E, the block-local expected-accepted-length objective (docs/methods.md, "Baselines").

Proposal i is accepted under lossless sampling with probability `alpha_i = sum_v
min(p_i(v), q_i(v))`; treating positions as independent, E2E minimises `1 - (1/K_b)
sum_j prod_{i<=j} alpha_i` per block, averaged over the blocks with a real proposal.
Unlike the cross-entropy objectives it needs the target's full distribution p. Masked
proposals act as `alpha = 1` inside the products, add no term and do not count in the
block's number of real proposals `K_b`.
"""

from __future__ import annotations

import torch

from blockdraft.objectives.edr.acceptance import fused_sampling_acceptance
from blockdraft.objectives.row_chunks import by_row_chunks, check_chunk_rows, fused_chunk_rows


def _check_pair(p: torch.Tensor, other: torch.Tensor, other_name: str) -> None:
    if p.dim() < 1 or p.shape != other.shape:
        raise ValueError(
            f"target_probs {tuple(p.shape)} and {other_name} {tuple(other.shape)} "
            "must have the same [..., V] shape"
        )


def _overlap_of_probs(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return torch.minimum(p, q).sum(-1)


class _OverlapOfLogits:
    """`sum_v min(p, softmax(logits / temperature))` per row (>= float32)."""

    def __init__(self, temperature: float = 1.0) -> None:
        self.temperature = temperature

    def __call__(self, p: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(logits.dtype, torch.float32)
        q = torch.softmax(logits.to(dtype) / self.temperature, dim=-1)
        return torch.minimum(p, q).sum(-1)


def _chunked_rows(fn, p: torch.Tensor, other: torch.Tensor, chunk_rows: int) -> torch.Tensor:
    """Apply `fn` to row chunks (`row_chunks.by_row_chunks`: under autograd each chunk is
    checkpointed, so its `[chunk_rows, V]` intermediates are recomputed in backward)."""
    vocab = p.shape[-1]
    if p.numel() == 0:
        return p.new_zeros(p.shape[:-1])
    (out,) = by_row_chunks(fn, [p.reshape(-1, vocab), other.reshape(-1, vocab)], chunk_rows)
    return out.reshape(p.shape[:-1])


def overlap(p: torch.Tensor, q: torch.Tensor, chunk_rows: int | None = None) -> torch.Tensor:
    """`sum_v min(p(v), q(v))` over the last dim: the acceptance probability of one
    speculative-sampling step (1 - total variation). Both inputs are probabilities."""
    _check_pair(p, q, "q")
    return _chunked_rows(_overlap_of_probs, p, q, check_chunk_rows(chunk_rows, p.shape[-1]))


def overlap_with_logits(
    target_probs: torch.Tensor,
    draft_logits: torch.Tensor,
    chunk_rows: int | None = None,
    temperature: float = 1.0,
    fused: bool = True,
) -> torch.Tensor:
    """Like `overlap` with `q = softmax(draft_logits / temperature)` computed chunk by chunk
    (>= float32), so no extra full `[..., V]` softmax (nor a scaled copy of the logits) is
    held for the backward pass.

    `fused` (target without gradient): `sum_v min(p, q) = sum_v p - sum_v [p - q]_+`, and
    the second sum is the TV cost that `edr/acceptance.py` computes in one pass with a closed-form
    backward (times the mass `sum_v p`), instead of autograd re-running every chunk under
    checkpointing. `fused=False` runs `_OverlapOfLogits`, the reference the tests compare
    against."""
    _check_pair(target_probs, draft_logits, "draft_logits")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    chunk = check_chunk_rows(chunk_rows, target_probs.shape[-1])
    if (
        fused
        and target_probs.numel()
        and not (torch.is_grad_enabled() and target_probs.requires_grad)
    ):
        rows = fused_chunk_rows(chunk_rows, target_probs.shape[-1], draft_logits.device)
        return _fused_overlap(target_probs, draft_logits, rows, temperature)
    return _chunked_rows(_OverlapOfLogits(temperature), target_probs, draft_logits, chunk)


def _fused_overlap(
    p: torch.Tensor, logits: torch.Tensor, chunk_rows: int, temperature: float
) -> torch.Tensor:
    """`sum_v min(p, q)` as `M (1 - c)`, c = `sum_v [p - q]_+ / M` from `edr/acceptance.py` (no
    stop tokens), M = `sum_v p` (> 0 for a distribution; the kernel clamps it the same)."""
    vocab = p.shape[-1]
    flat_p, flat_logits = p.reshape(-1, vocab), logits.reshape(-1, vocab)
    ids = torch.zeros(flat_p.shape[0], dtype=torch.long, device=p.device)  # A is not used
    _, cost = fused_sampling_acceptance(
        flat_logits,
        flat_p,
        ids,
        temperature=temperature,
        target_is_probs=True,
        stops=None,
        want_cost=True,
        chunk_rows=chunk_rows,
    )
    dtype = cost.dtype
    mass = flat_p.detach().to(dtype).sum(-1).clamp_min(torch.finfo(dtype).tiny)
    return (mass * (1.0 - cost)).reshape(p.shape[:-1])


def expected_accepted_fraction(
    alpha: torch.Tensor, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block `(1/K_b) sum_{j real} prod_{i<=j, i real} alpha_i` and the block's `K_b`.

    alpha `[N, K]` per-proposal acceptance probabilities, mask `[N, K]` bool (False = not a
    real proposal). Blocks with `K_b = 0` get fraction 0.
    """
    if alpha.dim() != 2:
        raise ValueError(f"alpha must have shape [N, K], got {tuple(alpha.shape)}")
    if mask is None:
        mask = torch.ones_like(alpha, dtype=torch.bool)
    if mask.shape != alpha.shape or mask.dtype != torch.bool:
        raise ValueError(
            f"mask must be a bool tensor of shape {tuple(alpha.shape)}, "
            f"got {mask.dtype} {tuple(mask.shape)}"
        )
    chain = torch.where(mask, alpha, torch.ones_like(alpha)).cumprod(-1)
    accepted = torch.where(mask, chain, torch.zeros_like(chain)).sum(-1)
    count = mask.sum(-1)
    fraction = accepted / count.clamp_min(1).to(accepted.dtype)
    return fraction, count


def e2e_from_overlap(alpha: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """`mean over blocks of 1 - (1/K_b) sum_j prod_{i<=j} alpha_i` (blocks with K_b > 0)."""
    fraction, count = expected_accepted_fraction(alpha, mask)
    has_real = count > 0
    per_block = torch.where(has_real, 1.0 - fraction, torch.zeros_like(fraction))
    num_blocks = has_real.sum()
    return per_block.sum() / num_blocks.clamp_min(1).to(per_block.dtype)


def e2e_loss(
    draft_logits: torch.Tensor,
    target_probs: torch.Tensor,
    mask: torch.Tensor | None = None,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """E2E loss from drafter logits `[N, K, V]` and target probabilities `[N, K, V]`.

    The drafter distribution is `softmax(draft_logits)` as given (apply any sampling
    temperature before calling); `target_probs` should be the target's sampling
    distribution at the same positions. See the module docstring for masking.
    """
    if draft_logits.dim() != 3:
        raise ValueError(f"draft_logits must have shape [N, K, V], got {tuple(draft_logits.shape)}")
    alpha = overlap_with_logits(target_probs, draft_logits, chunk_rows)
    return e2e_from_overlap(alpha, mask)
