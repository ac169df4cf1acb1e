"""Occupancy / value recursions of the EDR Markov reward process (METHODS.md §2).

Conditioned on a target rollout `x_1..x_L`, speculative decoding is a Markov chain on
states `(n, t)`: the round that started at `n` is deciding position `t`. Layouts:

- inputs `acceptance[n-1, h-1]`, `cost[n-1, h-1]` (`[L-1, K]`, or `[B, L_max-1, K]` with
  `lengths [B]`) for the decision state `(n, n+h)`, h = 1..K;
- state outputs `[..., L-1, K+1]`: column `h-1` is state `(n, n+h)`, the last column
  (h = K+1) is the *bonus* state reached after K acceptances.

Transitions: from `(n, t)`, `t <= n+K`, `t < L`: with prob `A` go to `(n, t+1)`, else the
round ends and the next one starts at t, i.e. state `(t, t+1)`. From the bonus state
`(n, n+K+1)`, `n+K+1 < L`, the next round starts at `n+K+1`. Any state with `t = L`
ends the generation (x_L is emitted whatever happens, no bonus after it), so acceptance
and cost entries with `n+h >= L` never influence the objective (entries with `n+h = L`
still matter for the per-proposal statistics of the evaluator).

Objective with an immediate cost (the *rounds objective*):

    J = 1 + sum_{t<L, t<=n+K} omega_{n,t} c_{n,t} + sum_{n+K+1<L} omega_{n,n+K+1}

for L >= 2 (J = 0 for L = 1: no drafting round). The bonus state's cost is the constant
1 (a bonus always starts a new round). With `c = 1 - A` every term counts one round start
and J is the expected number of rounds `sum_n omega_{n,n+1}`.

How it is computed (one Python loop over positions each way, vectorised over proposals
and rollouts):
- forward: omega_{n,n+h} = R_n * prod_{i<h} A_{n,n+i}, so only the round-start
  occupancies R need a sequential pass (`_round_starts`: one fused in-place op per
  position, using that exactly one round is active at every position);
- backward (values): states deciding the same position t form one anti-diagonal of the
  `[n, h]` grid, and V_{n,t} needs V at position t+1 only, so the value recursion steps
  along t on a *skewed* copy of the tensors (`_to_skew`, a strided view, in place).
`rounds_objective` is the slow, independent autograd reference: a list-based recurrence
over round starts with an inner loop over proposals, differentiated by autograd.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class OccupancyValue:
    """Detached recursion results (leading batch dim only for batched inputs).

    occupancy     `[..., L-1, K+1]` omega_{n,n+h}: probability of visiting the state.
    value         `[..., L-1, K+1]` V_{n,n+h}: expected future cost from the state
                  (its own immediate cost included; 0 for states with t >= L).
    td            `[..., L-1, K]`  V_{n,t+1} - V_{t,t+1} for decision states with t < L
                  (0 elsewhere): the sensitivity of J to A_{n,t}, per unit occupancy.
    round_start   `[..., L-1]`     omega_{n,n+1}: probability that a round starts at n.
    row_value     `[..., L-1]`     the part of J charged to round start n (the leading 1
                  goes to n = 1); sums to `objective`. Used to keep anchor-sampled
                  loss values unbiased.
    objective     `[...]`          J from the forward recursion.
    """

    occupancy: Tensor
    value: Tensor
    td: Tensor
    round_start: Tensor
    row_value: Tensor
    objective: Tensor


# --- input handling -----------------------------------------------------------------


def pad_rollouts(tensors: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Stack per-rollout `[L_i-1, K]` tensors into `[B, max(L_i)-1, K]` (zero padded)
    and return it with `lengths [B]` (L_i)."""
    if len(tensors) == 0:
        raise ValueError("need at least one rollout tensor")
    k = tensors[0].shape[-1] if tensors[0].dim() == 2 else -1
    for i, t in enumerate(tensors):
        if t.dim() != 2 or t.shape[1] != k:
            raise ValueError(f"rollout {i}: expected a [L-1, {k}] tensor, got {tuple(t.shape)}")
    rows = max(t.shape[0] for t in tensors)
    out = tensors[0].new_zeros((len(tensors), rows, k))
    for i, t in enumerate(tensors):
        out[i, : t.shape[0]] = t
    lengths = torch.tensor([t.shape[0] + 1 for t in tensors], device=out.device)
    return out, lengths


