"""Evaluation of drafters: the exact offline evaluator (`offline.py`, its paired bootstrap in
`blockdraft.bootstrap_ci`), scoring drafters on rollout sets (`scoring.py`), the `eval` /
`compare` runs (`eval_compare.py`) and benchmark suites (`suite.py`, `suite_statistics.py`).

Only the offline evaluator is re-exported here; it is pure tensor math and cheap to import.
"""

from blockdraft.evaluation.offline import (
    OfflineStats,
    PairedComparison,
    mal_ci,
    offline_stats,
    paired_comparison,
)

__all__ = ["OfflineStats", "PairedComparison", "mal_ci", "offline_stats", "paired_comparison"]
