"""The demo at several seeds: does each fine-tune beat its D-PACE start and the control?

    python research/scripts/demo_seeds.py --seeds 0 1 2 --out results_runs/demo-seeds

Runs `blockdraft demo --seed S` (reusing every finished stage) into OUT/sS and prints, per
seed, each drafter's held-out MAL next to ngram and the paired gains the demo computed
(fine-tune vs its start, vs the continued-D-PACE control, EDR vs E2E); `--json` keeps them.
The seed moves the drafters' initialisation, data order and anchors; at T = 0 the rollouts'
text is the same at every seed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

PAIRS = [
    ("dpace", "e2e"),
    ("dpace", "edr"),
    ("dpace-ft", "e2e"),
    ("dpace-ft", "edr"),
    ("e2e", "edr"),
    ("decay", "dpace"),
    ("ngram", "dpace"),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", type=Path, default=Path("results_runs/demo-seeds"))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("demo_args", nargs="*", help="more `blockdraft demo` arguments (after --)")
    args = ap.parse_args()
    cli = Path(sys.executable).with_name("blockdraft")
    rows = {}
    for seed in args.seeds:
        out = args.out / f"s{seed}"
        cmd = [str(cli), "demo", "--seed", str(seed), "--out", str(out), *args.demo_args]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        rows[seed] = json.loads((out / "report.json").read_text())
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({str(s): r for s, r in rows.items()}, indent=2))
    return 0


def table(rows: dict[int, dict]) -> str:
    names = [d["name"] for d in next(iter(rows.values()))["drafters"]]
    out = ["| seed | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for seed, r in rows.items():
        mal = {d["name"]: d.get("mal", d.get("mal_offline")) for d in r["drafters"]}
        out.append(f"| {seed} | " + " | ".join(f"{mal[n]:.3f}" for n in names) + " |")
    out += [
        "",
        "| B vs A (paired) | " + " | ".join(f"seed {s}" for s in rows) + " |",
        "|---" * (len(rows) + 1) + "|",
    ]
    for a, b in PAIRS:
        cells = []
        for r in rows.values():
            c = next(c for c in r["comparisons"] if (c["a"], c["b"]) == (a, b))
            lo, hi = c["rel_gain_ci95"]
            cells.append(f"{100 * c['rel_gain']:+.1f}% [{100 * lo:+.1f}, {100 * hi:+.1f}]")
        out.append(f"| {b} vs {a} | " + " | ".join(cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
