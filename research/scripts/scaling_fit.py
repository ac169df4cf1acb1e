"""The data-scaling curve of a suite run: MAL per benchmark vs training rollouts, and how
many rollouts a log-linear fit says the drafter would need to reach prompt lookup.

Reads the JSON of `blockdraft suite` (e.g. research/scripts/gemma_mix.sh's `suite.json`), takes the
drafters whose name carries their training-set size (`dpace-n1150-s0`: `--pattern`), fits
`MAL = a + b log2(N)` per benchmark and on the suite mean (least squares over the sizes),
and prints a markdown table: each size's MAL, the gain per doubling of data `b`, and `N*`,
the size at which the fit reaches the baseline's MAL (and 1.2x it on the mean, the
issue's goal). An extrapolation from a few sizes, not a measurement: it says how far off
the goal is, in data.

    python research/scripts/scaling_fit.py results_runs/gemma-scale/suite.json [--pattern REGEX]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (a, b) of y = a + b x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - b * mx, b


def needed(a: float, b: float, goal: float) -> str:
    if b <= 0:
        return "never (no gain with data)"
    n = 2 ** ((goal - a) / b)
    return f"{n:,.0f}" if n < 1e9 else f"{n:.1e}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("suite_json")
    ap.add_argument("--pattern", default=r"^dpace-n(\d+)-s\d+$", help="name regex, group 1 = N")
    args = ap.parse_args()
    with open(args.suite_json) as fh:
        data = json.load(fh)
    rx = re.compile(args.pattern)
    columns = [(b["name"], {d["name"]: d for d in b["drafters"]}) for b in data["benchmarks"]]
    columns.append(("mean", {d["name"]: d for d in data["mean"]}))
    sizes = sorted({int(m.group(1)) for _, ds in columns for n in ds if (m := rx.match(n))})
    if len(sizes) < 2:
        sys.exit(f"{args.suite_json}: fewer than two drafters match {args.pattern!r}")
    name_of = {int(m.group(1)): n for _, ds in columns for n in ds if (m := rx.match(n))}
    base = data["baseline"]
    print(f"| training rollouts | {' | '.join(c for c, _ in columns)} |")
    print(f"|---|{'---|' * len(columns)}")
    baseline_row = [f"{ds[base]['mal']:.3f}" for _, ds in columns]
    print(f"| `{base}` | {' | '.join(baseline_row)} |")
    for n in sizes:
        row = [f"{ds[name_of[n]]['mal']:.3f}" for _, ds in columns]
        print(f"| {n:,} | {' | '.join(row)} |")
    gains, reach, reach12 = [], [], []
    for col, ds in columns:
        a, b = fit([math.log2(n) for n in sizes], [ds[name_of[n]]["mal"] for n in sizes])
        gains.append(f"{b:+.3f}")
        reach.append(needed(a, b, ds[base]["mal"]))
        reach12.append(needed(a, b, 1.2 * ds[base]["mal"]) if col == "mean" else "")
    print(f"| MAL gain per doubling (fit) | {' | '.join(gains)} |")
    print(f"| rollouts to reach `{base}` (fit) | {' | '.join(reach)} |")
    print(f"| rollouts to reach 1.2x `{base}` (fit) | {' | '.join(reach12)} |")


if __name__ == "__main__":
    main()
