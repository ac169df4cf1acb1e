"""The report's figures, each a function of plain data (lists and dicts) -> one PNG.

Plain data in, so the demo, the CLI and tests can all call them without models or files.
Every figure labels its axes, uses honest scales (probabilities on [0, 1], counts from 0)
and is written with the Agg backend (no display needed).
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from blockdraft.artifacts import write_atomic  # noqa: E402

DPI = 120


def _save(fig: Any, path: Path) -> Path:
    """Render in memory, then `write_atomic`: a full disk leaves no cut-short PNG that a
    rerun would take for an earlier report, and names the file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, dpi=DPI, format="png")
    finally:
        plt.close(fig)
    write_atomic(path, buffer.getvalue())
    return path


def _grid(n: int, width: float = 5.0, height: float = 3.6) -> tuple[Any, list[Any]]:
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n:]:
        ax.axis("off")
    return fig, flat[:n]


def _integer_steps(ax: Any) -> None:
    """Integer step ticks, also for runs with one or two logged steps (whose tiny x range
    would otherwise get ticks such as 2.5 .. 3.5)."""
    lo, hi = ax.get_xlim()
    if hi - lo < 2:
        mid = round((lo + hi) / 2)
        ax.set_xlim(mid - 1, mid + 1)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def plot_acceptance_rates(drafters: Sequence[dict[str, Any]], path: Path) -> Path:
    """AR_k (P(proposal k accepted | 1..k-1 accepted)) vs k, one panel per benchmark."""
    benches = list(dict.fromkeys(d.get("benchmark", "") for d in drafters))
    fig, axes = _grid(len(benches))
    for ax, bench in zip(axes, benches, strict=True):
        for d in (d for d in drafters if d.get("benchmark", "") == bench):
            ar = [float("nan") if v is None else float(v) for v in d["ar_k"]]
            ax.plot(
                range(1, len(ar) + 1),
                ar,
                marker="o",
                ms=3,
                label=f"{d['name']} (MAL {d['mal']:.2f})",
            )
        ax.set_ylim(0, 1.02)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("proposal position k")
        ax.set_ylabel("AR_k = P(accept k | 1..k-1 accepted)")
        ax.set_title(f"per-position acceptance: {bench}" if bench else "per-position acceptance")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def plot_accepted_histogram(online: dict[str, dict[str, Any]], path: Path) -> Path:
    """Share of drafting rounds by tokens emitted (accepted + 1), one bar group per drafter."""
    names = [n for n, o in online.items() if o.get("histogram")]
    fig, ax = plt.subplots(figsize=(7.5, 4.0))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        hist = [float(h) for h in online[name]["histogram"]]
        total = sum(hist) or 1.0
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(1, len(hist))]
        tau = online[name].get("tau")
        label = (
            f"{name} (tau {tau:.2f})"
            if isinstance(tau, (int, float)) and not math.isnan(tau)
            else name
        )
        ax.bar(xs, [h / total for h in hist[1:]], width=width, label=label)
    ax.set_xlabel("tokens emitted per drafting round (accepted proposals + 1)")
    ax.set_ylabel("share of rounds")
    ax.set_ylim(0, None)
    ax.set_title("online accepted lengths")
    ax.grid(axis="y", alpha=0.3)
    if names:
        ax.legend(fontsize=8)
        k1 = max(len(online[n]["histogram"]) - 1 for n in names)
        ax.set_xticks(range(1, k1 + 1))
    return _save(fig, path)


def _run_length(c: dict[str, Any]) -> int:
    return max((s for key in ("eval_mal", "loss") for s, _ in c.get(key) or []), default=0)


def length_groups(curves: dict[str, dict[str, Any]]) -> list[list[str]]:
    """Run names grouped by run length (shortest first): a new group where a run is more
    than twice as long as the group's shortest, so a 48-step fine-tune never shares an
    x-axis with a 576-step run (it would be squeezed into the axis' first tenth)."""
    groups: list[list[str]] = []
    first = 0
    for name in sorted(curves, key=lambda n: _run_length(curves[n])):
        length = _run_length(curves[name])
        if not groups or length > 2 * max(first, 1):
            groups.append([])
            first = length
        groups[-1].append(name)
    return groups


def _held_out(curves: dict[str, dict[str, Any]], names: list[str]) -> str:
    """`on N held-out rollouts` (or `on N-M ...`) as the runs' eval events recorded it."""
    counts = sorted({n for name in names for n in curves[name].get("eval_rollouts") or []})
    if not counts:
        return "held-out"
    n = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return f"on {n} held-out rollouts"


