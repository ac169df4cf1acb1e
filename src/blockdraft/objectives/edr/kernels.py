"""Compiled (numba) EDR recursions: occupancies, values and TD terms in O(L*K).

Why a compiled scalar loop: the recursions are sequential over positions with only K+1
states each, so a tensor formulation pays kernel launches per position for nanoseconds of
work, while a scalar loop over rollouts, rows and proposals runs at memory speed (on a GPU
`recursion.py` copies the tensors to the host and back). Layout: that of `recursion.py`;
all arithmetic in float64 (docs/methods.md, "EDR", precision); outputs are written in full
(exact zeros where no state exists), so callers pass `np.empty`. Cached on disk
(`cache=True`): only the first import in a fresh checkout compiles them.
"""

from __future__ import annotations

import numba
import numpy as np

_U1 = np.uint64(1)


@numba.njit(cache=True, nogil=True)
def _forward_rollout(acc, cst, length, omega, row_value, starts, with_cost):  # pragma: no cover
    """Round-start occupancies and state occupancies of one rollout (float64 `omega`).

    `starts[j]` accumulates the probability that a round starts at position j+1 from the
    handovers of earlier rounds (every term is >= 0). Returns J when `with_cost`.
    Rows whose every state is live (n + K + 1 < L) take a branch-free loop with unsigned
    indices (signed ones cost a negative-index check per access: ~1.7x slower)."""
    rows, k = acc.shape
    live_rows = length - 1 if length >= 2 else 0
    inner = max(live_rows - k - 1, 0)
    for j in range(live_rows):
        starts[j] = 0.0
    if live_rows > 0:
        starts[0] = 1.0
    total = 1.0 if live_rows > 0 else 0.0
    uk = np.uint64(k)
    for jj in range(inner):
        i = np.uint64(jj)
        p = starts[i]
        omega[i, 0] = p
        rv = 0.0
        for hh in range(k):
            h = np.uint64(hh)
            a = np.float64(acc[i, h])
            starts[i + h + _U1] += p * (1.0 - a)
            if with_cost:
                rv += p * np.float64(cst[i, h])
            p *= a
            omega[i, h + _U1] = p
        starts[i + uk + _U1] += p  # bonus: a new round starts at n + K + 1
        if with_cost:
            rv += p
            row_value[i] = rv
            total += rv
    for i in range(inner, live_rows):  # the last K + 1 rows reach x_L
        n = i + 1
        p = starts[i]
        rv = 0.0
        for h in range(1, k + 2):
            t = n + h
            if t > length:
                omega[i, h - 1] = 0.0
                continue
            omega[i, h - 1] = p
            if t == length:  # x_L is emitted whatever happens: nothing after it
                continue
            if h <= k:
                a = np.float64(acc[i, h - 1])
                starts[t - 1] += p * (1.0 - a)
                if with_cost:
                    rv += p * np.float64(cst[i, h - 1])
                p *= a
            else:
                starts[t - 1] += p
                rv += p
        if with_cost:
            row_value[i] = rv
            total += rv
    for i in range(live_rows, rows):
        for h in range(k + 1):
            omega[i, h] = 0.0
        if with_cost:
            row_value[i] = 0.0
    return total


@numba.njit(cache=True, nogil=True)
def _backward_rollout(acc, cst, length, value, td, vstart):  # pragma: no cover
    """Values V_{n,t} and TD terms V_{n,t+1} - V_{t,t+1} of one rollout, row by row from
    the end: state (n, t) needs V_{t,t+1} of a later row (`vstart`) and V_{n,t+1} of the
    same row, so one reverse pass over rows with an inner reverse pass over h suffices."""
    rows, k = acc.shape
    live_rows = length - 1 if length >= 2 else 0
    inner = max(live_rows - k - 1, 0)
    for i in range(live_rows, rows):
        for h in range(k):
            value[i, h] = 0.0
            td[i, h] = 0.0
        value[i, k] = 0.0
    for i in range(live_rows - 1, inner - 1, -1):  # the last K + 1 rows reach x_L
        n = i + 1
        t = n + k + 1
        v = 1.0 + vstart[t - 1] if t < length else 0.0  # bonus state
        value[i, k] = v
        for h in range(k, 0, -1):
            t = n + h
            if t < length:
                rest = vstart[t - 1]  # V_{t,t+1}: a later row, already computed
                d = v - rest
                td[i, h - 1] = d
                v = np.float64(cst[i, h - 1]) + np.float64(acc[i, h - 1]) * d + rest
            else:
                td[i, h - 1] = 0.0
                v = 0.0
            value[i, h - 1] = v
        vstart[i] = v
    uk = np.uint64(k)
    for ii in range(inner):  # every state live: branch-free, unsigned indices
        i = np.uint64(inner - 1 - ii)
        v = 1.0 + vstart[i + uk + _U1]
        value[i, uk] = v
        for hh in range(k):
            h = np.uint64(k - 1 - hh)
            rest = vstart[i + h + _U1]
            d = v - rest
            td[i, h] = d
            v = np.float64(cst[i, h]) + np.float64(acc[i, h]) * d + rest
            value[i, h] = v
        vstart[i] = v


@numba.njit(cache=True, nogil=True)
def occupancy_value_batch(
    acc, cst, lengths, omega, value, td, row_value, objective
):  # pragma: no cover
    """Fill `omega` (float64), `value [B,M,K+1]`, `td [B,M,K]`, `row_value [B,M]` and
    `objective [B]` for `acc`, `cst [B,M,K]` and `lengths [B]` (int64)."""
    batch, rows, k = acc.shape
    starts = np.empty(rows + k + 2, dtype=np.float64)
    vstart = np.empty(rows + k + 2, dtype=np.float64)
    for b in range(batch):
        length = lengths[b]
        objective[b] = _forward_rollout(
            acc[b], cst[b], length, omega[b], row_value[b], starts, True
        )
        _backward_rollout(acc[b], cst[b], length, value[b], td[b], vstart)


@numba.njit(cache=True, nogil=True)
def occupancy_batch(acc, lengths, omega):  # pragma: no cover
    """Forward pass only: `omega [B,M,K+1]` (float64) for `acc [B,M,K]`, `lengths [B]`."""
    batch, rows, k = acc.shape
    starts = np.empty(rows + k + 2, dtype=np.float64)
    dummy = np.empty(1, dtype=np.float64)
    for b in range(batch):
        _forward_rollout(acc[b], acc[b], lengths[b], omega[b], dummy, starts, False)


@numba.njit(cache=True, nogil=True)
def occupancy_value_rollout(acc, cst):  # pragma: no cover
    """One whole rollout `[L-1, K]`: allocates and returns `(omega, value, td, row_value,
    objective)` (0-d) (the single-rollout call is dominated by fixed costs, so the
    allocations happen here rather than as separate Python calls)."""
    rows, k = acc.shape
    omega = np.empty((rows, k + 1), dtype=np.float64)
    value = np.empty((rows, k + 1), dtype=acc.dtype)
    td = np.empty((rows, k), dtype=acc.dtype)
    row_value = np.empty(rows, dtype=acc.dtype)
    objective = np.empty((), dtype=acc.dtype)
    scratch = np.empty(rows + k + 2, dtype=np.float64)
    objective[()] = _forward_rollout(acc, cst, rows + 1, omega, row_value, scratch, True)
    _backward_rollout(acc, cst, rows + 1, value, td, scratch)
    return omega, value, td, row_value, objective
