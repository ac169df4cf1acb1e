"""Held-out MAL against optimizer steps and training seconds, one row per run.

`python scripts/curves.py RUN_DIR...` reads each run's metrics.jsonl (the `eval` events
the trainer logs) and prints a markdown table: run, then `MAL@step (seconds)` per
evaluation. Used by research/scripts/recipe_tiny.sh; the numbers go into research/results.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def curve(run_dir: Path) -> list[tuple[int, float, float | None]]:
    """(step, held-out MAL, elapsed seconds) of every evaluation in a run."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line) if line.strip() else {}
        if rec.get("event") == "eval" and rec.get("eval_mal") is not None:
            out.append((int(rec["step"]), float(rec["eval_mal"]), rec.get("elapsed_s")))
    return out


def main(argv: list[str]) -> int:
    print("| run | held-out MAL at step (training seconds) |")
    print("|---|---|")
    for arg in argv:
        points = curve(Path(arg))
        if points:
            cells = [
                f"{m:.3f}@{s}" + (f" ({t:.0f}s)" if t is not None else "") for s, m, t in points
            ]
            print(f"| {Path(arg).name} | {', '.join(cells)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
