r"""The data-scaling curve of a suite run: MAL per benchmark vs training rollouts, and how
many rollouts a log-linear fit says the drafter would need to reach prompt lookup.

Reads the JSON of `blockdraft suite` (e.g. research/scripts/gemma_mix.sh's `suite.json`), takes the
drafters whose name carries their training-set size (`dpace-n1150-s0`: `--pattern`), fits
`MAL = a + b log2(N)` per benchmark and on the suite mean (least squares over the sizes),
and prints a markdown table: each size's MAL, the gain per doubling of data `b`, and `N*`,
the size at which the fit reaches the baseline's MAL (and 1.2x it on the mean, the
issue's goal). An extrapolation from a few sizes, not a measurement: it says how far off
the goal is, in data.

    python research/scripts/scaling_fit.py results_runs/gemma-scale/suite.json [--pattern REGEX]

`--plot PNG` also draws the curve (suite-mean MAL with its 95% CI against training
rollouts, one series per `--pattern`, the fit, the baseline and `--line` drafters), so a
reader sees the slope and where it bends:

    python research/scripts/scaling_fit.py ~/.cache/blockdraft/smollm2-recipe/suite.json \
        --pattern '^lookup-(\d+)$' --pattern '^lookup-(\d+)-wide$' --line suffix \
        --goal 1.3 --plot research/smollm2_curve.png
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
    ap.add_argument(
        "--pattern", action="append", help="name regex, group 1 = N (repeat: one series each)"
    )
    ap.add_argument("--line", action="append", default=[], help="a drafter drawn as a level")
    ap.add_argument("--goal", type=float, default=1.2, help="the goal, a multiple of baseline")
    ap.add_argument("--plot", help="write the curve to this PNG")
    args = ap.parse_args()
    with open(args.suite_json) as fh:
        data = json.load(fh)
    columns = [(b["name"], {d["name"]: d for d in b["drafters"]}) for b in data["benchmarks"]]
    columns.append(("mean", {d["name"]: d for d in data["mean"]}))
    series = []
    for pattern in args.pattern or [r"^dpace-n(\d+)-s\d+$"]:
        rx = re.compile(pattern)
        name_of = {int(m.group(1)): n for _, ds in columns for n in ds if (m := rx.match(n))}
        if len(name_of) < 2:
            sys.exit(f"{args.suite_json}: fewer than two drafters match {pattern!r}")
        table(columns, data["baseline"], sorted(name_of), name_of, args.goal)
        series.append((pattern, sorted(name_of), name_of))
    if args.plot:
        plot(columns[-1][1], data["baseline"], series, args.line, args.goal, args.plot)


def table(columns, base: str, sizes: list[int], name_of: dict[int, str], goal: float) -> None:
    """The markdown table of one series: MAL per size, the fit's slope and reach."""
    print(f"| training rollouts | {' | '.join(c for c, _ in columns)} |")
    print(f"|---|{'---|' * len(columns)}")
    baseline_row = [f"{ds[base]['mal']:.3f}" for _, ds in columns]
    print(f"| `{base}` | {' | '.join(baseline_row)} |")
    for n in sizes:
        row = [f"{ds[name_of[n]]['mal']:.3f}" for _, ds in columns]
        print(f"| {n:,} | {' | '.join(row)} |")
    gains, reach, reach_goal = [], [], []
    for col, ds in columns:
        a, b = fit([math.log2(n) for n in sizes], [ds[name_of[n]]["mal"] for n in sizes])
        gains.append(f"{b:+.3f}")
        reach.append(needed(a, b, ds[base]["mal"]))
        reach_goal.append(needed(a, b, goal * ds[base]["mal"]) if col == "mean" else "")
    print(f"| MAL gain per doubling (fit) | {' | '.join(gains)} |")
    print(f"| rollouts to reach `{base}` (fit) | {' | '.join(reach)} |")
    print(f"| rollouts to reach {goal:g}x `{base}` (fit) | {' | '.join(reach_goal)} |\n")


def plot(mean, base, series, lines, goal, path) -> None:
    """Suite-mean MAL (95% CI bars) against training rollouts on a log axis, with fits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for _, sizes, name_of in series:
        ys = [mean[name_of[n]]["mal"] for n in sizes]
        lo = [y - mean[name_of[n]]["mal_ci95"][0] for n, y in zip(sizes, ys, strict=True)]
        hi = [mean[name_of[n]]["mal_ci95"][1] - y for n, y in zip(sizes, ys, strict=True)]
        label = name_of[sizes[-1]].replace(str(sizes[-1]), "N")
        bars = ax.errorbar(sizes, ys, yerr=[lo, hi], marker="o", capsize=3, label=label)
        a, b = fit([math.log2(n) for n in sizes], ys)
        xs = [sizes[0], sizes[-1] * 4]
        ax.plot(xs, [a + b * math.log2(x) for x in xs], ls=":", color=bars[0].get_color())
    levels = [(base, mean[base]["mal"], "gray", "--")]
    levels += [(n, mean[n]["mal"], "gray", "-.") for n in lines]
    levels.append((f"{goal:g}x {base}", goal * mean[base]["mal"], "red", "-"))
    where = ax.get_yaxis_transform()  # x in axes fractions, y in MAL
    for name, y, color, style in levels:
        ax.axhline(y, ls=style, color=color, lw=1)
        ax.text(0.01, y, name, transform=where, fontsize=8, va="bottom", color=color)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("training rollouts (log scale; dotted: log-linear fit)")
    ax.set_ylabel("suite-mean MAL (95% CI)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
