"""`blockdraft compare --target NAME --rollouts DIR A B [C...] [--all-pairs] [--json OUT]`.

(`--rollouts` may be repeated: one benchmark per rollout set.)

Paired comparison of drafters on the *same* rollouts: the MAL difference (and relative
gain) of each drafter against the first (or of every pair), with percentile bootstrap
95% CIs that resample rollouts jointly for both drafters. Printed as a markdown table;
`compare()` is the same as a Python function.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Any

from blockdraft.cli.eval import (
    add_allow_incomplete,
    add_target_args,
    benchmark_name,
    drafter_names,
    load_scored,
    run_scored_command,
)


def compare(
    target: Any,
    drafter_paths: list[str | Path],
    rollout_dirs: list[str | Path],
    all_pairs: bool = False,
    n_boot: int = 2000,
    seed: int = 0,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    allow_incomplete: bool = False,
) -> list[dict[str, Any]]:
    """Paired comparisons (B vs A) per benchmark, as JSON-ready dicts."""
    from blockdraft.evaluation.offline import paired_comparison

    if len(drafter_paths) < 2:
        raise ValueError("compare needs at least two drafters")
    names = drafter_names(drafter_paths)
    n = len(drafter_paths)
    pairs = (
        list(itertools.combinations(range(n), 2)) if all_pairs else [(0, j) for j in range(1, n)]
    )
    out = []
    for rdir in rollout_dirs:
        rollouts, scored = load_scored(
            target, drafter_paths, rdir, cache_dir, progress, allow_incomplete
        )
        bench = benchmark_name(rollouts, rdir)
        for i, j in pairs:
            c = paired_comparison(scored[i], scored[j], n_boot=n_boot, seed=seed)
            out.append(
                {
                    "benchmark": bench,
                    "a": names[i],
                    "b": names[j],
                    "mal_a": c.mal_a,
                    "mal_b": c.mal_b,
                    "diff": c.diff,
                    "diff_ci95": list(c.diff_ci95),
                    "rel_gain": c.rel_gain,
                    "rel_gain_ci95": list(c.rel_gain_ci95),
                }
            )
    return out


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "compare",
        help="paired MAL differences between drafters on the same rollouts",
        description="MAL of each drafter minus the first (or all pairs) on the same rollouts, with "
        "paired bootstrap 95% confidence intervals.",
    )
    add_target_args(p)
    p.add_argument(
        "--rollouts",
        required=True,
        action="append",
        help="rollout directory (a benchmark); repeat for several",
    )
    p.add_argument(
        "drafters",
        nargs="+",
        help="drafter checkpoints (or `ngram[:k=K,max=N,min=M]`); the first is the baseline",
    )
    p.add_argument(
        "--all-pairs", action="store_true", help="compare every pair, not just each vs the first"
    )
    p.add_argument("--json", default=None, help="write the comparisons as JSON here")
    p.add_argument("--n-boot", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    add_allow_incomplete(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from blockdraft.report import comparison_table

    if len(args.drafters) < 2:
        print("error: compare needs at least two drafters", file=sys.stderr)
        return 2
    return run_scored_command(
        args,
        lambda target: compare(
            target, args.drafters, args.rollouts, args.all_pairs, args.n_boot, args.seed,
            args.cache_dir, progress=not args.no_progress, allow_incomplete=args.allow_incomplete,
        ),
        lambda result: "\n".join(comparison_table(result)),
        lambda result: {"comparisons": result},
    )
