"""Seeded, vectorised bootstrap over rollouts for ratio statistics such as MAL.

MAL is a ratio of sums over rollouts (tokens / expected rounds), so the unit that is
resampled is the rollout: each bootstrap replicate draws rollouts with replacement and
recomputes the ratio of sums. For paired comparisons the *same* draw is applied to both
drafters, which is what makes the difference CI much tighter than two separate CIs.
Replicates are built as count matrices `[n_boot, R]` (chunked to bound memory) and
reduced with one matrix product per statistic. Intervals are percentile intervals.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor
_MAX_CELLS = 4_000_000  # n_boot * R entries per chunk


def _check(n_boot: int, level: float) -> None:
    if isinstance(n_boot, bool) or not isinstance(n_boot, int) or n_boot < 1:
        raise ValueError(f"n_boot must be a positive int, got {n_boot!r}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level!r}")


def resampled_sums(columns: Tensor, n_boot: int, seed: int) -> Tensor:
    """Bootstrap replicates of column sums: `columns [R, C]` -> `[n_boot, C]`, each row the
    sums over one resample of the R rollouts (with replacement). Deterministic in `seed`."""
    if columns.dim() != 2 or columns.shape[0] < 1:
        raise ValueError(f"columns must be [R, C] with R >= 1, got {tuple(columns.shape)}")
    gen = torch.Generator().manual_seed(int(seed))
    rollouts = columns.shape[0]
    data = columns.to(torch.float64).cpu()
    chunk = max(1, _MAX_CELLS // rollouts)
    out = []
    for start in range(0, n_boot, chunk):
        rows = min(chunk, n_boot - start)
        idx = torch.randint(rollouts, (rows, rollouts), generator=gen)
        counts = torch.zeros(rows, rollouts, dtype=torch.float64)
        counts.scatter_add_(1, idx, torch.ones(rows, rollouts, dtype=torch.float64))
        # one matrix-vector product per column: identical columns give bit-identical
        # sums (a paired comparison of a drafter with itself has a difference of exactly 0)
        out.append(torch.stack([counts @ data[:, j] for j in range(data.shape[1])], dim=1))
    return torch.cat(out)


def percentile_interval(samples: Tensor, level: float = 0.95) -> tuple[float, float]:
    """Two-sided percentile interval of bootstrap `samples [n_boot]`."""
    lo = torch.quantile(samples, (1 - level) / 2)
    hi = torch.quantile(samples, 1 - (1 - level) / 2)
    return float(lo), float(hi)


def ratio_ci(
    numerator: Tensor, denominator: Tensor, n_boot: int = 2000, seed: int = 0, level: float = 0.95
) -> tuple[float, tuple[float, float]]:
    """`sum(numerator) / sum(denominator)` and its bootstrap percentile CI over rollouts."""
    _check(n_boot, level)
    cols = torch.stack([numerator.to(torch.float64), denominator.to(torch.float64)], dim=1)
    sums = resampled_sums(cols, n_boot, seed)
    point = float(cols[:, 0].sum() / cols[:, 1].sum())
    return point, percentile_interval(sums[:, 0] / sums[:, 1], level)


def paired_ratio_replicates(
    numerator: Tensor, denom_a: Tensor, denom_b: Tensor, n_boot: int = 2000, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """Bootstrap replicates `(ratio_a [n_boot], ratio_b [n_boot])` of
    `sum(numerator)/sum(denom_x)`, both computed on the same resample of rollouts."""
    _check(n_boot, 0.5)
    cols = torch.stack([numerator, denom_a, denom_b], dim=1).to(torch.float64)
    sums = resampled_sums(cols, n_boot, seed)
    return sums[:, 0] / sums[:, 1], sums[:, 0] / sums[:, 2]