def _work_dtype(t: Tensor) -> torch.dtype:
    if not t.is_floating_point():
        return torch.float32
    return torch.promote_types(t.dtype, torch.float32)


def as_batch(
    acceptance: Tensor, cost: Tensor | None = None, lengths: Tensor | None = None
) -> tuple[Tensor, Tensor | None, Tensor, bool]:
    """Normalise inputs to `[B, M, K]` (M = L_max - 1) plus `lengths [B]`.

    Returns `(acceptance, cost, lengths, single)`; `single` says the input was one
    rollout `[L-1, K]` (outputs then drop the batch dim)."""
    if not isinstance(acceptance, Tensor):
        raise TypeError(f"acceptance must be a torch.Tensor, got {type(acceptance).__name__}")
    single = acceptance.dim() == 2
    if acceptance.dim() not in (2, 3):
        raise ValueError(
            f"acceptance must be [L-1, K] or [B, L-1, K], got shape {tuple(acceptance.shape)}"
        )
    if acceptance.shape[-1] < 1:
        raise ValueError(f"acceptance needs K >= 1 proposals, got shape {tuple(acceptance.shape)}")
    if cost is not None and cost.shape != acceptance.shape:
        raise ValueError(
            f"cost {tuple(cost.shape)} must have the shape of acceptance {tuple(acceptance.shape)}"
        )
    dtype = _work_dtype(acceptance)
    acc = acceptance.to(dtype)
    cst = None if cost is None else cost.to(dtype)
    if single:
        if lengths is not None:
            raise ValueError("lengths is only for batched [B, L-1, K] inputs")
        acc = acc.unsqueeze(0)
        cst = None if cst is None else cst.unsqueeze(0)
    batch, rows, _ = acc.shape
    if lengths is None:
        lengths = torch.full((batch,), rows + 1, dtype=torch.long, device=acc.device)
    else:
        lengths = torch.as_tensor(lengths, device=acc.device).long()
        if lengths.shape != (batch,):
            raise ValueError(f"lengths must have shape ({batch},), got {tuple(lengths.shape)}")
        if batch and (int(lengths.min()) < 0 or int(lengths.max()) > rows + 1):
            raise ValueError(f"lengths must lie in [0, {rows + 1}] for {rows} round-start rows")
    return acc, cst, lengths, single


def proposal_masks(lengths: Tensor, rows: int, k: int) -> tuple[Tensor, Tensor]:
    """`(exists, live)` masks `[B, M, K]`: proposal `h` of round `n` exists iff
    `n+h <= L`; it is *live* (its acceptance/cost can change J) iff `n+h < L`."""
    n = torch.arange(1, rows + 1, device=lengths.device).view(1, rows, 1)
    h = torch.arange(1, k + 1, device=lengths.device).view(1, 1, k)
    t = n + h
    big_l = lengths.view(-1, 1, 1)
    return t <= big_l, t < big_l


