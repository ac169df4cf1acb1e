"""The results report: PNG figures plus one markdown summary that embeds them.

`write_report` takes plain data, so any caller can use it: the offline results and paired
comparisons that `blockdraft eval --json` / `compare --json` write, training logs
(`metrics.jsonl`) and online decoding results (`blockdraft decode --json`); the figures
are drawn by `report_plots.py`. Inputs key by key: docs/architecture.md ("pipeline").
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from blockdraft.pipeline.report_plots import (
    plot_acceptance_rates,
    plot_accepted_histogram,
    plot_training_curves,
    plot_weight_profiles,
)


def _fmt(x: Any, nd: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{nd}f}" if isinstance(x, (int, float)) else str(x)


def _ci(ci: Sequence[float] | None, nd: int = 3, unit: str = "") -> str:
    return f"[{_fmt(ci[0], nd)}{unit}, {_fmt(ci[1], nd)}{unit}]" if ci else "–"


def read_metrics(path: str | Path) -> tuple[list[dict[str, Any]], int]:
    """Events of a `metrics.jsonl` (a file or a run directory) and the number of bad lines:
    a report of a long run is not lost to its last half-written line."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no training log at {path}")
    events, bad = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(ev, dict) and isinstance(ev.get("step"), (int, float)):
            events.append(ev)
        else:
            bad += 1
    return events, bad


