"""EDR recursions: brute-force path enumeration and autograd checks (METHODS.md §2)."""

from __future__ import annotations

import itertools

import pytest
import torch

from blockdraft.objectives.edr import (
    edr_surrogate,
    expected_rounds,
    occupancy_and_value,
    pad_rollouts,
    rounds_objective,
    state_occupancy,
)
from spec_sim import enumerate_paths

SHAPES = [(1, 1), (1, 3), (2, 1), (2, 4), (3, 3), (4, 4), (5, 2), (6, 1), (7, 3), (8, 2), (6, 4)]


@pytest.mark.parametrize("backend", ["compiled", "torch"])
@pytest.mark.parametrize(("length", "k"), SHAPES)
def test_recursions_match_path_enumeration(length: int, k: int, backend: str) -> None:
    gen = torch.Generator().manual_seed(1000 * length + k)
    acc = torch.rand(length - 1, k, generator=gen, dtype=torch.float64)
    cost = torch.rand(length - 1, k, generator=gen, dtype=torch.float64)
    ref = enumerate_paths(acc.tolist(), cost.tolist(), length, k)

    torch.testing.assert_close(expected_rounds(acc).item(), ref["rounds"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        rounds_objective(acc, 1 - acc).item(), ref["rounds"], rtol=1e-12, atol=1e-12
    )
    torch.testing.assert_close(
        rounds_objective(acc, cost).item(), ref["objective"], rtol=1e-12, atol=1e-12
    )
    state = occupancy_and_value(acc, cost, backend=backend)
    torch.testing.assert_close(state.objective.item(), ref["objective"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(  # the leading 1 is charged to no row
        float(length >= 2) + state.row_value.sum().item(), ref["objective"], rtol=1e-12, atol=1e-12
    )
    assert state.row_value[-1:].abs().sum().item() == 0.0  # dead last row: no share of J
    if length >= 2:  # backward recursion: J = 1 + V_{1,2}
        torch.testing.assert_close(
            1 + state.value[0, 0].item(), ref["objective"], rtol=1e-12, atol=1e-12
        )
    omega = state_occupancy(acc, backend=backend)
    assert omega.shape == (length - 1, k + 1) and omega.dtype == torch.float64
    for n, h in itertools.product(range(1, length), range(1, k + 2)):
        expect = ref["visit"].get((n, h), 0.0)
        torch.testing.assert_close(omega[n - 1, h - 1].item(), expect, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state.occupancy, omega)


def _random_case(
    gen: torch.Generator, length: int, k: int, nan_ignored: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    acc = torch.rand(length - 1, k, generator=gen, dtype=torch.float64)
    cost = torch.rand(length - 1, k, generator=gen, dtype=torch.float64)  # independent of acc
    if nan_ignored and length > 1:
        n = torch.arange(1, length).view(-1, 1)
        h = torch.arange(1, k + 1).view(1, -1)
        ignored = n + h > length
        acc[ignored], cost[ignored] = float("nan"), float("nan")
    return acc, cost


GRAD_SHAPES = [
    (1, 1),
    (1, 5),
    (2, 1),
    (2, 3),
    (3, 1),
    (3, 5),
    (4, 4),
    (5, 7),
    (9, 1),
    (12, 3),
    (17, 4),
    (25, 6),
]


@pytest.mark.parametrize(("length", "k"), GRAD_SHAPES)
@pytest.mark.parametrize("nan_ignored", [False, True])
def test_surrogate_gradient_equals_autograd_of_exact_objective(
    length: int, k: int, nan_ignored: bool
) -> None:
    gen = torch.Generator().manual_seed(7 * length + 131 * k + nan_ignored)
    acc, cost = _random_case(gen, length, k, nan_ignored)
    a1, c1 = acc.clone().requires_grad_(), cost.clone().requires_grad_()
    exact = rounds_objective(a1, c1)
    g_acc, g_cost = (
        torch.autograd.grad(exact, (a1, c1), allow_unused=True) if length > 1 else (None, None)
    )
    a2, c2 = acc.clone().requires_grad_(), cost.clone().requires_grad_()
    surrogate = edr_surrogate(a2, c2)
    torch.testing.assert_close(surrogate.detach(), exact.detach(), rtol=1e-12, atol=1e-12)
    if length == 1:
        assert exact.item() == 0.0 and surrogate.item() == 0.0
        return
    s_acc, s_cost = torch.autograd.grad(surrogate, (a2, c2))
    torch.testing.assert_close(s_acc, g_acc, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(s_cost, g_cost, rtol=1e-10, atol=1e-12)
    # ignored and last-position entries get exactly zero gradient
    n = torch.arange(1, length).view(-1, 1)
    h = torch.arange(1, k + 1).view(1, -1)
    dead = n + h >= length
    assert bool((s_acc[dead] == 0).all()) and bool((s_cost[dead] == 0).all())


def test_surrogate_gradient_for_expected_rounds_with_cost_tied_to_acceptance() -> None:
    """With c = 1 - A (the offline objective) the chain rule goes through both inputs."""
    gen = torch.Generator().manual_seed(3)
    base = torch.rand(10, 4, generator=gen, dtype=torch.float64)
    a1 = base.clone().requires_grad_()
    (g_ref,) = torch.autograd.grad(expected_rounds(a1), a1)
    a2 = base.clone().requires_grad_()
    (g_sur,) = torch.autograd.grad(edr_surrogate(a2, 1 - a2), a2)
    torch.testing.assert_close(g_sur, g_ref, rtol=1e-10, atol=1e-12)
    # a perturbation check that the gradient is not trivially zero
    assert g_ref.abs().max() > 1e-3


def test_batched_forms_equal_per_rollout_forms() -> None:
    gen = torch.Generator().manual_seed(11)
    k = 3
    lengths = [1, 2, 4, 9, 6]
    accs = [torch.rand(L - 1, k, generator=gen, dtype=torch.float64) for L in lengths]
    costs = [torch.rand(L - 1, k, generator=gen, dtype=torch.float64) for L in lengths]
    acc, lens = pad_rollouts(accs)
    cost, _ = pad_rollouts(costs)
    mask = torch.zeros_like(acc, dtype=torch.bool)
    for i, L in enumerate(lengths):
        mask[i, L - 1 :] = True
    acc = acc.masked_fill(mask, float("nan")).requires_grad_()  # padding must be ignored
    cost = cost.masked_fill(mask, float("nan")).requires_grad_()
    per = torch.stack([rounds_objective(a, c) for a, c in zip(accs, costs, strict=True)])
    torch.testing.assert_close(rounds_objective(acc, cost, lens), per)
    torch.testing.assert_close(occupancy_and_value(acc, cost, lens).objective, per)
    torch.testing.assert_close(
        expected_rounds(acc, lens), torch.stack([expected_rounds(a) for a in accs])
    )
    total = edr_surrogate(acc, cost, lengths=lens)
    torch.testing.assert_close(total, per.sum())
    g_acc, g_cost = torch.autograd.grad(total, (acc, cost))
    for i, (a, c) in enumerate(zip(accs, costs, strict=True)):
        a, c = a.clone().requires_grad_(), c.clone().requires_grad_()
        if a.shape[0] == 0:
            continue
        ga, gc = torch.autograd.grad(rounds_objective(a, c), (a, c))
        torch.testing.assert_close(g_acc[i, : a.shape[0]], ga)
        torch.testing.assert_close(g_cost[i, : a.shape[0]], gc)
        assert bool((g_acc[i, a.shape[0] :] == 0).all())
    per_rollout = edr_surrogate(acc.detach(), cost.detach(), lengths=lens, reduction="none")
    torch.testing.assert_close(per_rollout, per.detach())


def test_expected_rounds_extremes() -> None:
    """Sanity anchors of the layout: all-accept and all-reject drafters."""
    length, k = 20, 4
    ones, zeros = torch.ones(length - 1, k), torch.zeros(length - 1, k)
    # all rejected: one round per token after x_1
    assert expected_rounds(zeros).item() == pytest.approx(length - 1)
    # all accepted: each round emits K+1 tokens, the last one stops at x_L
    assert expected_rounds(ones).item() == pytest.approx(-(-(length - 1) // (k + 1)))


def test_bad_inputs_give_clear_errors() -> None:
    with pytest.raises(ValueError, match="acceptance must be"):
        expected_rounds(torch.rand(3))
    with pytest.raises(ValueError, match="cost"):
        rounds_objective(torch.rand(3, 2), torch.rand(3, 3))
    with pytest.raises(ValueError, match="lengths"):
        expected_rounds(torch.rand(2, 3, 2), torch.tensor([5, 2]))
    with pytest.raises(ValueError, match="reduction"):
        edr_surrogate(torch.rand(3, 2), torch.rand(3, 2), reduction="avg")
    with pytest.raises(ValueError, match="row_weights"):
        edr_surrogate(torch.rand(3, 2), torch.rand(3, 2), row_weights=torch.ones(4))
