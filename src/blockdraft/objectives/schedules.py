"""Fixed position-weight schedules: the baselines D-PACE is compared against.

Both schedules depend only on the proposal index j = 1..K, never on the example, which
is exactly the limitation D-PACE removes (docs/methods.md, "Baselines"). They return 1-D
weights of length K that broadcast against `[N, K]` per-proposal losses.
"""

from __future__ import annotations

import math

import torch

# DFlash's published gammas (block_size -> gamma); everything else is interpolated.
DFLASH_DECAY_GAMMAS: dict[int, float] = {8: 4.0, 10: 5.0, 16: 7.0}


def _check_num_proposals(num_proposals: int) -> None:
    if isinstance(num_proposals, bool) or not isinstance(num_proposals, int) or num_proposals < 1:
        raise ValueError(f"num_proposals must be a positive int, got {num_proposals!r}")


def uniform_weights(
    num_proposals: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Weight 1 for every proposal: plain (mean) cross-entropy over the block."""
    _check_num_proposals(num_proposals)
    return torch.ones(num_proposals, dtype=dtype, device=device)


def default_decay_gamma(block_size: int) -> float:
    """DFlash's decay constant for `block_size` (= K + 1), interpolated for other sizes.

    DFlash publishes gamma = 4, 5, 7 for block sizes 8, 10, 16. Between those points we
    interpolate linearly; outside them we extend the nearest segment's slope (1/2 below
    10, 1/3 above 16), so gamma = block_size / 2 for small blocks and grows more slowly
    for large ones, so the last proposal's weight exp(-(K-1)/gamma) keeps shrinking
    slowly as blocks grow (e^-1.5 at block 8, e^-2 at 16, e^-2.4 at 32) instead of
    jumping. Gamma is clamped to >= 0.5 so tiny blocks still get a finite schedule.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
        raise ValueError(
            f"block_size must be an int >= 2 (anchor + >= 1 proposal), got {block_size!r}"
        )
    points = sorted(DFLASH_DECAY_GAMMAS.items())
    if block_size in DFLASH_DECAY_GAMMAS:
        return DFLASH_DECAY_GAMMAS[block_size]
    # Pick the segment containing block_size, or the nearest end segment to extrapolate.
    if block_size < points[0][0]:
        (b0, g0), (b1, g1) = points[0], points[1]
    elif block_size > points[-1][0]:
        (b0, g0), (b1, g1) = points[-2], points[-1]
    else:
        idx = next(
            i for i in range(len(points) - 1) if points[i][0] <= block_size <= points[i + 1][0]
        )
        (b0, g0), (b1, g1) = points[idx], points[idx + 1]
    gamma = g0 + (g1 - g0) * (block_size - b0) / (b1 - b0)
    return max(0.5, gamma)


def decay_weights(
    num_proposals: int,
    gamma: float,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """DFlash's exponential decay `w_j = exp(-(j-1)/gamma)` for proposals j = 1..K.

    Early proposals gate every later one, so a fixed schedule that favours them is the
    DFlash baseline's crude stand-in for D-PACE's example-dependent weights.
    """
    _check_num_proposals(num_proposals)
    if (
        not isinstance(gamma, (int, float))
        or isinstance(gamma, bool)
        or not math.isfinite(gamma)
        or gamma <= 0
    ):
        raise ValueError(f"decay gamma must be a positive finite number, got {gamma!r}")
    j = torch.arange(num_proposals, dtype=torch.float64, device=device)
    return torch.exp(-j / float(gamma)).to(dtype)
