"""`blockdraft eval --target NAME --rollouts DIR DRAFTER [DRAFTER...] [--json OUT]`.

(`--rollouts` may be repeated: one benchmark per rollout set.)

Exact offline evaluation (docs/methods.md, "The offline evaluator") of each drafter on
each rollout set (one "benchmark" per set): expected rounds, MAL with a bootstrap CI, AR_k
and T_{>=k}. Acceptance tensors are cached per (drafter checkpoint, rollouts), so `compare`
and `report` after `eval` cost nothing. `blockdraft.evaluation.eval_compare.evaluate()` is the
same as a Python function; this module only parses arguments and prints.
"""

from __future__ import annotations

import argparse

from blockdraft.cli.drafter_options import (
    add_allow_incomplete,
    add_rollouts_arg,
    add_scoring_args,
    add_target_args,
    drafter_dtype_of,
    drafter_spec,
    run_scored_command,
)

# the Python API lives in the library; re-exported here for older imports
from blockdraft.evaluation.eval_compare import (  # noqa: F401
    benchmark_name,
    drafter_names,
    evaluate,
    load_scored,
    resolve_checkpoint,
    write_json,
)
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
        "each "
        "rollout set, computed exactly from the rollouts without running speculative decoding.",
        epilog=EXAMPLE,
    )
    add_target_args(p)
    add_rollouts_arg(p)
    p.add_argument(
        "drafters",
        nargs="+",
        type=drafter_spec,
        help="drafter checkpoint directories (or run dirs with final/); `ngram` or "
        "`ngram:k=7,max=3,min=1` for the prompt-lookup baseline",
    )
    add_scoring_args(p)
    add_allow_incomplete(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return run_scored_command(
        args,
        lambda target: evaluate(
            target,
            args.drafters,
            args.rollouts,
            args.n_boot,
            args.seed,
            args.cache_dir,
            progress=not args.no_progress,
            allow_incomplete=args.allow_incomplete,
            drafter_dtype=drafter_dtype_of(args, target),
        ),
        eval_markdown,
        lambda result: result,
    )
