"""`blockdraft compare --target NAME --rollouts DIR A B [C...] [--all-pairs] [--json OUT]`.

Paired comparison of drafters on the *same* rollouts (one benchmark per `--rollouts`): the
MAL difference and relative gain of each drafter over the first (or of every pair), with
bootstrap 95% CIs that resample rollouts jointly for both drafters. The Python function
is `blockdraft.evaluation.eval_compare.compare`.
"""

from __future__ import annotations

import argparse

from blockdraft.cli.arguments import user_error
from blockdraft.cli.drafter_options import (
    add_allow_incomplete,
    add_scored_args,
    add_scoring_args,
    run_scored_command,
)
from blockdraft.evaluation.eval_compare import compare
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
    add_scored_args(
        p,
        "drafter checkpoints (or `ngram[:k=K,max=N,min=M]`, `suffix[:k=K,...]`); the first "
        "is the baseline",
    )
    p.add_argument(
        "--all-pairs", action="store_true", help="compare every pair, not just each vs the first"
    )
    add_scoring_args(p, "comparisons")
    add_allow_incomplete(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if len(args.drafters) < 2:
        return user_error("compare needs at least two drafters")
    return run_scored_command(
        args,
        compare,
        lambda result: "\n".join(comparison_table(result)),
        lambda result: {"comparisons": result},
        all_pairs=args.all_pairs,
    )