def training_series(events: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """(step, value) series of eval MAL and loss, the D-PACE profile per logged step and
    the held-out rollout counts of the evaluations."""

    def series(key: str) -> list[tuple[int, float]]:
        return [
            (int(e["step"]), float(e[key])) for e in events if isinstance(e.get(key), (int, float))
        ]

    profile = [
        (int(e["step"]), [float(v) for v in e["dpace_weight_profile"]])
        for e in events
        if isinstance(e.get("dpace_weight_profile"), list)
    ]
    # how many held-out rollouts each evaluation scored (the MAL curve's sample size)
    counts = sorted({e["eval_rollouts"] for e in events if isinstance(e.get("eval_rollouts"), int)})
    return {
        "eval_mal": series("eval_mal"),
        "loss": series("loss"),
        "profile": profile,
        "eval_rollouts": counts,
    }


def drafters_from_eval(eval_json: dict[str, Any]) -> list[dict[str, Any]]:
    """Flatten `blockdraft eval --json` output into the `drafters` list of `write_report`."""
    return [
        {**d, "benchmark": bench.get("name", "")}
        for bench in eval_json.get("benchmarks", [])
        for d in bench.get("drafters", [])
    ]


def offline_table(drafters: Sequence[dict[str, Any]]) -> list[str]:
    """Markdown rows of offline results: MAL, CI, E[rounds] and every AR_k."""
    k_max = max((len(d.get("ar_k", [])) for d in drafters), default=0)
    shown = list(range(k_max))  # every proposal slot: AR_1..AR_K for the drafters' own K
    head = (
        "| benchmark | drafter | MAL | 95% CI | E[rounds] | "
        + " | ".join(f"AR_{k + 1}" for k in shown)
        + " |"
    )
    lines = [head, "|" + "---|" * (5 + len(shown))]
    for d in drafters:
        ar = d.get("ar_k", [])
        cells = [_fmt(ar[k], 2) if k < len(ar) else "–" for k in shown]
        lines.append(
            f"| {d.get('benchmark', '')} | {d['name']} | {_fmt(d['mal'])} | "
            f"{_ci(d.get('mal_ci95'))} | "
            f"{_fmt(d.get('expected_rounds'), 1)} | " + " | ".join(cells) + " |"
        )
    return lines


def eval_markdown(result: dict[str, Any]) -> str:
    """The table `blockdraft eval` prints, from its JSON-ready result."""
    return "\n".join(offline_table(drafters_from_eval(result)))


def comparison_table(comparisons: Sequence[dict[str, Any]]) -> list[str]:
    """Markdown rows of paired comparisons (B - A on the same rollouts)."""
    lines = [
        "| benchmark | A | B | MAL A | MAL B | B - A | 95% CI | rel. gain | 95% CI |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in comparisons:
        gain = c.get("mal_gain", c.get("diff"))  # `diff`: compare JSON written before the rename
        gain_ci = c.get("mal_gain_ci95", c.get("diff_ci95"))
        rel = c.get("rel_gain")
        rel_ci = c.get("rel_gain_ci95")
        lines.append(
            f"| {c.get('benchmark', '')} | {c['a']} | {c['b']} | {_fmt(c['mal_a'])} | "
            f"{_fmt(c['mal_b'])} | "
            f"{_fmt(gain, 4)} | {_ci(gain_ci, 4)} | "
            f"{_fmt(100 * rel, 2) + '%' if rel is not None else '–'} | "
            f"{_ci([100 * v for v in rel_ci], 2, '%') if rel_ci else '–'} |"
        )
    return lines


def _agrees(o: dict[str, Any]) -> str:
    """Do online tau and offline MAL agree (overlapping 95% CIs)?"""
    t_ci, m_ci = o.get("tau_ci95"), o.get("offline_mal_ci95")
    if not t_ci or not m_ci or any(v is None or math.isnan(v) for v in (*t_ci, *m_ci)):
        return "–"
    return "yes" if t_ci[0] <= m_ci[1] and m_ci[0] <= t_ci[1] else "**no**"


def _online_table(online: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        "| drafter | tau | 95% CI | offline MAL | 95% CI | agree | tok/s | vs AR loop "
        "| 95% CI | vs HF generate |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, o in online.items():
        vs_hf = o.get("speedup_vs_hf")
        lines.append(
            f"| {name} | {_fmt(o.get('tau'))} | {_ci(o.get('tau_ci95'))} | "
            f"{_fmt(o.get('offline_mal'))} | "
            f"{_ci(o.get('offline_mal_ci95'))} | {_agrees(o)} | {_fmt(o.get('tokens_per_s'), 1)} | "
            f"{_fmt(o.get('speedup'), 2)}x | {_speedup_ci(o.get('speedup_ci95'))} | "
            f"{_fmt(vs_hf, 2) + 'x' if vs_hf else '–'} |"
        )
    return lines


def _speedup_ci(ci: Sequence[float] | None) -> str:
    """`[lo, hi]` of a speedup's CI over prompts, or – (not timed, < 2 prompts, old JSON)."""
    if not ci or any(v is None or math.isnan(v) for v in ci):
        return "–"
    return f"[{ci[0]:.2f}, {ci[1]:.2f}]"


def _baseline_line(online: dict[str, dict[str, Any]]) -> str:
    """Our AR loop's and HF generate's tokens/s (the two speedup columns' baselines)."""
    first = next(iter(online.values()), {})
    ar, hf = first.get("ar_tokens_per_s"), first.get("hf_tokens_per_s")
    if not ar or not hf:
        return f"Our autoregressive loop: {_fmt(ar, 1)} tok/s (HF `generate` not timed)."
    return (
        f"HF `generate`: {hf:.1f} tok/s; our autoregressive loop: {ar:.1f} tok/s "
        f"({ar / hf:.2f}x HF), timed alternately on the same prompts."
    )


def _trained_with_dpace(metrics_path: str | Path) -> bool:
    """Whether the run whose metrics.jsonl this is used a D-PACE objective (from its
    run.yaml; True when that cannot be read, so nothing is hidden by mistake)."""
    try:
        run_dir = Path(metrics_path) if Path(metrics_path).is_dir() else Path(metrics_path).parent
        cfg = yaml.safe_load((run_dir / "run.yaml").read_text()) or {}
        name = str(cfg["objective"]["name"])
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return True
    return name.startswith("dpace")


# what `write_report` may write into its directory (the plots only when there is data)
REPORT_FILES = (
    "report.md",
    "acceptance_rates.png",
    "accepted_lengths.png",
    "training_curves.png",
    "dpace_weight_profile.png",
)


def existing_report_files(out_dir: str | Path) -> list[str]:
    """The files of `REPORT_FILES` already in `out_dir` (what a new report would replace)."""
    return [name for name in REPORT_FILES if (Path(out_dir) / name).exists()]


def write_report(
    out_dir: str | Path,
    drafters: list[dict[str, Any]],
    comparisons: list[dict[str, Any]],
    training_logs: dict[str, str | Path],
    online: dict[str, dict[str, Any]],
    title: str = "blockdraft report",
    baseline_split: tuple[str, dict[str, Any]] | None = None,
) -> Path:
    """Write the PNGs and `report.md` into `out_dir`; return the markdown path.
    `baseline_split`: (baseline name, `lookup_split` result) for a section on where each
    drafter wins and loses against the baseline."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = [f"# {title}", ""]
    notes: list[str] = []

    if drafters:
        plot_acceptance_rates(drafters, out / "acceptance_rates.png")
        md += [
            "## Offline evaluation (exact expectations on fixed target rollouts)",
            "",
            "MAL = tokens emitted by drafting rounds / expected rounds; "
            "CI: bootstrap over rollouts.",
            "",
        ]
        md += offline_table(drafters) + [
            "",
            "![per-position acceptance rates](acceptance_rates.png)",
            "",
        ]
    if comparisons:
        md += (
            ["## Paired comparisons (same rollouts, bootstrap 95% CI)", ""]
            + comparison_table(comparisons)
            + [""]
        )
    if baseline_split is not None:
        base, split = baseline_split
        names = list(split["groups"][0]["mean_accepted"]) if split["groups"] else []
        md += [f"## Where the drafters win and lose against `{base}`", ""]
        md += split_table("held-out rollouts", base, names, split) + [""]
    if online:
        plot_accepted_histogram(online, out / "accepted_lengths.png")
        md += [
            "## Online speculative decoding",
            "",
            "tau = tokens emitted by drafting rounds / drafting rounds (prefill token excluded); "
            "offline MAL: the same drafter's exact expectation on the same prompts at the same "
            "length (equal to tau at T = 0); *agree*: their 95% CIs overlap. vs AR loop: "
            "wall-clock tokens/s against our autoregressive decoding of the same target, timed "
            "alternately in one run, with a bootstrap 95% CI over prompts (how much it would "
            "move on other prompts of this set); vs HF generate: that ratio times our AR "
            "loop's own ratio to HF `generate`, also timed alternately.",
            "",
            _baseline_line(online),
            "",
        ]
        rows = [{"name": n, **o} for n, o in online.items()]
        md += (
            _online_table(online)
            + ["", *speed_verdict(rows)]
            + ["", "![accepted length histogram](accepted_lengths.png)", ""]
        )
    if training_logs:
        curves, profiles = {}, {}
        for name, path in training_logs.items():
            events, bad = read_metrics(path)
            if bad:
                notes.append(f"{name}: skipped {bad} malformed line(s) in its metrics.jsonl")
            series = training_series(events)
            curves[name] = series
            if _trained_with_dpace(path):  # other objectives log the profile as a diagnostic
                profiles[name] = series["profile"]
        plot_training_curves(curves, out / "training_curves.png")
        md += ["## Training", "", "![training curves](training_curves.png)", ""]
        if any(profiles.values()):
            plot_weight_profiles(profiles, out / "dpace_weight_profile.png")
            md += [
                "D-PACE weight profile (mean normalised weight per block slot) over training:",
                "",
                "![D-PACE weight profile](dpace_weight_profile.png)",
                "",
            ]
    if notes:
        md += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    path = out / "report.md"
    path.write_text("\n".join(md))
    return path


def speed_verdict(rows: list[dict[str, Any]]) -> list[str]:
    """Plain words on the wall clock: which drafters decode *slower* than HF `generate` or
    our AR loop (`rows`: `name`, `speedup`, `speedup_ci95`, `speedup_vs_hf`, any may be
    None), which cannot be told from it, or that every timed one is faster. With a CI, a
    drafter is slower only if the whole CI is below 1x; without one, the ratio decides.
    A row timed while other processes held the cores it needed (`machine_busy`) gets no
    verdict at all: the clock measured the machine, not the drafter."""
    busy = [r for r in rows if r.get("machine_busy")]
    if busy:
        load = max((r.get("other_load_cores") or 0.0) for r in busy)
        return [
            f"No speed verdict: other processes kept {load:.1f} cores busy while "
            f"{', '.join(r['name'] for r in busy)} {'was' if len(busy) == 1 else 'were'} "
            "timed, so the wall clock measured the machine, not the drafters; rerun on an idle "
            "machine (tau and MAL do not depend on it)."
        ]
    lines = []
    for key, what in (("speedup_vs_hf", "HF `generate`"), ("speedup", "our AR loop")):
        timed = [(r["name"], r[key], r) for r in rows if r.get(key) is not None]
        if not timed:
            continue
        slower, unclear = [], []
        for name, x, r in timed:
            ci = r.get("speedup_ci95") if key == "speedup" else None
            known = _speedup_ci(ci) != "–"
            said = f"{name} {x:.2f}x" + (f" {_speedup_ci(ci)}" if known else "")
            if known and ci[0] <= 1.0 <= ci[1]:
                unclear.append(said)
            elif (ci[1] < 1.0) if known else (x < 1.0):
                slower.append(said)
        if slower:
            lines.append(
                f"SLOWER than {what} on this machine: {', '.join(slower)} (a drafting round "
                "costs more here than the tokens it saves; bench/decode.py splits a round's "
                "cost)."
            )
        if unclear:
            lines.append(
                f"Not told apart from {what} on these prompts (95% CI over prompts contains "
                f"1x): {', '.join(unclear)}."
            )
        if not slower and not unclear:
            low = min(x for _, x, _ in timed)
            lines.append(f"Every timed drafter decodes faster than {what} (at least {low:.2f}x).")
    return lines


def terminal_summary(report: dict[str, Any]) -> str:
    """The demo's `report.json` as a plain-text table for the terminal."""
    lines = [
        f"target={report['target']}  block_size={report['block_size']}  "
        f"T={report['temperature']}  rollouts={report['rollouts']}  "
        f"draft_vocab={report.get('draft_vocab_size') or 'full'}",
        "",
        f"{'drafter':<8} {'MAL offline':>12} {'95% CI':>16} {'tau online':>11} "
        f"{'(offline)':>10} {'vs AR':>7} {'95% CI':>14} {'vs HF':>7}",
    ]
    for d in report["drafters"]:
        lo, hi = d["mal_ci95"]
        tau = f"{d['tau']:.3f}" if d["tau"] is not None else "-"
        same = d.get("offline_mal")
        same = f"({same:.3f})" if same is not None else "-"
        sp = f"{d['speedup']:.2f}x" if d["speedup"] is not None else "-"
        sp_ci = _speedup_ci(d.get("speedup_ci95")).replace("–", "-")
        hf = d.get("speedup_vs_hf")
        hf = f"{hf:.2f}x" if hf is not None else "-"
        lines.append(
            f"{d['name']:<8} {d['mal']:>12.3f} {f'[{lo:.3f}, {hi:.3f}]':>16} "
            f"{tau:>11} {same:>10} {sp:>7} {sp_ci:>14} {hf:>7}"
        )
    lines += [
        "(tau online: the first held-out prompts, decoded; in parentheses the offline MAL "
        "of that same text, which it equals at T = 0)"
    ]
    lines += speed_verdict(report["drafters"])
    lines += ["", f"{'B vs A':<18} {'MAL gain':>9} {'95% CI':>20} {'rel.':>8}"]
    for c in report["comparisons"]:
        lo, hi = c["mal_gain_ci95"]
        lines.append(
            f"{c['b'] + ' vs ' + c['a']:<18} {c['mal_gain']:>+9.4f} "
            f"{f'[{lo:+.4f}, {hi:+.4f}]':>20} {100 * c['rel_gain']:>+7.2f}%"
        )
    return "\n".join(lines)


def _pct(gain: dict[str, Any] | None) -> str:
    """`+12.3% [+4.5, +20.1]` for a `{rel_gain, rel_gain_ci95}` dict (`–` when absent)."""
    if not gain:
        return "–"
    lo, hi = (100 * v for v in gain["rel_gain_ci95"])
    return f"{100 * gain['rel_gain']:+.1f}% [{lo:+.1f}, {hi:+.1f}]"


def _gain_row(label: str, gains: list[dict[str, Any] | None], mean: Any) -> str:
    return f"| {label} | " + " | ".join(_pct(g) for g in gains) + f" | {_pct(mean)} |"


def suite_tables(result: dict[str, Any]) -> list[str]:
    """The papers' tables for a `blockdraft suite` result: MAL [95% CI] per benchmark and on
    the mean over benchmarks (baseline first), gains over the baseline, and between drafters."""
    benches = result["benchmarks"]
    names = [d["name"] for d in result["mean"]]
    heads = [f"{b['name']} ({b['num_rollouts']})" for b in benches]
    head = "| drafter | " + " | ".join(heads) + " | mean |"
    rule = "|---|" + "---|" * (len(benches) + 1)
    lines = [
        f"Exact offline MAL [95% CI] per benchmark (rollouts in brackets), suite "
        f"`{result['suite']}`, target `{result['target']}`, T = "
        f"{result['sampling']['temperature']:g}, {result['sampling']['max_new_tokens']} "
        "new tokens:",
        "",
        head,
        rule,
    ]
    for d, name in enumerate(names):
        cells = [
            f"{_fmt(b['drafters'][d]['mal'])} {_ci(b['drafters'][d]['mal_ci95'])}" for b in benches
        ]
        m = result["mean"][d]
        lines.append(
            f"| {name} | " + " | ".join(cells) + f" | {_fmt(m['mal'])} {_ci(m['mal_ci95'])} |"
        )
    if len(names) > 1:
        lines += ["", f"Paired gain over `{result['baseline']}` (relative MAL, 95% CI):", ""]
        lines += [head, rule]
        for d, name in enumerate(names[1:], start=1):
            gains = [b["drafters"][d].get("vs_baseline") for b in benches]
            lines.append(_gain_row(name, gains, result["mean"][d].get("vs_baseline")))
    if result.get("pairs"):
        lines += ["", "Paired gain between drafters (B vs A):", ""]
        lines += ["| B vs A | " + " | ".join(heads) + " | mean |", rule]
        for p in result["pairs"]:
            gains = [p["benchmarks"].get(b["name"]) for b in benches]
            lines.append(_gain_row(f"{p['b']} vs {p['a']}", gains, p["mean"]))
    for b in benches:
        if "baseline_split" in b:
            lines += ["", *split_table(b["name"], result["baseline"], names, b["baseline_split"])]
    return lines


def split_table(bench: str, baseline: str, names: list[str], split: dict[str, Any]) -> list[str]:
    """One benchmark's round starts by what the baseline gets accepted (`lookup_split`)."""
    lines = [
        f"{bench}: mean accepted length at the {split['round_starts']} round starts, grouped by "
        f"how many tokens `{baseline}` gets accepted there (not MAL: every start counts once):",
        "",
        f"| `{baseline}` accepts | share | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for g in split["groups"]:
        cells = " | ".join(_fmt(g["mean_accepted"][n], 2) for n in names)
        lines.append(f"| {g['baseline_accepts']} | {100 * g['share']:.1f}% | {cells} |")
    oracle = ", ".join(f"{n} {_fmt(m)}" for n, m in split["oracle_mal"].items())
    lines += ["", f"MAL if each round took the longer of `{baseline}` and: {oracle}"]
    return lines
