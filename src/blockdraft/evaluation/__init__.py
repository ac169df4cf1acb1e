"""Evaluation of drafters: the exact offline evaluator (`offline.py`, paired bootstrap in
`bootstrap.py`) and the online speculative decoder (verification rules in `verify.py`).

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
