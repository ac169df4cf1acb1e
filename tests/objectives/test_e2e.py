"""E2E loss against brute force, autograd on an unchunked reference, and Monte Carlo."""

from __future__ import annotations

import math

import pytest
import torch

from blockdraft.objectives import e2e_from_overlap, e2e_loss, overlap, overlap_with_logits


def _case(n: int = 5, k: int = 6, v: int = 9, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, k, v, generator=g, dtype=torch.float64) * 2
    p = torch.softmax(torch.randn(n, k, v, generator=g, dtype=torch.float64) * 2, -1)
    mask = torch.rand(n, k, generator=g) > 0.3
    if n >= 3:
        mask[0] = True
        mask[1] = False  # fully padded block: excluded from the block average
        mask[2, 3:] = False
    return logits, p, mask


def _brute_force_loss(logits: torch.Tensor, p: torch.Tensor, mask: torch.Tensor) -> float:
    """Python loops; acceptance via the total-variation identity 1 - 0.5 * ||p - q||_1."""
    q = torch.softmax(logits, -1).tolist()
    p = p.tolist()
    per_block = []
    for b in range(len(q)):
        chain, total, count = 1.0, 0.0, 0
        for j in range(len(q[b])):
            if not mask[b, j]:
                continue
            alpha = 1.0 - 0.5 * sum(abs(pv - qv) for pv, qv in zip(p[b][j], q[b][j], strict=True))
            chain *= alpha
            total += chain
            count += 1
        if count:
            per_block.append(1.0 - total / count)
    return sum(per_block) / len(per_block)


def _reference_loss(logits: torch.Tensor, p: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unchunked, vectorised, written independently of the module (differentiable)."""
    alpha = 1.0 - 0.5 * (p - torch.softmax(logits, -1)).abs().sum(-1)
    chain = torch.cumprod(torch.where(mask, alpha, torch.ones_like(alpha)), dim=-1)
    counts = mask.sum(-1)
    per_block = 1.0 - (chain * mask).sum(-1) / counts.clamp_min(1)
    return per_block[counts > 0].mean()


@pytest.mark.parametrize("chunk_rows", [1, 4, 7, None])
def test_e2e_matches_brute_force_and_reference_gradient(chunk_rows: int | None) -> None:
    logits, p, mask = _case()
    x = logits.clone().requires_grad_(True)
    loss = e2e_loss(x, p, mask, chunk_rows=chunk_rows)
    assert abs(float(loss.detach()) - _brute_force_loss(logits, p, mask)) < 1e-12
    (grad,) = torch.autograd.grad(loss, x)
    x_ref = logits.clone().requires_grad_(True)
    (grad_ref,) = torch.autograd.grad(_reference_loss(x_ref, p, mask), x_ref)
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad, grad_ref, rtol=1e-10, atol=1e-12)
    assert grad.abs().sum() > 0
    assert torch.all(grad[~mask] == 0)  # padded proposals get no signal


def test_padded_positions_are_transparent() -> None:
    """A block with a padded hole equals the same block with the hole physically removed."""
    logits, p, _ = _case(n=1, k=5)
    mask = torch.tensor([[True, False, True, True, False]])
    keep = mask[0]
    holed = e2e_loss(logits, p, mask)
    compact = e2e_loss(
        logits[:, keep], p[:, keep], torch.ones(1, int(keep.sum()), dtype=torch.bool)
    )
    torch.testing.assert_close(holed, compact)


def test_overlap_is_one_minus_total_variation() -> None:
    logits, p, _ = _case(seed=3)
    q = torch.softmax(logits, -1)
    expected = 1.0 - 0.5 * (p - q).abs().sum(-1)
    torch.testing.assert_close(overlap(p, q, chunk_rows=4), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        overlap_with_logits(p, logits, chunk_rows=4), expected, rtol=1e-12, atol=1e-12
    )
    torch.testing.assert_close(overlap(p, p), torch.ones_like(expected))


def test_expected_accepted_length_matches_speculative_sampling_monte_carlo() -> None:
    """sum_j prod_{i<=j} alpha_i is the mean accepted count of K independent sampling steps."""
    g = torch.Generator().manual_seed(4)
    k, v, sims = 5, 6, 40_000
    q = torch.softmax(torch.randn(k, v, generator=g, dtype=torch.float64), -1)
    p = torch.softmax(q.log() + 0.7 * torch.randn(k, v, generator=g, dtype=torch.float64), -1)
    draws = torch.multinomial(q, sims, replacement=True, generator=g)  # [k, sims]
    ratio = (p.gather(1, draws) / q.gather(1, draws)).clamp(max=1.0)
    accepted = torch.rand(k, sims, generator=g, dtype=torch.float64) < ratio
    accepted_len = accepted.to(torch.int64).cumprod(0).sum(0).double()
    mc_mean, mc_se = float(accepted_len.mean()), float(accepted_len.std() / math.sqrt(sims))

    alpha = overlap(p, q)[None]
    predicted = (1.0 - float(e2e_from_overlap(alpha))) * k
    assert abs(predicted - mc_mean) < 4 * mc_se, (predicted, mc_mean, mc_se)  # ~4.5e-5 two-sided


def test_all_padded_batch_gives_zero_loss_and_bad_inputs_raise() -> None:
    logits, p, _ = _case(n=2, k=3)
    loss = e2e_loss(logits, p, torch.zeros(2, 3, dtype=torch.bool))
    assert float(loss) == 0.0
    with pytest.raises(ValueError, match="same"):
        e2e_loss(logits, p[..., :-1])
    with pytest.raises(ValueError, match=r"\[N, K, V\]"):
        e2e_loss(logits[0], p[0])
    with pytest.raises(ValueError, match="mask"):
        e2e_loss(logits, p, torch.ones(2, 3))
    with pytest.raises(ValueError, match="chunk_rows"):
        overlap(p, p, chunk_rows=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_fused_overlap_matches_reference_values_and_gradients(dtype) -> None:
    """The fused overlap (`edr/acceptance.py`'s TV pass) against the chunked autograd reference,
    with a truncated target (zeros in p, as top-k leaves) and a temperature."""
    logits, p, _ = _case(n=4, k=5, v=11, seed=7)
    p = torch.where(p < 0.05, torch.zeros_like(p), p)
    p = (p / p.sum(-1, keepdim=True)).to(torch.float32 if dtype == torch.bfloat16 else dtype)
    weights = torch.randn(p.shape[:-1], generator=torch.Generator().manual_seed(8)).double()
    outs = []
    for fused in (True, False):
        x = logits.to(dtype).requires_grad_(True)
        a = overlap_with_logits(p, x, chunk_rows=3, temperature=0.7, fused=fused)
        (a.double() * weights).sum().backward()
        outs.append((a.detach(), x.grad))
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=tol, atol=tol)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=tol, atol=tol)


def test_overlap_with_a_target_that_requires_grad_differentiates_both() -> None:
    """A target that requires grad takes the reference path (the fused kernel gives the
    target no gradient), so both inputs get autograd's gradients."""
    logits, p, _ = _case(n=2, k=3, v=7, seed=9)
    x, t = logits.clone().requires_grad_(True), p.clone().requires_grad_(True)
    overlap_with_logits(t, x).sum().backward()
    x2, t2 = logits.clone().requires_grad_(True), p.clone().requires_grad_(True)
    torch.minimum(t2, torch.softmax(x2, -1)).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(t.grad, t2.grad)
