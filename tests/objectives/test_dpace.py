"""D-PACE weights against autograd on the surrogate and brute-force loops (float64)."""

from __future__ import annotations

import pytest
import torch

from blockdraft.objectives import dpace_weights, make_objective, token_logprobs


def _random_case(n: int = 7, k: int = 9, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(n, k, generator=g, dtype=torch.float64)
    mask = torch.rand(n, k, generator=g) > 0.3
    mask[0] = True  # one fully real block
    mask[1] = False  # one fully padded block
    mask[2, 5:] = False  # a suffix-padded block, the common case
    return q, mask


def _surrogate(q_tilde: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """S = sum_{k real} prod_{i<=k, i real} q~_i, by explicit loops (independent code)."""
    total = q_tilde.new_zeros(())
    for b in range(q_tilde.shape[0]):
        prod = q_tilde.new_ones(())
        for k in range(q_tilde.shape[1]):
            if mask[b, k]:
                prod = prod * q_tilde[b, k]
                total = total + prod
    return total


def _autograd_sensitivities(q: torch.Tensor, mask: torch.Tensor, alpha: float):
    """(q~ dS/dq~, dS/dq~) at the smoothed confidences, by autograd through the loops."""
    q_tilde = ((1 - alpha) * q + alpha).clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(_surrogate(q_tilde, mask), q_tilde)
    return (q_tilde * grad).detach(), grad, q_tilde.detach()


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.5, 0.9])
def test_full_weights_equal_q_times_surrogate_gradient(alpha: float) -> None:
    q, mask = _random_case()
    expected, _, _ = _autograd_sensitivities(q, mask, alpha)
    got = dpace_weights(q, alpha=alpha, variant="full", mask=mask)
    torch.testing.assert_close(got, expected * mask, rtol=1e-12, atol=1e-14)
    assert torch.all(got[~mask] == 0)


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_cumulative_weights_are_reach_probabilities(alpha: float) -> None:
    q, mask = _random_case(seed=1)
    q_tilde = (1 - alpha) * q + alpha
    expected = torch.zeros_like(q)
    for b in range(q.shape[0]):
        prod = 1.0
        for j in range(q.shape[1]):
            if mask[b, j]:
                prod *= float(q_tilde[b, j])
                expected[b, j] = prod
    got = dpace_weights(q, alpha=alpha, variant="cumulative", mask=mask)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_continuation_weights_match_surrogate_gradient_over_prefix(alpha: float) -> None:
    q, mask = _random_case(seed=2)
    _, grad, q_tilde = _autograd_sensitivities(q, mask, alpha)
    # f_j = dS/dq~_j / prod_{i<j, i real} q~_i (exclusive prefix product of real positions)
    prefix = torch.where(mask, q_tilde, torch.ones_like(q_tilde)).cumprod(-1) / torch.where(
        mask, q_tilde, torch.ones_like(q_tilde)
    )
    expected = torch.where(mask, grad / prefix, torch.zeros_like(grad))
    got = dpace_weights(q, alpha=alpha, variant="continuation", mask=mask)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_continuation_is_stable_where_division_would_underflow() -> None:
    """alpha = 0 with tiny q: P_j underflows to 0 but f_j (a sum of later products) must not."""
    q = torch.full((1, 12), 1e-40, dtype=torch.float64)
    q[0, -1] = 0.5
    got = dpace_weights(q, alpha=0.0, variant="continuation")
    assert torch.isfinite(got).all()
    assert got[0, -1] == 1.0
    torch.testing.assert_close(
        got[0, -2], torch.tensor(1.5, dtype=torch.float64), rtol=0, atol=1e-30
    )


@pytest.mark.parametrize("variant", ["full", "cumulative", "continuation"])
def test_full_is_product_of_cumulative_and_continuation(variant: str) -> None:
    q, mask = _random_case(seed=3)
    full = dpace_weights(q, 0.4, "full", mask)
    product = dpace_weights(q, 0.4, "cumulative", mask) * dpace_weights(
        q, 0.4, "continuation", mask
    )
    torch.testing.assert_close(full, product, rtol=1e-12, atol=1e-14)
    assert dpace_weights(q, 0.4, variant, mask).shape == q.shape


