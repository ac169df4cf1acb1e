"""Where a trained drafter loses to prompt lookup: acceptance split by what lookup does there.

    python scripts/lookup_split.py --target gemma-3-270m --suite configs/suites/gemma-3-270m.yaml \
        --rollouts-dir results_runs/suite-gemma/rollouts --cache-dir results_runs/gemma-mix/cache \
        results_runs/gemma-mix/runs/servable-dpace-s0

Every round start of every suite rollout (greedy), grouped by how many tokens prompt lookup
(`ngram` at the drafter's K) gets accepted there: 0 (no match, or a wrong one), 1-3, 4 to
K-1, K (its whole proposal: the text is copying itself). Per group: the share of round
starts and the mean accepted length of lookup and of each drafter, from the offline
evaluator's acceptance tensors (the same the suite scores). A per-start mean over every
position, not MAL (which weights starts by how often decoding visits them); the last
columns are exact MALs: each drafter, and an oracle that at every round start takes the
longer of the drafter's and lookup's accepted prefixes (what a per-round choice between
the two, such as `hybrid:`'s, could reach if it always chose right).
"""

from __future__ import annotations

import argparse
import json

import torch

from blockdraft.evaluation.offline import offline_stats
from blockdraft.evaluation.runs import drafter_names, load_scored
from blockdraft.evaluation.suite import benchmark_rollouts, load_suite, with_baseline
from blockdraft.targets.registry import load_target

GROUPS = ("0", "1-3", "4-{}", "{}")  # filled with K-1 and K


def accepted_lengths(acc: torch.Tensor) -> torch.Tensor:
    """Expected accepted prefix length at every round start of one rollout `[L-1]`."""
    return torch.cumprod(acc.double(), dim=-1).sum(-1)


def group_of(n: torch.Tensor, k: int) -> torch.Tensor:
    """0: none accepted, 1: 1-3, 2: 4 to K-1, 3: all K (indices into GROUPS)."""
    g = torch.zeros_like(n, dtype=torch.long)
    g[n >= 0.5] = 1
    g[n >= 3.5] = 2
    g[n >= k - 0.5] = 3
    return g


def oracle(acc_a: list[torch.Tensor], acc_b: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per round start, the acceptance row of whichever proposer accepts more there."""
    out = []
    for a, b in zip(acc_a, acc_b, strict=True):
        take_b = accepted_lengths(b) > accepted_lengths(a)
        out.append(torch.where(take_b[:, None], b, a))
    return out


def split(scored: list[list[torch.Tensor]], names: list[str]) -> dict:
    """Groups by the first entry's (lookup's) accepted length; see the module docstring."""
    k = scored[0][0].shape[-1]
    look = torch.cat([accepted_lengths(a) for a in scored[0]])
    groups = group_of(look, k)
    result = {"round_starts": int(look.numel()), "groups": []}
    for g, label in enumerate(GROUPS):
        sel = groups == g
        row = {"lookup_accepts": label.format(k - 1, k), "share": float(sel.double().mean())}
        for name, acc in zip(names, scored, strict=True):
            lengths = torch.cat([accepted_lengths(a) for a in acc])
            row[name] = float(lengths[sel].mean()) if bool(sel.any()) else float("nan")
        result["groups"].append(row)
    result["mal"] = {name: offline_stats(acc).mal for name, acc in zip(names, scored, strict=True)}
    result["oracle_mal"] = {
        name: offline_stats(oracle(scored[0], acc)).mal
        for name, acc in zip(names[1:], scored[1:], strict=True)
    }
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--suite", required=True)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--rollouts-dir", default=None)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("drafters", nargs="+")
    args = ap.parse_args()
    target = load_target(args.target, progress=False)
    suite = load_suite(args.suite, args.data_dir)
    specs = with_baseline(suite, args.drafters)
    names = drafter_names(specs)
    dirs = benchmark_rollouts(target, suite, args.rollouts_dir, progress=False)
    out = {}
    for bench in suite.benchmarks:
        _, scored = load_scored(target, specs, dirs[bench.name], args.cache_dir, progress=False)
        res = out[bench.name] = split(scored, names)
        print(f"== {bench.name}: {res['round_starts']} round starts")
        print("| lookup accepts | share | " + " | ".join(names) + " |")
        print("|---" * (len(names) + 2) + "|")
        for row in res["groups"]:
            cells = " | ".join(f"{row[n]:.2f}" for n in names)
            print(f"| {row['lookup_accepts']} | {row['share']:.1%} | {cells} |")
        mals = ", ".join(f"{n} {m:.3f}" for n, m in res["mal"].items())
        orc = ", ".join(f"{n} {m:.3f}" for n, m in res["oracle_mal"].items())
        print(f"MAL: {mals}; per-round oracle of lookup and: {orc}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
