"""The EDR Markov reward process (docs/methods.md, "EDR"): occupancy / value recursions and
the exact objective, with the host glue that runs them compiled.

Conditioned on a rollout, speculative decoding is a Markov chain on states `(n, t)` (the
round started at n is deciding position t). `state_occupancy`, `occupancy_and_value` and
`expected_rounds` run its recursions through `kernels.py` (numba) or `reference.py`
(torch) in float64; `rounds_objective` is the slow, independent autograd reference.
States, transitions and J: docs/methods.md ("EDR"); layouts and dtypes returned:
docs/architecture.md ("objectives").
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from blockdraft.objectives.edr import reference

Tensor = torch.Tensor


@dataclass(frozen=True)
class OccupancyValue:
    """Detached recursion results (leading batch dim only for batched inputs). Computed
    in float64; `occupancy` is returned in float64, the other fields in the input's
    working dtype (float32 or float64; see the module docstring for why).

    occupancy     `[..., L-1, K+1]` omega_{n,n+h}: probability of visiting the state.
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
    row_value: Tensor
    objective: Tensor

    @property
    def round_start(self) -> Tensor:
        return self.occupancy[..., 0]


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


def as_batch(
    acceptance: Tensor, cost: Tensor | None = None, lengths: Tensor | None = None
) -> tuple[Tensor, Tensor | None, Tensor, bool]:
    """Normalise inputs to `[B, M, K]` (M = L_max - 1) plus `lengths [B]`.

    Returns `(acceptance, cost, lengths, single)`; `single` says the input was one
    rollout `[L-1, K]` (outputs then drop the batch dim)."""
    single = check_shapes(acceptance, cost, lengths)
    dtype = work_dtype(acceptance)
    acc = acceptance.to(dtype)
    cst = None if cost is None else cost.to(dtype)
    if single:
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
            # lazy: importing it loads numba and its kernels (seconds); "torch" never needs it
            from blockdraft.objectives.edr import kernels as edr_kernels
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


_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)  # singletons: `is` compares


# --- forward occupancy ---------------------------------------------------------------


def state_occupancy(
    acceptance: Tensor, lengths: Tensor | None = None, *, backend: str = "auto"
) -> Tensor:
    """omega_{n,n+h} for h = 1..K+1, `[..., L-1, K+1]` float64 (last column: bonus
    state); 0 for states that do not exist (t > L). Detached (see `rounds_objective` for
    an autograd path)."""
    kernels = _kernels(backend)
    if kernels is None:
        acc, _, lens, single = as_batch(acceptance.detach(), None, lengths)
        _, live = proposal_masks(lens, acc.shape[1], acc.shape[2])
        with torch.no_grad():
            omega = reference.state_occupancy(_sanitize(acc, live), lens)
        return omega[0] if single else omega
    acc, _, lens, single = host_arrays(acceptance, None, lengths)
    batch, rows, k = acc.shape
    omega = np.empty((batch, rows, k + 1))
    kernels.occupancy_batch(acc, lens, omega)
    (out,) = to_torch((omega[0] if single else omega,), acceptance.device)
    return out


def expected_rounds(acceptance: Tensor, lengths: Tensor | None = None) -> Tensor:
    """Exact expected number of drafting rounds given the rollout(s): `sum_n omega_{n,n+1}`.

    Same as `rounds_objective(acceptance, 1 - acceptance)`. Without autograd it runs the
    fast detached recursion; if `acceptance` requires grad it uses the differentiable
    reference instead. Scalar (float64) for one rollout, `[B]` for a batch."""
    if torch.is_grad_enabled() and acceptance.requires_grad:
        return rounds_objective(acceptance, 1 - acceptance, lengths)
    return state_occupancy(acceptance, lengths)[..., 0].sum(-1)


# --- forward + backward, detached ------------------------------------------------------


