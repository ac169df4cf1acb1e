"""Host-side glue between torch tensors and the numba EDR kernels (`edr_kernels`).

Why its own module: for short rollouts the kernels take a few microseconds, so input
checks and torch <-> numpy conversions are a large share of a call; they live here, kept
lean on purpose, and `edr_recursion` keeps the maths.
"""

from __future__ import annotations

import numpy as np
import torch

Tensor = torch.Tensor


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
    """C-contiguous numpy view (no copy when possible) of a CPU tensor in `dtype`; each
    skipped no-op call saves ~0.5 us, which matters for short rollouts."""
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
