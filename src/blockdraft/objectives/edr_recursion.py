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

How it is computed: `edr_kernels` (numba) runs both recursions as scalar loops over
rollouts, rows and proposals, O(B*L*K), accumulating in float64 (occupancies and round
starts are returned in float64; values and TD terms in the input's working dtype, from
float64 sums). `edr_torch` holds the same recursions as readable torch loops over
positions: the reference the tests compare against and the fallback without numba.
`rounds_objective` is the slow, independent autograd reference: a list-based recurrence
over round starts with an inner loop over proposals, differentiated by autograd.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class OccupancyValue:
    """Detached recursion results (leading batch dim only for batched inputs).

    occupancy     `[..., L-1, K+1]` omega_{n,n+h}: probability of visiting the state
                  (float64 whatever the input dtype; others in the input's dtype).
    value         `[..., L-1, K+1]` V_{n,n+h}: expected future cost from the state
                  (its own immediate cost included; 0 for states with t >= L).
    td            `[..., L-1, K]`  V_{n,t+1} - V_{t,t+1} for decision states with t < L
                  (0 elsewhere): the sensitivity of J to A_{n,t}, per unit occupancy.
    round_start   `[..., L-1]`     omega_{n,n+1}: probability that a round starts at n.
    row_value     `[..., L-1]`     the part of J charged to round start n, i.e. its
                  occupancy-weighted costs: `objective = 1[L >= 2] + row_value.sum(-1)`
                  (the leading 1 is charged to no row). Keeps anchor-sampled loss values
                  unbiased; 0 on the dead last row n = L-1 (it only drafts x_L).
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


# --- backends ------------------------------------------------------------------------

BACKENDS = ("auto", "compiled", "torch")
_KERNELS: object = None  # the edr_kernels module, False if numba is unavailable


def _kernels(backend: str):
    """The compiled kernels module for `backend`, or None for the torch recursion.

    "auto" uses the compiled kernels when numba imports (a declared dependency) and falls
    back to the torch recursion with one warning otherwise; "compiled" insists."""
    global _KERNELS
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "torch":
        return None
    if _KERNELS is None:
        try:
            from blockdraft.objectives import edr_kernels
        except ImportError as err:  # pragma: no cover - numba is a declared dependency
            warnings.warn(
                f"numba is unavailable ({err}); EDR recursions fall back to the torch loop, "
                "~1,000x slower (pip install numba)",
                RuntimeWarning,
                stacklevel=3,
            )
            _KERNELS = False
        else:
            _KERNELS = edr_kernels
    if _KERNELS is False:
        if backend == "compiled":
            raise ImportError("backend='compiled' needs numba (pip install numba)")
        return None
    return _KERNELS


def _host_inputs(*tensors: Tensor) -> list[Tensor]:
    """Contiguous CPU copies of same-shaped tensors, in one device transfer when they
    live on an accelerator (the kernels run on the host: a few MB per training step)."""
    if tensors[0].device.type == "cpu":
        return [t.contiguous() for t in tensors]
    return list(torch.stack(tensors).cpu().unbind(0)) if len(tensors) > 1 else [tensors[0].cpu()]


def _new(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Host output buffer; pinned when the results go back to a CUDA device (async copy)."""
    return torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")


def _to_device(tensors: tuple[Tensor, ...], device: torch.device) -> tuple[Tensor, ...]:
    if device.type == "cpu":
        return tensors
    return tuple(t.to(device, non_blocking=True) for t in tensors)


# --- forward occupancy ---------------------------------------------------------------


@torch.no_grad()
def state_occupancy(
    acceptance: Tensor, lengths: Tensor | None = None, *, backend: str = "auto"
) -> Tensor:
    """omega_{n,n+h} for h = 1..K+1, `[..., L-1, K+1]` float64 (last column: bonus
    state); 0 for states that do not exist (t > L). Detached (see `rounds_objective` for
    an autograd path)."""
    acc, _, lengths, single = as_batch(acceptance.detach(), None, lengths)
    kernels = _kernels(backend)
    if kernels is None:
        from blockdraft.objectives import edr_torch

        _, live = proposal_masks(lengths, acc.shape[1], acc.shape[2])
        omega = edr_torch.state_occupancy(_sanitize(acc, live), lengths)
    else:
        (a_host,) = _host_inputs(acc)
        batch, rows, k = a_host.shape
        omega = _new((batch, rows, k + 1), torch.float64, acc.device)
        kernels.occupancy_batch(a_host.numpy(), lengths.cpu().numpy(), omega.numpy())
        (omega,) = _to_device((omega,), acc.device)
    return omega[0] if single else omega


def expected_rounds(acceptance: Tensor, lengths: Tensor | None = None) -> Tensor:
    """Exact expected number of drafting rounds given the rollout(s): `sum_n omega_{n,n+1}`.

    Same as `rounds_objective(acceptance, 1 - acceptance)`. Without autograd it runs the
    fast detached recursion; if `acceptance` requires grad it uses the differentiable
    reference instead. Scalar (float64) for one rollout, `[B]` for a batch."""
    if torch.is_grad_enabled() and acceptance.requires_grad:
        return rounds_objective(acceptance, 1 - acceptance, lengths)
    omega = state_occupancy(acceptance, lengths)
    return omega[..., 0].sum(-1)


# --- forward + backward, detached ------------------------------------------------------


def occupancy_and_value(
    acceptance: Tensor, cost: Tensor, lengths: Tensor | None = None, *, backend: str = "auto"
) -> OccupancyValue:
    """Occupancies (forward) and values (backward) of the rounds objective, detached.

    `backend`: "compiled" (numba kernels, `edr_kernels`; inputs on an accelerator are
    copied to the host and the results back), "torch" (the loop-over-positions
    reference, `edr_torch`) or "auto" (compiled when numba imports)."""
    acc, cst, lengths, single = as_batch(acceptance.detach(), cost.detach(), lengths)
    assert cst is not None
    kernels = _kernels(backend)
    dtype, device = acc.dtype, acc.device
    if kernels is None:
        from blockdraft.objectives import edr_torch

        _, live = proposal_masks(lengths, acc.shape[1], acc.shape[2])
        omega, *rest = edr_torch.occupancy_and_value(
            _sanitize(acc, live), _sanitize(cst, live), lengths
        )
        value, td, row_value, objective = (t.to(dtype) for t in rest)
    else:  # the kernels never read ignored entries: no sanitising needed
        a_host, c_host = _host_inputs(acc, cst)
        batch, rows, k = a_host.shape
        omega = _new((batch, rows, k + 1), torch.float64, device)
        value = _new((batch, rows, k + 1), dtype, device)
        td = _new((batch, rows, k), dtype, device)
        row_value = _new((batch, rows), dtype, device)
        objective = _new((batch,), dtype, device)
        kernels.occupancy_value_batch(
            a_host.numpy(),
            c_host.numpy(),
            lengths.cpu().numpy(),
            omega.numpy(),
            value.numpy(),
            td.numpy(),
            row_value.numpy(),
            objective.numpy(),
        )
        omega, value, td, row_value, objective = _to_device(
            (omega, value, td, row_value, objective), device
        )
    if single:
        omega, value, td, row_value, objective = (
            omega[0], value[0], td[0], row_value[0], objective[0]
        )
    return OccupancyValue(
        occupancy=omega,
        value=value,
        td=td,
        round_start=omega[..., 0],
        row_value=row_value,
        objective=objective,
    )


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