def plot_training_curves(curves: dict[str, dict[str, Any]], path: Path) -> Path:
    """Per group of runs of similar length (`length_groups`), one row: eval MAL vs step
    (titled with how many held-out rollouts it is measured on) and training loss vs step
    (log scale), one line per run."""
    groups = length_groups(curves) or [[]]
    fig, axes = plt.subplots(len(groups), 2, figsize=(11, 4.0 * len(groups)), squeeze=False)
    for (ax_mal, ax_loss), names in zip(axes, groups, strict=True):
        for name in names:
            c = curves[name]
            if c.get("eval_mal"):
                s, v = zip(*c["eval_mal"], strict=True)
                ax_mal.plot(s, v, marker="o", ms=3, label=name)
            if c.get("loss"):
                s, v = zip(*c["loss"], strict=True)
                # a run with one or two logged points (a short fine-tuning stage) needs
                # markers, or it is in the legend but invisible
                ax_loss.plot(s, v, lw=1, marker="o" if len(s) < 3 else None, ms=4, label=name)
        runs = f" ({', '.join(names)})" if len(groups) > 1 else ""
        if ax_mal.get_lines():
            ax_mal.set_ylim(bottom=1.0)  # MAL >= 1 always: the honest floor
        ax_mal.set_xlabel("training step")
        ax_mal.set_ylabel("eval MAL (tokens per round)")
        ax_mal.set_title(f"mean accepted length {_held_out(curves, names)}{runs}", fontsize=10)
        ax_loss.set_xlabel("training step")
        ax_loss.set_ylabel("training loss")
        ax_loss.set_title(f"training loss (objectives differ in scale){runs}", fontsize=10)
        losses = [v for name in names for _, v in curves[name].get("loss") or []]
        if losses and all(v > 0 for v in losses):
            ax_loss.set_yscale("log")
        for ax in (ax_mal, ax_loss):
            _integer_steps(ax)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
    return _save(fig, path)


def plot_weight_profiles(profiles: dict[str, list[tuple[int, list[float]]]], path: Path) -> Path:
    """D-PACE weight profile (mean normalised weight per slot) over training: heatmap of
    slot x step per run, so the drift of weight towards early/late slots is visible."""
    names = [n for n, p in profiles.items() if p]
    fig, axes = _grid(max(1, len(names)), width=5.5, height=3.8)
    if not names:
        axes[0].text(
            0.5, 0.5, "no dpace_weight_profile in the training logs", ha="center", va="center"
        )
        axes[0].axis("off")
        return _save(fig, path)
    vmax = max(v for n in names for _, p in profiles[n] for v in p if v == v) or 1.0  # shared scale
    for ax, name in zip(axes, names, strict=True):
        steps = [s for s, _ in profiles[name]]
        k = max(len(p) for _, p in profiles[name])
        rows = [list(p) + [float("nan")] * (k - len(p)) for _, p in profiles[name]]
        mat = [[rows[t][j] for t in range(len(rows))] for j in range(k)]  # [slot, step]
        # cell edges halfway between logged steps, so irregular logging is drawn to scale
        mids = [(a + b) / 2 for a, b in zip(steps[:-1], steps[1:], strict=False)]
        first = steps[0] - (mids[0] - steps[0] if mids else 0.5)
        last = steps[-1] + (steps[-1] - mids[-1] if mids else 0.5)
        x_edges = [first, *mids, last]
        y_edges = [j + 0.5 for j in range(k + 1)]
        im = ax.pcolormesh(x_edges, y_edges, mat, cmap="viridis", vmin=0, vmax=vmax, shading="flat")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        _integer_steps(ax)
        ax.set_xlabel("training step")
        ax.set_ylabel("block slot j (proposal)")
        ax.set_title(f"D-PACE weights: {name}")
        fig.colorbar(im, ax=ax, label="mean weight")
    return _save(fig, path)


def plot_suite(result: dict[str, Any], path: Path) -> Path:
    """MAL with 95% CI per benchmark and on the mean, one bar per drafter (baseline first,
    hatched), from a `blockdraft suite` result."""
    groups = [(b["name"], b["drafters"]) for b in result["benchmarks"]]
    groups.append(("mean", result["mean"]))
    names = [d["name"] for d in result["mean"]]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(groups) * max(1, len(names)) / 2), 4.0))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        xs = [g + (i - (len(names) - 1) / 2) * width for g in range(len(groups))]
        mal = [float(rows[i]["mal"]) for _, rows in groups]
        lo = [m - float(rows[i]["mal_ci95"][0]) for m, (_, rows) in zip(mal, groups, strict=True)]
        hi = [float(rows[i]["mal_ci95"][1]) - m for m, (_, rows) in zip(mal, groups, strict=True)]
        ax.bar(
            xs,
            mal,
            width=width,
            label=name,
            hatch="//" if i == 0 else None,
            yerr=[lo, hi],
            capsize=3,
        )
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([g for g, _ in groups])
    ax.set_ylim(0, None)
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")  # MAL 1 = no speculation
    ax.set_ylabel("exact offline MAL (tokens per round)")
    ax.set_title(f"suite {result['suite']}: {result['target']}")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)
