"""Evaluation of drafters: the exact offline evaluator (`offline.py`), scoring drafters on
rollout sets (`scoring.py`), the `eval` / `compare` runs (`eval_compare.py`) and benchmark
suites (`suite.py`, `suite_statistics.py`, `lookup_split.py`).
"""
