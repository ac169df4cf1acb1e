"""Statistics over a benchmark suite: per-benchmark MAL and the mean over benchmarks, with CIs.

Papers report a drafter's MAL on each benchmark and its plain mean over benchmarks, so
each benchmark weighs the same whatever its size. The CI of that mean is a stratified
bootstrap: rollouts are resampled within each benchmark, independently across benchmarks,
and the same resample is applied to every drafter, so gains between drafters are paired.
Per-benchmark intervals use the draw of `blockdraft eval` / `compare` for the same seed,
so the suite's per-benchmark numbers equal theirs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from blockdraft.bootstrap_ci import percentile_interval, resampled_sums

Tensor = torch.Tensor


@dataclass(frozen=True)
class BenchmarkRounds:
    """One benchmark: drafting tokens per rollout `[R]` and each drafter's expected rounds
    per rollout `[D, R]` (drafters in the same order on every benchmark)."""

    tokens: Tensor
    rounds: Tensor

    def __post_init__(self) -> None:
        if self.tokens.dim() != 1 or self.rounds.dim() != 2:
            raise ValueError("tokens must be [R] and rounds [D, R]")
        if self.rounds.shape[1] != self.tokens.shape[0] or self.tokens.shape[0] < 1:
            raise ValueError(
                f"rounds {tuple(self.rounds.shape)} must be [D, R] for tokens of length "
                f"R = {self.tokens.shape[0]} >= 1"
            )
        if not bool((self.rounds.sum(1) > 0).all()):
            raise ValueError("a drafter has no drafting rounds on a benchmark (every L = 1)")


@dataclass(frozen=True)
class Gain:
    """B against A: `rel = mal_b / mal_a - 1` with its paired percentile 95% CI."""

    mal_a: float
    mal_b: float
    rel: float
    rel_ci95: tuple[float, float]


@dataclass(frozen=True)
class SuiteStatistics:
    """`mal[b][d]`, `mal_ci95[b][d]` per benchmark; `mean[d]`, `mean_ci95[d]` over them;
    the bootstrap replicates `[n_boot, D]` kept to compare any two drafters."""

    mal: list[list[float]]
    mal_ci95: list[list[tuple[float, float]]]
    mean: list[float]
    mean_ci95: list[tuple[float, float]]
    replicates: list[Tensor]
    mean_replicates: Tensor

    def gain(self, a: int, b: int, benchmark: int | None = None) -> Gain:
        """Drafter b vs drafter a on one benchmark, or on the suite mean (`None`)."""
        if benchmark is None:
            point_a, point_b, rep = self.mean[a], self.mean[b], self.mean_replicates
        else:
            point_a, point_b = self.mal[benchmark][a], self.mal[benchmark][b]
            rep = self.replicates[benchmark]
        ci = percentile_interval(rep[:, b] / rep[:, a] - 1, 0.95)
        return Gain(point_a, point_b, point_b / point_a - 1, ci)


def _mal_replicates(bench: BenchmarkRounds, n_boot: int, seed: int) -> Tensor:
    cols = torch.cat([bench.tokens[:, None], bench.rounds.T], dim=1)
    sums = resampled_sums(cols, n_boot, seed)
    return sums[:, :1] / sums[:, 1:]


def mean_stream_seed(seed: int, benchmark: int) -> int:
    """Seed of benchmark `benchmark`'s resample for the suite mean: one independent stream
    per benchmark (a shared seed would draw the same row indices on equal-sized sets)."""
    return (int(seed) + 1) * 1_000_003 + 7_919 * int(benchmark)


def suite_statistics(
    benchmarks: Sequence[BenchmarkRounds], n_boot: int = 2000, seed: int = 0
) -> SuiteStatistics:
    """MALs, their CIs and the stratified-bootstrap mean over `benchmarks`."""
    if not benchmarks:
        raise ValueError("a suite needs at least one benchmark")
    drafters = {b.rounds.shape[0] for b in benchmarks}
    if len(drafters) != 1:
        raise ValueError(f"every benchmark must score the same drafters, got counts {drafters}")
    mal, mal_ci, reps, mean_reps = [], [], [], []
    for i, bench in enumerate(benchmarks):
        exact = BenchmarkRounds(bench.tokens.to(torch.float64), bench.rounds.to(torch.float64))
        point = exact.tokens.sum() / exact.rounds.sum(1)
        rep = _mal_replicates(exact, n_boot, seed)
        mal.append([float(v) for v in point])
        mal_ci.append([percentile_interval(rep[:, d], 0.95) for d in range(rep.shape[1])])
        reps.append(rep)
        mean_reps.append(_mal_replicates(exact, n_boot, mean_stream_seed(seed, i)))
    mean_rep = torch.stack(mean_reps).mean(0)
    mean = torch.tensor(mal, dtype=torch.float64).mean(0)
    return SuiteStatistics(
        mal=mal,
        mal_ci95=mal_ci,
        mean=[float(v) for v in mean],
        mean_ci95=[percentile_interval(mean_rep[:, d], 0.95) for d in range(mean_rep.shape[1])],
        replicates=reps,
        mean_replicates=mean_rep,
    )
