#!/usr/bin/env python
"""research/results.md's "EDR as in the paper" tables from research/scripts/edr_finetune.sh's JSON.

One table per setting and seed: each fine-tune's held-out MAL, its paired gain over the
start (the D-PACE drafter it was fine-tuned from) and over the continued-D-PACE control
at the same lr (or the named control), and its acceptance per position AR_k.

    python research/scripts/edr_tables.py results_runs/edr/json t0-s0 t0-s1 t1-s0 ...
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def short(name: str) -> str:
    return Path(name.rstrip("/")).name.removesuffix("final").rstrip("/") or name


def pct(c: dict) -> str:
    lo, hi = (100 * v for v in c["rel_gain_ci95"])
    return f"{100 * c['rel_gain']:+.2f}% [{lo:+.1f}, {hi:+.1f}]"


def load(path: Path):
    """A compare JSON's comparisons (list), an eval JSON (dict), or [] if absent."""
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    return data.get("comparisons", data)


def run_name(d: dict) -> str:
    return short(str(d.get("path") or d.get("name")))


def table(root: Path, key: str) -> list[str]:
    vs_start = {short(c["b"]): c for c in load(root / f"compare_{key}.json")}
    controls: dict[str, dict[str, dict]] = {}  # control run -> run -> comparison
    for f in sorted(root.glob(f"compare_{key}.vs-*.json")):
        rows = load(f)
        if rows:
            controls[short(rows[0]["a"])] = {short(c["b"]): c for c in rows}
    evals = load(root / f"eval_{key}.json")
    drafters = evals["benchmarks"][0]["drafters"] if evals else []
    ar = {run_name(d): d for d in drafters}
    out = [
        f"**{key}** (test rollouts)",
        "",
        "| run | MAL | vs start (paired) | vs control (paired) | AR_1..AR_7 |",
        "|---|---|---|---|---|",
    ]
    for name, d in ar.items():
        c = vs_start.get(name)
        lr = re.search(r"-(\d+e-\d+)", name)
        ctl = None
        for cname, rows in controls.items() if "-dpace-" not in name else ():
            if name in rows and cname != name and (lr is None or cname.endswith(lr.group(1))):
                ctl = rows[name]
        if ctl is None and "-dpace-" not in name:  # a single control (t0): compare with it
            for cname, rows in controls.items():
                if name in rows and cname != name:
                    ctl = rows[name]
        ks = " ".join("-" if v is None else f"{v:.2f}" for v in d.get("ar_k", []))
        out.append(
            f"| {name} | {d['mal']:.3f} | {pct(c) if c else '-'} | "
            f"{pct(ctl) if ctl else '-'} | {ks} |"
        )
    return out


def main() -> None:
    root = Path(sys.argv[1])
    for key in sys.argv[2:]:
        print("\n".join(table(root, key)) + "\n")


if __name__ == "__main__":
    main()
