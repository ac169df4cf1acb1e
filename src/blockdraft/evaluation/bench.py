"""Side-by-side wall-clock measurement: the only honest way to claim a speedup.

Machines drift (thermal throttling, other processes on shared cores), so two methods
timed in separate phases can differ by more than the effect being measured. Everything
here times the competitors *interleaved* in one run (A, B, A, B, ...) and reports the
ratio of the summed times, so drift hits both sides alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def alternate_timed(jobs: dict[str, Callable[[], Any]]) -> tuple[dict[str, Any], dict[str, float]]:
    """Run each job once, in the dict's order, timing each: -> (results, seconds)."""
    results: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    for name, job in jobs.items():
        t0 = time.perf_counter()
        results[name] = job()
        seconds[name] = time.perf_counter() - t0
    return results, seconds


def interleaved_ratio(
    baseline: Callable[[], Any], candidate: Callable[[], Any], repeats: int = 5
) -> dict[str, float]:
    """Time `baseline` and `candidate` alternately `repeats` times.

    Returns total seconds of each, `speedup = baseline / candidate` (ratio of sums) and
    the median of the per-repeat ratios (robust to a single disturbed repeat).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    base, cand, ratios = 0.0, 0.0, []
    for _ in range(repeats):
        _, s = alternate_timed({"baseline": baseline, "candidate": candidate})
        base += s["baseline"]
        cand += s["candidate"]
        ratios.append(s["baseline"] / max(s["candidate"], 1e-12))
    return {
        "baseline_s": base,
        "candidate_s": cand,
        "speedup": base / max(cand, 1e-12),
        "median_ratio": statistics.median(ratios),
    }
