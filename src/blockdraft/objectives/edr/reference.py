"""The EDR recursions in plain torch: the readable reference and the no-numba fallback.

Same quantities as `kernels.py`, one Python loop over positions each way, vectorised over
proposals and rollouts, in float64: what the tests compare the compiled kernels against
(besides path enumeration and autograd). Forward: only the round-start occupancies need a
sequential pass (exactly one round is active at each position). Backward: the states
deciding one position form an anti-diagonal of the `[n, h]` grid, so the value recursion
steps along t on a skewed strided view. Inputs: the normalised batch of
`recursion.as_batch`, ignored entries zeroed.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

_CHUNK = 16  # positions per chunk of the forward pass (see `round_starts`)


def _skew_view(s: Tensor, rows: int, k: int) -> Tensor:
    """`[B, M, K+1]` view of the states `(n, n+h)`, h = 1..K+1, inside a contiguous
    `[B, T, K+1]` skewed grid (T = rows + K + 3) that stores them at `[t = n+h, h-1]`.

    Why a view: the flat offset `(n+h)(K+1) + h-1` is linear in n and h (strides K+1
    and K+2), so conversions are one strided copy instead of an index gather/scatter."""
    batch, size, _ = s.shape
    if size != rows + k + 3 or not s.is_contiguous():
        raise ValueError(f"expected a contiguous [B, {rows + k + 3}, {k + 1}] grid")
    return s.as_strided(
        (batch, rows, k + 1), (size * (k + 1), k + 1, k + 2), s.storage_offset() + 2 * k + 2
    )


def _to_skew(x: Tensor, k: int) -> Tensor:
    """`[B, M, K]` row layout -> `[B, T, K+1]` skewed (column K, the bonus, is zero)."""
    batch, rows, _ = x.shape
    flat = x.new_zeros((batch, rows + k + 3, k + 1))
    _skew_view(flat, rows, k)[..., :k].copy_(x)
    return flat


def _from_skew(s: Tensor, rows: int, k: int) -> Tensor:
    """`[B, T, K+1]` skewed (T = rows + K + 3) -> `[B, M, K+1]` row layout (a copy)."""
    return _skew_view(s, rows, k).contiguous()


def round_starts(acc: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """Round-start occupancies `R [B, M]` (R_n = omega_{n,n+1}) and the within-round
    reach products `P [B, M, K]` (`P[b, n-1, j-1] = prod_{i<=j} A_{n,n+i}`).

    Exactly one round is active at every position: either a round starts at t, or an
    earlier round n (t-K <= n < t) accepted the draft of x_t, which has probability
    R_n P_{t-n}. Hence R_t = 1 - sum_{n=t-K}^{t-1} R_n P_{t-n}[n] (t >= 2; R_1 = 1 if
    L >= 2). We keep the running `U_t = -(1[L >= 2] - coverage pushed to t so far)`, which
    is -R_t once every n < t has pushed: the step for start n is one fused in-place
    `U[n+1..n+K] -= U_n * P[n]` on a preallocated buffer (views made once by `unbind`).
    `1 - coverage` cancels when acceptance is near certain, which is why this runs in
    float64 (the compiled kernel sums the positive handover terms instead).
    Entries at positions >= L only push to positions > L and are masked at the end."""
    batch, rows, k = acc.shape
    reach = torch.cumprod(acc, dim=-1)  # [B, M, K], contiguous like acc
    size = rows + k + 2
    neg = acc.new_empty((batch, size))  # neg[:, t] -> -R_t (column t = position t)
    neg.copy_((lengths >= 2).to(acc.dtype).neg().unsqueeze(1).expand(batch, size))
    windows = neg.as_strided((rows, batch, k), (1, size, 1), neg.storage_offset() + 2)
    own = neg.t()[1 : rows + 1].unsqueeze(-1)
    windows, own = windows.unbind(0), own.unbind(0)
    buf = acc.new_empty((batch, min(_CHUNK, rows), k))
    for lo in range(0, rows, _CHUNK):  # a small contiguous copy of P reads ~2x faster
        hi = min(lo + _CHUNK, rows)
        block = buf[:, : hi - lo]
        block.copy_(reach[:, lo:hi])
        for w, r, p in zip(windows[lo:hi], own[lo:hi], block.unbind(1), strict=True):
            w.addcmul_(p, r, value=-1)
    n_idx = torch.arange(1, rows + 1, device=acc.device).view(1, -1)
    valid = n_idx < lengths.view(-1, 1)
    zero = torch.zeros((), dtype=acc.dtype, device=acc.device)
    return torch.where(valid, neg[:, 1 : rows + 1].neg(), zero), reach


def state_occupancy(acc: Tensor, lengths: Tensor) -> Tensor:
    """omega `[B, M, K+1]` in float64 (0 for states that do not exist)."""
    acc = acc.double()
    batch, rows, k = acc.shape
    starts, reach = round_starts(acc, lengths)
    omega = acc.new_empty((batch, rows, k + 1))  # R_n P_{h-1}, P_0 = 1
    omega[..., 0] = starts
    torch.mul(reach, starts.unsqueeze(-1), out=omega[..., 1:])
    n = torch.arange(1, rows + 1, device=acc.device).view(1, -1, 1)
    h = torch.arange(1, k + 2, device=acc.device).view(1, 1, -1)
    exists = (n + h <= lengths.view(-1, 1, 1)) & (n < lengths.view(-1, 1, 1))
    return torch.where(exists, omega, torch.zeros((), dtype=acc.dtype, device=acc.device))


def occupancy_and_value(
    acc: Tensor, cst: Tensor, lengths: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`(omega, value, td, row_value, objective)` in float64 for a sanitised batch (the
    field meanings are those of `edr.recursion.OccupancyValue`)."""
    acc, cst = acc.double(), cst.double()
    batch, rows, k = acc.shape
    omega = state_occupancy(acc, lengths)

    a_skew, c_skew = _to_skew(acc, k), _to_skew(cst, k)
    size = rows + k + 3
    values = acc.new_zeros((batch, size, k + 1))
    tds = acc.new_zeros((batch, size, k + 1))  # same skewed grid; column K stays 0
    steps = torch.arange(size, device=acc.device).view(-1, 1, 1)
    alive = (lengths.view(1, -1, 1) > steps).to(acc.dtype)  # [T, B, 1]: position t < L
    nxt = acc.new_zeros((batch, k + 1))  # V at t = L_max + 1: nothing left
    for t in range(rows + 1, 1, -1):  # in place on views of the preallocated grids
        a, c = a_skew[:, t, :k], c_skew[:, t, :k]
        cur, td, restart = values[:, t], tds[:, t, :k], nxt[:, :1]  # restart = V_{t,t+1}
        torch.sub(nxt[:, 1:], restart, out=td)
        torch.addcmul(c, a, td, out=cur[:, :k])  # c + A V_{n,t+1} + (1-A) V_{t,t+1}
        cur[:, :k].add_(restart)
        torch.add(restart, 1, out=cur[:, k:])  # bonus: a new round starts at t
        cur.mul_(alive[t])
        td.mul_(alive[t])
        nxt = cur
    value = _from_skew(values, rows, k)
    td_rows = _from_skew(tds, rows, k)[..., :k]

    n = torch.arange(1, rows + 1, device=acc.device)
    bonus_live = ((n + k + 1).view(1, -1) < lengths.view(-1, 1)).to(acc.dtype)
    row_value = (omega[..., :k] * cst).sum(-1) + omega[..., k] * bonus_live
    objective = (lengths >= 2).to(acc.dtype) + row_value.sum(-1)
    return omega, value, td_rows, row_value, objective