def occupancy_and_value(
    acceptance: Tensor, cost: Tensor, lengths: Tensor | None = None, *, backend: str = "auto"
) -> OccupancyValue:
    """Occupancies (forward) and values (backward) of the rounds objective, detached,
    in float64.

    `backend`: "compiled" (numba kernels, `edr/kernels.py`; inputs on an accelerator are
    copied to the host and the results back), "torch" (the loop-over-positions
    reference, `edr/reference.py`) or "auto" (compiled when numba imports)."""
    fast = backend == "auto" or backend == "compiled"
    if fast and lengths is None and _KERNELS and type(acceptance) is Tensor:
        # One plain rollout (CPU, float32 or float64 for both, no autograd, [L-1, K >= 1])
        # goes straight to the kernel, checked inline: at L = 256 the kernel takes ~6 us
        # and each helper call, checked attribute or dataclass __init__ ~0.1-0.3 us
        # (bench/edr_dp.py). Anything else takes the general path (validation, clear
        # errors, conversions).
        try:  # .numpy() raises for tensors that require grad or live on an accelerator
            acc, cst = acceptance.numpy(), cost.numpy()
        except (AttributeError, RuntimeError, TypeError):
            acc = None
        if acc is not None:
            shape, dtype = acc.shape, acc.dtype
            if (
                len(shape) == 2
                and shape[1]
                and shape == cst.shape
                and (dtype is _F32 or dtype is _F64)
                and cst.dtype is dtype
            ):
                omega, value, td, row_value, objective = _KERNELS.occupancy_value_rollout(
                    np.ascontiguousarray(acc), np.ascontiguousarray(cst)
                )
                state = object.__new__(OccupancyValue)  # the frozen fields, set directly
                state.__dict__.update(
                    occupancy=torch.from_numpy(omega),
                    value=torch.from_numpy(value),
                    td=torch.from_numpy(td),
                    row_value=torch.from_numpy(row_value),
                    objective=torch.from_numpy(objective),
                )
                return state
    kernels = _kernels(backend)
    if kernels is None:
        acc, cst, lens, single = as_batch(acceptance.detach(), cost.detach(), lengths)
        assert cst is not None
        _, live = proposal_masks(lens, acc.shape[1], acc.shape[2])
        with torch.no_grad():
            omega, *rest = reference.occupancy_and_value(
                _sanitize(acc, live), _sanitize(cst, live), lens
            )
        outputs = (omega, *(t.to(acc.dtype) for t in rest))
        if single:
            outputs = tuple(t[0] for t in outputs)
        return OccupancyValue(*outputs)
    # the kernels never read ignored entries (NaN allowed there): no sanitising needed
    acc, cst, lens, single = host_arrays(acceptance, cost, lengths)
    batch, rows, k = acc.shape
    dtype = acc.dtype  # float32 inputs: values stored in float32 (computed in float64)
    outputs = (
        np.empty((batch, rows, k + 1)),  # occupancy, float64
        np.empty((batch, rows, k + 1), dtype),  # value
        np.empty((batch, rows, k), dtype),  # td
        np.empty((batch, rows), dtype),  # row_value
        np.empty(batch, dtype),  # objective
    )
    kernels.occupancy_value_batch(acc, cst, lens, *outputs)
    if single:
        outputs = tuple(a[0, ...] for a in outputs)  # `...` keeps 0-d arrays as arrays
    return OccupancyValue(*to_torch(outputs, acceptance.device))


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


# ---- host glue for the numba kernels: input checks and torch <-> numpy, kept lean
# (for short rollouts they are a large share of a call) ----


def work_dtype(t: Tensor) -> torch.dtype:
    """The kernels' input dtype for `t`: float32 or float64 (never less than float32)."""
    if not t.is_floating_point():
        return torch.float32
    return torch.promote_types(t.dtype, torch.float32)


def check_shapes(acceptance: Tensor, cost: Tensor | None, lengths: object) -> bool:
    """Raise on malformed inputs; return whether it is a single rollout `[L-1, K]`."""
    if not isinstance(acceptance, Tensor):
        raise TypeError(f"acceptance must be a torch.Tensor, got {type(acceptance).__name__}")
    shape = acceptance.shape
    if len(shape) not in (2, 3):
        raise ValueError(f"acceptance must be [L-1, K] or [B, L-1, K], got shape {tuple(shape)}")
    if shape[-1] < 1:
        raise ValueError(f"acceptance needs K >= 1 proposals, got shape {tuple(shape)}")
    if cost is not None and cost.shape != shape:
        raise ValueError(
            f"cost {tuple(cost.shape)} must have the shape of acceptance {tuple(shape)}"
        )
    if len(shape) == 2 and lengths is not None:
        raise ValueError("lengths is only for batched [B, L-1, K] inputs")
    return len(shape) == 2


def host_arrays(
    acceptance: Tensor, cost: Tensor | None, lengths: Tensor | None
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, bool]:
    """`(acc [B,M,K], cost, lengths [B] int64, single)` as host numpy arrays for the
    kernels: float32/float64 kept (other dtypes -> float32), one device transfer for
    accelerator inputs. Lean on purpose: for short rollouts this is most of the cost."""
    single = check_shapes(acceptance, cost, lengths)
    dtype = work_dtype(acceptance)
    if acceptance.device.type == "cpu":
        acc = as_numpy(acceptance, dtype)
        cst = None if cost is None else as_numpy(cost, dtype)
    elif cost is None:
        acc, cst = acceptance.detach().to("cpu", dtype).numpy(), None
    else:  # one transfer for both
        both = torch.stack((acceptance.detach().to(dtype), cost.detach().to(dtype))).cpu()
        acc, cst = both[0].numpy(), both[1].numpy()
    if single:
        acc, cst = acc[None], (None if cst is None else cst[None])
    batch, rows, _ = acc.shape
    if lengths is None:
        lens = (
            np.full(batch, rows + 1, dtype=np.int64)
            if batch > 1
            else np.array([rows + 1], dtype=np.int64)
        )
    else:
        lens = torch.as_tensor(lengths).detach().cpu().long().numpy()
        if lens.shape != (batch,):
            raise ValueError(f"lengths must have shape ({batch},), got {tuple(lens.shape)}")
        if batch and (lens.min() < 0 or lens.max() > rows + 1):
            raise ValueError(f"lengths must lie in [0, {rows + 1}] for {rows} round-start rows")
    return acc, cst, lens, single


def as_numpy(t: Tensor, dtype: torch.dtype) -> np.ndarray:
    """C-contiguous numpy view (no copy when possible) of a CPU tensor in `dtype`; no-op
    calls are skipped, since their fixed cost matters for short rollouts."""
    if t.requires_grad:
        t = t.detach()
    if t.dtype != dtype:
        t = t.to(dtype)
    return np.ascontiguousarray(t.numpy())


def to_torch(arrays: tuple[np.ndarray, ...], device: torch.device) -> tuple[Tensor, ...]:
    """Kernel outputs as tensors on `device` (zero-copy on CPU)."""
    if device.type == "cpu":
        return tuple(torch.from_numpy(a) for a in arrays)
    return tuple(torch.from_numpy(a).to(device) for a in arrays)