@pytest.mark.parametrize("variant", ["full", "cumulative", "continuation"])
def test_alpha_one_removes_all_dependence_on_q(variant: str) -> None:
    """alpha = 1 makes q~ = 1: the weights become the q-independent limit of the formula.

    Cumulative-only is then exactly uniform over real positions (METHODS.md's "alpha = 1
    gives uniform weights"). For full and continuation the formula itself gives
    `w_j = f_j = #{real k >= j}` (= K - j + 1 on a full block), not uniform: S(1,...,1)
    has dS/dq~_j = K - j + 1. We test the formula, and flag the doc's claim in the report.
    """
    q, mask = _random_case(seed=4)
    w = dpace_weights(q, alpha=1.0, variant=variant, mask=mask)
    w_other = dpace_weights(torch.rand_like(q), alpha=1.0, variant=variant, mask=mask)
    torch.testing.assert_close(w, w_other)
    if variant == "cumulative":
        torch.testing.assert_close(w, mask.double())
    else:
        remaining = mask.flip(-1).cumsum(-1).flip(-1).double() * mask
        torch.testing.assert_close(w, remaining)
        # Full block: K, K-1, ..., 1 (independent closed form).
        k = q.shape[1]
        torch.testing.assert_close(w[0], torch.arange(k, 0, -1, dtype=torch.float64))


def test_weights_do_not_depend_on_q_when_alpha_is_one_and_ignore_masked_values() -> None:
    q, mask = _random_case(seed=5)
    other = q.clone()
    other[~mask] = torch.rand(int((~mask).sum()), dtype=torch.float64)
    for variant in ("full", "cumulative", "continuation"):
        torch.testing.assert_close(
            dpace_weights(q, 0.5, variant, mask), dpace_weights(other, 0.5, variant, mask)
        )


def test_weights_are_detached_and_no_gradient_path() -> None:
    """d loss / d logits == sum_j w_j d(-log q_j)/d logits / sum w, with w computed separately."""
    g = torch.Generator().manual_seed(6)
    n, k, v = 5, 6, 11
    logits = torch.randn(n, k, v, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, v, (n, k), generator=g)
    mask = torch.rand(n, k, generator=g) > 0.25
    objective = make_objective("dpace", alpha=0.5)
    out = objective.loss(token_logprobs(logits, targets), mask)
    assert out.weights is not None and not out.weights.requires_grad
    (grad,) = torch.autograd.grad(out.loss, logits)

    # Independent: weights from the formula as constants, per-position CE gradients by hand.
    with torch.no_grad():
        probs = torch.softmax(logits, -1)
        q = probs.gather(-1, targets[..., None]).squeeze(-1)
        w = dpace_weights(q, 0.5, "full", mask)
        onehot = torch.nn.functional.one_hot(targets, v).double()
        ce_grad = probs - onehot  # d(-log q_j)/d logits_j
        expected = w[..., None] * ce_grad / w.sum()
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)
    # And it differs from the gradient had the weights been differentiable.
    probs = torch.softmax(logits, -1)
    q = probs.gather(-1, targets[..., None]).squeeze(-1)
    q_tilde = 0.5 * q + 0.5
    reach = torch.where(mask, q_tilde, torch.ones_like(q_tilde)).cumprod(-1) * mask
    w_attached = reach.flip(-1).cumsum(-1).flip(-1) * mask
    attached_loss = (w_attached * -torch.log(q) * mask).sum() / w_attached.sum()
    (attached_grad,) = torch.autograd.grad(attached_loss, logits)
    assert not torch.allclose(attached_grad, grad, rtol=1e-3, atol=1e-6)


def test_bad_inputs_raise_clear_errors() -> None:
    q = torch.rand(2, 3)
    with pytest.raises(ValueError, match="variant"):
        dpace_weights(q, variant="ful")
    with pytest.raises(ValueError, match="alpha"):
        dpace_weights(q, alpha=1.5)
    with pytest.raises(ValueError, match="mask shape"):
        dpace_weights(q, mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool"):
        dpace_weights(q, mask=torch.ones(2, 3))
