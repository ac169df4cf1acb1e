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


def _ragged_batch(gen: torch.Generator, lengths: list[int], k: int, dtype: torch.dtype):
    """Padded `[B, M, K]` acceptance/cost with NaN in every ignored entry."""
    rows = max(lengths) - 1
    acc = torch.rand(len(lengths), rows, k, generator=gen, dtype=torch.float64)
    cost = torch.rand(len(lengths), rows, k, generator=gen, dtype=torch.float64)
    n = torch.arange(1, rows + 1).view(1, -1, 1)
    h = torch.arange(1, k + 1).view(1, 1, -1)
    ignored = n + h >= torch.tensor(lengths).view(-1, 1, 1)
    acc, cost = acc.masked_fill(ignored, float("nan")), cost.masked_fill(ignored, float("nan"))
    return acc.to(dtype), cost.to(dtype), torch.tensor(lengths)


@pytest.mark.parametrize("k", [1, 3, 7, 15])
def test_compiled_kernels_equal_torch_reference(k: int) -> None:
    """Compiled recursion == readable torch recursion (float64), batched with ragged
    lengths around every boundary case (L = 0, 1, 2, <= K+1, long), NaN in ignored entries."""
    gen = torch.Generator().manual_seed(k)
    lengths = [0, 1, 2, 3, k + 1, k + 2, k + 3, 40, 97, 200]
    acc, cost, lens = _ragged_batch(gen, lengths, k, torch.float64)
    fast = occupancy_and_value(acc, cost, lens, backend="compiled")
    ref = occupancy_and_value(acc, cost, lens, backend="torch")
    for name in ("occupancy", "value", "td", "row_value", "objective", "round_start"):
        got, want = getattr(fast, name), getattr(ref, name)
        assert got.dtype == want.dtype == torch.float64, name
        assert bool(torch.isfinite(got).all()), name
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-11, msg=name)
    torch.testing.assert_close(
        state_occupancy(acc, lens, backend="compiled"), state_occupancy(acc, lens, backend="torch")
    )
    # and both match the autograd reference on the objective
    torch.testing.assert_close(fast.objective, rounds_objective(acc, cost, lens))
    # single rollouts: the batch dim is dropped, results equal the batch rows
    for i, length in enumerate(lengths):
        if length == 0:
            continue
        one = occupancy_and_value(acc[i, : length - 1], cost[i, : length - 1])
        torch.testing.assert_close(one.td, fast.td[i, : length - 1])
        torch.testing.assert_close(one.objective, fast.objective[i])


def test_float32_inputs_keep_float64_occupancies_and_accurate_values() -> None:
    """float32 inputs (training): occupancies come back in float64 and every output equals
    the float64 computation on the same (upcast) inputs up to float32 rounding of the
    result -- no float32 accumulation error, which grows with L (the old float32 round
    starts were off by up to 3e-3 at near-certain acceptance, L = 4,096)."""
    gen = torch.Generator().manual_seed(5)
    length, k = 4096, 7
    acc = (1 - 1e-3 * torch.rand(length - 1, k, generator=gen)).float()  # near-certain
    cost = torch.rand(length - 1, k, generator=gen).float()
    got = occupancy_and_value(acc, cost)
    want = occupancy_and_value(acc.double(), cost.double())
    assert got.occupancy.dtype == torch.float64 and got.td.dtype == torch.float32
    torch.testing.assert_close(got.occupancy, want.occupancy, rtol=1e-13, atol=0)
    torch.testing.assert_close(got.round_start, want.round_start, rtol=1e-13, atol=0)
    for name in ("value", "td", "row_value", "objective"):
        g, w = getattr(got, name).double(), getattr(want, name)
        # float32 rounding of the final float64 result only
        assert bool(((g - w).abs() <= 2**-23 * w.abs() + 1e-30).all()), name
    # the reference torch loop in float32 arithmetic would not pass this
    from blockdraft.objectives.edr import reference as edr_torch

    starts32, _ = edr_torch.round_starts(acc.unsqueeze(0), torch.tensor([length]))
    rel = ((starts32[0].double() - want.round_start).abs() / want.round_start).max()
    assert rel > 1e-6


def test_torch_fallback_when_numba_is_missing(monkeypatch) -> None:
    from blockdraft.objectives.edr import recursion as edr_recursion

    gen = torch.Generator().manual_seed(9)
    acc, cost, lens = _ragged_batch(gen, [5, 9, 2], 3, torch.float64)
    want = occupancy_and_value(acc, cost, lens, backend="compiled")
    monkeypatch.setattr(edr_recursion, "_KERNELS", False)  # as if the import had failed
    got = occupancy_and_value(acc, cost, lens)  # "auto" -> torch loop
    torch.testing.assert_close(got.td, want.td, rtol=1e-12, atol=1e-12)
    with pytest.raises(ImportError, match="numba"):
        occupancy_and_value(acc, cost, lens, backend="compiled")
    with pytest.raises(ValueError, match="backend"):
        occupancy_and_value(acc, cost, lens, backend="cuda")
    monkeypatch.undo()
    with pytest.raises(ValueError, match="backend"):  # one plain rollout: same check
        occupancy_and_value(acc[0, :4], cost[0, :4], backend="cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_single_rollout_fast_path_equals_general_path(dtype: torch.dtype, monkeypatch) -> None:
    """One plain CPU rollout goes straight to `occupancy_value_rollout`; the same rollout
    as a batch of one, with autograd or with a cost of another dtype takes the general
    path, a column-major copy the lean path again (made C-contiguous): identical outputs,
    dtypes and shapes."""
    from blockdraft.objectives.edr import kernels as edr_kernels
    from blockdraft.objectives.edr import recursion as edr_recursion

    calls: list[int] = []
    original = edr_kernels.occupancy_value_rollout

    def spy(acc, cost):
        calls.append(1)
        return original(acc, cost)

    gen = torch.Generator().manual_seed(17)
    acc = (0.2 + 0.8 * torch.rand(40, 5, generator=gen, dtype=torch.float64)).to(dtype)
    cost = torch.rand(40, 5, generator=gen, dtype=torch.float64).to(dtype)
    occupancy_and_value(acc, cost)  # loads the kernels module
    monkeypatch.setattr(edr_recursion._KERNELS, "occupancy_value_rollout", spy)
    fast = occupancy_and_value(acc, cost)
    assert calls == [1]
    strided_acc = torch.empty(5, 40, dtype=dtype).t().copy_(acc)  # same values, column-major
    other_dtype = torch.float64 if dtype == torch.float32 else torch.float32
    variants = {
        "batch of one": occupancy_and_value(acc[None], cost[None], torch.tensor([41])),
        "autograd": occupancy_and_value(acc.clone().requires_grad_(), cost),
        "non-contiguous": occupancy_and_value(strided_acc, cost),
        "mixed dtypes": occupancy_and_value(acc, cost.to(other_dtype)),
    }
    assert len(calls) == 2  # only the column-major copy took the lean path
    for label, other in variants.items():
        for name in ("occupancy", "value", "td", "row_value", "objective", "round_start"):
            got = getattr(fast, name)
            want = getattr(other, name)[0] if label == "batch of one" else getattr(other, name)
            assert got.dtype == want.dtype and got.shape == want.shape, (label, name)
            if label == "mixed dtypes":  # float64 costs: values differ by their rounding
                torch.testing.assert_close(got, want, msg=f"{label}: {name}")
            else:
                torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{label}: {name}")
    assert fast.occupancy.dtype == torch.float64 and fast.td.dtype == dtype
    assert fast.objective.shape == ()
