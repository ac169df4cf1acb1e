"""Side-by-side wall-clock measurement: the only honest way to claim a speedup.

Machines drift (thermal throttling, other processes on shared cores), so two methods
timed in separate phases can differ by more than the effect being measured. Everything
here times the competitors *interleaved* in one run (A, B, A, B, ...) and reports the
ratio of the summed times, so drift hits both sides alike.
"""

from __future__ import annotations

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
