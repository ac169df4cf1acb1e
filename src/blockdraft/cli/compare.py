"""`blockdraft compare --target NAME --rollouts DIR A B [C...] [--all-pairs] [--json OUT]`.

(`--rollouts` may be repeated: one benchmark per rollout set.)

Paired comparison of drafters on the *same* rollouts: the MAL difference (and relative
gain) of each drafter against the first (or of every pair), with percentile bootstrap
95% CIs that resample rollouts jointly for both drafters. Printed as a markdown table;
`blockdraft.evaluation.eval_compare.compare()` is the same as a Python function.
"""

from __future__ import annotations

import argparse
import sys

from blockdraft.cli.drafter_options import (
    add_allow_incomplete,
    add_rollouts_arg,
    add_scoring_args,
    add_target_args,
    drafter_dtype_of,
    drafter_spec,
    run_scored_command,
)
from blockdraft.evaluation.eval_compare import compare  # noqa: F401 - the Python API, re-exported
from blockdraft.pipeline.report import comparison_table

EXAMPLE = """example:
  blockdraft compare --target tiny --rollouts blockdraft-demo/rollouts/eval/set \\
      blockdraft-demo/runs/dpace blockdraft-demo/runs/edr --json compare.json
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "compare",
        help="paired MAL differences between drafters on the same rollouts",
        description="MAL of each drafter minus the first (or all pairs) on the same rollouts, with "
        "paired bootstrap 95% confidence intervals.",
        epilog=EXAMPLE,
    )
    add_target_args(p)
    add_rollouts_arg(p)
    p.add_argument(
        "drafters",
        nargs="+",
        type=drafter_spec,
        help="drafter checkpoints (or `ngram[:k=K,max=N,min=M]`); the first is the baseline",
    )
    p.add_argument(
        "--all-pairs", action="store_true", help="compare every pair, not just each vs the first"
    )
    add_scoring_args(p, "comparisons")
    add_allow_incomplete(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if len(args.drafters) < 2:
        print("error: compare needs at least two drafters", file=sys.stderr)
        return 2
    return run_scored_command(
        args,
        lambda target: compare(
            target,
            args.drafters,
            args.rollouts,
            args.all_pairs,
            args.n_boot,
            args.seed,
            args.cache_dir,
            progress=not args.no_progress,
            allow_incomplete=args.allow_incomplete,
            drafter_dtype=drafter_dtype_of(args, target),
        ),
        lambda result: "\n".join(comparison_table(result)),
        lambda result: {"comparisons": result},
    )