def _sanitize(x: Tensor, mask: Tensor) -> Tensor:
    """Zero ignored entries (they may hold garbage or NaN) without leaking gradients."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


# --- skewed layout --------------------------------------------------------------------


def _skew_view(s: Tensor, rows: int, k: int) -> Tensor:
    """`[B, M, K+1]` view of the states `(n, n+h)`, h = 1..K+1, inside a contiguous
    `[B, T, K+1]` skewed grid (T = rows + K + 3) that stores them at `[t = n+h, h-1]`.

    Why a view: the flat offset `(n+h)(K+1) + h-1` is linear in n and h (strides K+1
    and K+2), so conversions are one strided copy instead of an index gather/scatter
    (which needed `[M*(K+1)]` index tensors and dominated `occupancy_and_value`)."""
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


# --- forward occupancy ---------------------------------------------------------------


_CHUNK = 16  # positions per chunk of the forward pass (see `_round_starts`)


def _round_starts(acc: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """Round-start occupancies `R [B, M]` (R_n = omega_{n,n+1}) and the within-round
    reach products `P [B, M, K]` (`P[b, n-1, j-1] = prod_{i<=j} A_{n,n+i}`), detached.

    Why this shape: omega_{n,n+h} = R_n P_{h-1} (P_0 = 1), so the only sequential part is
    R. Exactly one round is active at every position: either a round starts at t, or an
    earlier round n (t-K <= n < t) accepted the draft of x_t, which has probability
    R_n P_{t-n}. Hence R_t = 1 - sum_{n=t-K}^{t-1} R_n P_{t-n}[n] (t >= 2; R_1 = 1 if
    L >= 2). This is the banded recurrence R_t = sum_j R_{t-j} E_{t-j,j} with the handover
    probabilities E = P_{j-1} - P_j (E = P_K for the bonus) summed by parts, so it needs
    only the cumprod P, never a `[B, M, K+1]` handover tensor (whose construction with
    strided copies cost more than the whole recursion).

    We keep the running `U_t = -(1[L >= 2] - coverage pushed to t so far)`, which is
    -R_t once every n < t has pushed: the step for start n is then one fused in-place
    `U[n+1..n+K] -= U_n * P[n]` on a preallocated buffer. The per-step views are made
    once in C++ (`unbind` of an as-strided view), so the Python loop does no slicing.
    P is read position by position, i.e. rows strided by M*K across the batch, which
    defeats the prefetcher; copying it `_CHUNK` positions at a time into a small
    contiguous buffer (L2-resident, inner run `_CHUNK*K`) measured ~2x faster than
    reading P in place. No transposes: on CPU those cost more than everything else
    (the previous position-major version spent most of its time transposing).
    Entries at positions >= L only push to positions > L, so garbage there never reaches
    a valid start and is masked at the end."""
    batch, rows, k = acc.shape
    reach = torch.cumprod(acc, dim=-1)  # [B, M, K], contiguous like acc
    size = rows + k + 2
    neg = acc.new_empty((batch, size))  # neg[:, t] -> -R_t (column t = position t)
    neg.copy_((lengths >= 2).to(acc.dtype).neg().unsqueeze(1).expand(batch, size))
    # windows[n-1] = neg[:, n+1 : n+K+1], own[n-1] = neg[:, n : n+1]
    windows = neg.as_strided((rows, batch, k), (1, size, 1), neg.storage_offset() + 2)
    own = neg.t()[1 : rows + 1].unsqueeze(-1)
    windows, own = windows.unbind(0), own.unbind(0)
    buf = acc.new_empty((batch, min(_CHUNK, rows), k))
    for lo in range(0, rows, _CHUNK):
        hi = min(lo + _CHUNK, rows)
        block = buf[:, : hi - lo]
        block.copy_(reach[:, lo:hi])
        for w, r, p in zip(windows[lo:hi], own[lo:hi], block.unbind(1), strict=True):
            w.addcmul_(p, r, value=-1)
    n_idx = torch.arange(1, rows + 1, device=acc.device).view(1, -1)
    valid = n_idx < lengths.view(-1, 1)
    zero = torch.zeros((), dtype=acc.dtype, device=acc.device)
    return torch.where(valid, neg[:, 1 : rows + 1].neg(), zero), reach


@torch.no_grad()
def state_occupancy(acceptance: Tensor, lengths: Tensor | None = None) -> Tensor:
    """omega_{n,n+h} for h = 1..K+1, `[..., L-1, K+1]` (last column: bonus state);
    0 for states that do not exist (t > L). Detached (see `rounds_objective` for an
    autograd path)."""
    acc, _, lengths, single = as_batch(acceptance.detach(), None, lengths)
    batch, rows, k = acc.shape
    starts, reach = _round_starts(acc, lengths)
    omega = acc.new_empty((batch, rows, k + 1))  # R_n P_{h-1}, P_0 = 1
    omega[..., 0] = starts
    torch.mul(reach, starts.unsqueeze(-1), out=omega[..., 1:])
    n = torch.arange(1, rows + 1, device=acc.device).view(1, -1, 1)
    h = torch.arange(1, k + 2, device=acc.device).view(1, 1, -1)
    exists = (n + h <= lengths.view(-1, 1, 1)) & (n < lengths.view(-1, 1, 1))
    omega = torch.where(exists, omega, torch.zeros((), dtype=acc.dtype, device=acc.device))
    return omega[0] if single else omega


def expected_rounds(acceptance: Tensor, lengths: Tensor | None = None) -> Tensor:
    """Exact expected number of drafting rounds given the rollout(s): `sum_n omega_{n,n+1}`.

    Same as `rounds_objective(acceptance, 1 - acceptance)`. Without autograd it runs the
    fast detached recursion (`_round_starts`); if `acceptance` requires grad it uses the
    differentiable reference instead. Scalar for one rollout, `[B]` for a batch."""
    if torch.is_grad_enabled() and acceptance.requires_grad:
        return rounds_objective(acceptance, 1 - acceptance, lengths)
    with torch.no_grad():
        acc, _, lengths, single = as_batch(acceptance, None, lengths)
        total = _round_starts(acc, lengths)[0].sum(-1)
    return total[0] if single else total


# --- forward + backward, detached ------------------------------------------------------


@torch.no_grad()
def occupancy_and_value(
    acceptance: Tensor, cost: Tensor, lengths: Tensor | None = None
) -> OccupancyValue:
    """Occupancies (forward) and values (backward) of the rounds objective, detached.

    One loop over positions each way, vectorised over proposals and rollouts."""
    acc, cst, lengths, single = as_batch(acceptance.detach(), cost.detach(), lengths)
    batch, rows, k = acc.shape
    _, live = proposal_masks(lengths, rows, k)
    acc, cst = _sanitize(acc, live), _sanitize(cst, live)
    omega = state_occupancy(acc, lengths)

    a_skew, c_skew = _to_skew(acc, k), _to_skew(cst, k)
    l_max = rows + 1
    size = rows + k + 3
    values = acc.new_zeros((batch, size, k + 1))
    tds = acc.new_zeros((batch, size, k + 1))  # same skewed grid; column K stays 0
    steps = torch.arange(size, device=acc.device).view(-1, 1, 1)
    alive = (lengths.view(1, -1, 1) > steps).to(acc.dtype)  # [T, B, 1]: position t < L
    nxt = acc.new_zeros((batch, k + 1))  # V at t = L_max + 1: nothing left
    # In-place on views of the preallocated grids (no per-step allocation or cat).
    for t in range(l_max, 1, -1):
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
    if rows:
        row_value[:, 0] += (lengths >= 2).to(acc.dtype)
    result = OccupancyValue(
        occupancy=omega,
        value=value,
        td=td_rows,
        round_start=omega[..., 0],
        row_value=row_value,
        objective=row_value.sum(-1),
    )
    if single:
        result = OccupancyValue(**{f: getattr(result, f)[0] for f in result.__dataclass_fields__})
    return result


# --- slow, independent autograd reference ----------------------------------------------


def rounds_objective(acceptance: Tensor, cost: Tensor, lengths: Tensor | None = None) -> Tensor:
    """Exact rounds objective J (module docstring) by a plain forward recursion over
    round starts, differentiable by autograd through the whole recursion.

    This is the slow reference the TD surrogate is checked against; use
    `occupancy_and_value` / `edr_surrogate` for training-size inputs."""
    acc, cst, lengths, single = as_batch(acceptance, cost, lengths)
    batch, rows, k = acc.shape
    _, live = proposal_masks(lengths, rows, k)
    acc, cst = _sanitize(acc, live), _sanitize(cst, live)
    ones = acc.new_ones((batch, rows, 1))
    reach = torch.cumprod(torch.cat([ones, acc], dim=2), dim=2)  # prod_{h'<h} A, h=1..K+1
    # probability that a round started at n hands over to a new round at n+h
    handover = torch.cat([reach[..., :k] * (1 - acc), reach[..., k:]], dim=2)
    big_l = lengths.to(acc.dtype)
    starts: list[Tensor] = []
    for m in range(1, rows + 1):
        if m == 1:
            r = (lengths >= 2).to(acc.dtype)
        else:
            r = acc.new_zeros(batch)
            for h in range(1, k + 2):
                if m - h >= 1:
                    r = r + starts[m - h - 1] * handover[:, m - h - 1, h - 1]
        starts.append(r * (big_l > m).to(acc.dtype))
    if rows == 0:
        total = acc.new_zeros(batch)
    else:
        start = torch.stack(starts, dim=1)
        n = torch.arange(1, rows + 1, device=acc.device).view(1, -1)
        bonus_live = ((n + k + 1) < lengths.view(-1, 1)).to(acc.dtype)
        per_start = (reach[..., :k] * cst).sum(-1) + reach[..., k] * bonus_live
        total = (lengths >= 2).to(acc.dtype) + (start * per_start).sum(-1)
    return total[0] if single else total
