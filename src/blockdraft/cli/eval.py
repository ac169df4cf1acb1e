"""`blockdraft eval --target NAME --rollouts DIR DRAFTER [DRAFTER...] [--json OUT]`.

Exact offline evaluation (docs/methods.md, "The offline evaluator") of each drafter on
each rollout set (one benchmark per `--rollouts`): expected rounds, MAL with a bootstrap
CI, AR_k and T_{>=k}. The Python function is `blockdraft.evaluation.eval_compare.evaluate`.
"""

from __future__ import annotations

import argparse

from blockdraft.cli.drafter_options import (
    add_allow_incomplete,
    add_scored_args,
    add_scoring_args,
    run_scored_command,
)
from blockdraft.evaluation.eval_compare import evaluate
from blockdraft.pipeline.report import eval_markdown

EXAMPLE = """example:
  blockdraft eval --target tiny --rollouts blockdraft-demo/rollouts/eval/set \\
      blockdraft-demo/runs/dpace blockdraft-demo/runs/edr ngram --json eval.json
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "eval",
        help="exact offline evaluation of drafters on target rollouts",
        description="Expected rounds, MAL (+bootstrap CI), AR_k and T_{>=k} of each drafter on "
        "each rollout set, computed exactly from the rollouts without running speculative "
        "decoding.",
        epilog=EXAMPLE,
    )
    add_scored_args(
        p,
        "drafter checkpoint directories (or run dirs with final/); `ngram` or "
        "`ngram:k=7,max=3,min=1` for the prompt-lookup baseline, `suffix[:k=7,global=1]` "
        "for suffix decoding",
    )
    add_scoring_args(p)
    add_allow_incomplete(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return run_scored_command(args, evaluate, eval_markdown, lambda result: result)
