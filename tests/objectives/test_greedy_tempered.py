"""Greedy EDR's tempered relaxation `A = softmax(z / beta)(x)` (docs/methods.md, "EDR",
greedy EDR): it is the exact acceptance of a drafter that *samples* its proposals at
temperature beta against a greedy target, so its expected rounds must equal a brute-force
enumeration of every proposal block such a drafter can draw, and tend to the greedy
(argmax) drafter's rounds as beta -> 0; its TD-form training gradient must equal autograd
through the exact recursion."""

from __future__ import annotations

import itertools

import pytest
import torch

from blockdraft.objectives.edr import (
    acceptance_and_cost,
    edr_surrogate,
    expected_rounds,
    rounds_objective,
)


def brute_force_rounds(logits: torch.Tensor, x: torch.Tensor, beta: float | None) -> float:
    """Expected drafting rounds of one rollout `x_1..x_L` when round n's K proposals are
    drawn independently from softmax(logits[n-1, h] / beta) (argmax when beta is None),
    accepted while they equal x_{n+h}; a rejection or all K accepted ends the round with
    the target's own token; the rollout ends at x_L. Enumerates every proposal block."""
    rows, k, v = logits.shape
    length = rows + 1  # L: round starts n = 1..L-1

    def block_probs(n: int) -> dict[int, float]:
        """P(exactly j proposals accepted) in the round starting at n (0-based row n-1)."""
        out: dict[int, float] = {}
        live = min(k, length - n)  # proposals with n + h <= L
        for ys in itertools.product(range(v), repeat=live):
            p = 1.0
            for h, y in enumerate(ys):
                z = logits[n - 1, h].double()
                if beta is None:
                    p *= float(z.argmax() == y)
                else:
                    p *= float(torch.softmax(z / beta, -1)[y])
            if p == 0.0:
                continue
            j = 0
            while j < live and ys[j] == int(x[n + j]):  # x is 0-based: x[n + j] = x_{n+j+1}
                j += 1
            out[j] = out.get(j, 0.0) + p
        return out

    memo: dict[int, float] = {}

    def rounds_from(n: int) -> float:  # n tokens verified
        if n >= length:
            return 0.0
        if n not in memo:
            total = 1.0
            for j, p in block_probs(n).items():
                total += p * rounds_from(n + j + 1)
            memo[n] = total
        return memo[n]

    return rounds_from(1)


@pytest.mark.parametrize("beta", [1.0, 0.5, 0.2])
@pytest.mark.parametrize("length,k", [(5, 2), (4, 3), (2, 2)])
def test_tempered_acceptance_is_a_sampling_drafter_by_enumeration(beta, length, k):
    torch.manual_seed(int(10 * beta) + length + k)
    v = 3
    logits = 2.0 * torch.randn(length - 1, k, v, dtype=torch.float64)
    x = torch.randint(0, v, (length,))
    # the proposal of row n-1, slot h is x_{n+h}: 0-based x[n + h]
    ids = torch.stack(
        [x[torch.arange(n + 1, n + 1 + k).clamp_max(length - 1)] for n in range(length - 1)]
    )
    acc, _ = acceptance_and_cost(logits, None, ids, mode="greedy_soft", temperature=beta)
    want = brute_force_rounds(logits, x, beta)
    assert float(expected_rounds(acc)) == pytest.approx(want, rel=1e-10)


def test_tempered_rounds_tend_to_the_argmax_drafter():
    torch.manual_seed(5)
    length, k, v = 6, 3, 3
    logits = 2.0 * torch.randn(length - 1, k, v, dtype=torch.float64)
    x = torch.randint(0, v, (length,))
    ids = torch.stack(
        [x[torch.arange(n + 1, n + 1 + k).clamp_max(length - 1)] for n in range(length - 1)]
    )
    hard, _ = acceptance_and_cost(logits, None, ids, mode="greedy_hard")
    truth = brute_force_rounds(logits, x, None)
    assert float(expected_rounds(hard.double())) == pytest.approx(truth, rel=1e-12)
    gaps = []
    for beta in (1.0, 0.3, 0.1, 0.01):
        acc, _ = acceptance_and_cost(logits, None, ids, mode="greedy_soft", temperature=beta)
        gaps.append(abs(float(expected_rounds(acc)) - truth))
    assert gaps[-1] < 1e-6 < gaps[0]
    assert gaps == sorted(gaps, reverse=True)


@pytest.mark.parametrize("beta", [1.0, 0.25])
def test_tempered_surrogate_gradient_equals_autograd_through_the_recursion(beta):
    torch.manual_seed(7)
    length, k, v = 9, 4, 6
    logits = torch.randn(length - 1, k, v, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, v, (length - 1, k))
    acc, cost = acceptance_and_cost(logits, None, ids, mode="greedy_soft", temperature=beta)
    (g_td,) = torch.autograd.grad(edr_surrogate(acc, cost), logits)
    acc, cost = acceptance_and_cost(logits, None, ids, mode="greedy_soft", temperature=beta)
    (g_ref,) = torch.autograd.grad(rounds_objective(acc, cost), logits)
    torch.testing.assert_close(g_td, g_ref, rtol=1e-10, atol=1e-12)
    # and it is not the untempered gradient
    acc1, cost1 = acceptance_and_cost(logits, None, ids, mode="greedy_soft", temperature=1.0)
    (g1,) = torch.autograd.grad(edr_surrogate(acc1, cost1), logits)
    assert beta == 1.0 or not torch.allclose(g1, g_td)
