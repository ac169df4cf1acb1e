"""Print the hybrid confidence threshold with the highest MAL in a `blockdraft eval --json`.

    python research/scripts/pick_threshold.py OUT/json/select.json

Used by research/scripts/gemma_gsm8k.sh on *validation* rollouts, so the threshold reported on
the held-out rollouts was not chosen on them. Ties go to the lower threshold.
"""

from __future__ import annotations

import json
import sys

from blockdraft.serialization.drafter_spec import DrafterSpec


def best_threshold(result: dict) -> float:
    best: tuple[float, float] | None = None
    for bench in result["benchmarks"]:
        for d in bench["drafters"]:
            spec = DrafterSpec.parse(d["path"])
            if spec.kind != "hybrid":
                continue
            key = (d["mal"], -spec.min_confidence)
            if best is None or key > (best[0], -best[1]):
                best = (d["mal"], spec.min_confidence)
    if best is None:
        raise SystemExit("no hybrid:conf=C:RUN drafter in this eval JSON")
    return best[1]


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(f"{best_threshold(json.load(f)):g}")
