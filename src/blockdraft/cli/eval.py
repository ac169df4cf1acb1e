"""`blockdraft eval --target NAME --rollouts DIR DRAFTER [DRAFTER...] [--json OUT]`.

(`--rollouts` may be repeated: one benchmark per rollout set.)

Exact offline evaluation (docs/methods.md, "The offline evaluator") of each drafter on
each rollout set (one "benchmark" per set): expected rounds, MAL with a bootstrap CI, AR_k
and T_{>=k}. Acceptance tensors are cached per (drafter checkpoint, rollouts), so `compare`
and `report` after `eval` cost nothing. `blockdraft.evaluation.runs.evaluate()` is the
same as a Python function; this module only parses arguments and prints.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from blockdraft.cli.arguments import positive_int, seed_int
from blockdraft.cli.target_options import add_target_options, load_target_from_args
from blockdraft.devices import (
    add_device_args,
    add_drafter_dtype_arg,
    device_and_dtype,
    drafter_dtype,
)

# the Python API lives in the library; re-exported here for older imports
from blockdraft.evaluation.runs import (  # noqa: F401
    benchmark_name,
    drafter_names,
    evaluate,
    load_scored,
    resolve_checkpoint,
    write_json,
)
from blockdraft.pipeline.report import eval_markdown
from blockdraft.serialization.drafter_spec import checkpoint_of
from blockdraft.threads import add_threads_arg, configure_cpu


def add_rollouts_arg(p: argparse.ArgumentParser) -> None:
    """`--rollouts DIR`, repeatable: one benchmark per rollout set (eval and compare)."""
    p.add_argument(
        "--rollouts",
        required=True,
        action="append",
        help="rollout directory (a benchmark); repeat for several",
    )


def add_target_args(p: argparse.ArgumentParser) -> None:
    add_target_options(p)
    p.add_argument("--cache-dir", default=None, help="acceptance cache (default: user cache dir)")
    add_device_args(p)
    add_drafter_dtype_arg(p)
    add_threads_arg(p)
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")


def setup_target(args: argparse.Namespace) -> Any:
    """The target on `--device` in `--dtype` (drafters follow it: `drafter_dtype_of`)."""
    configure_cpu(args.threads, args.device)

    device, dtype = device_and_dtype(args)
    drafters = getattr(args, "drafters", None) or getattr(args, "drafter", None)
    return load_target_from_args(
        args,
        rollouts=getattr(args, "rollouts", None),
        drafters=drafters,
        device=device,
        dtype=dtype,
        progress=not args.no_progress,
    )


def drafter_dtype_of(args: argparse.Namespace, target: Any) -> Any:
    """The dtype drafters are cast to for `--drafter-dtype` / `--dtype` (None: keep the
    checkpoint's)."""
    return drafter_dtype(args.dtype, target.device, getattr(args, "drafter_dtype", None))


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "eval",
        help="exact offline evaluation of drafters on target rollouts",
        description="Expected rounds, MAL (+bootstrap CI), AR_k and T_{>=k} of each drafter on "
        "each "
        "rollout set, computed exactly from the rollouts without running speculative decoding.",
    )
    add_target_args(p)
    add_rollouts_arg(p)
    p.add_argument(
        "drafters",
        nargs="+",
        help="drafter checkpoint directories (or run dirs with final/); `ngram` or "
        "`ngram:k=7,max=3,min=1` for the prompt-lookup baseline",
    )
    p.add_argument("--json", default=None, help="write the results as JSON here")
    p.add_argument("--n-boot", type=positive_int, default=2000)
    p.add_argument("--seed", type=seed_int, default=0)
    add_allow_incomplete(p)
    p.set_defaults(func=run)


def add_allow_incomplete(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--allow-incomplete",
        action="store_true",
        help="score rollout sets whose `blockdraft rollout` was interrupted (refused otherwise)",
    )


def run_scored_command(
    args: argparse.Namespace,
    compute: Callable[[Any], Any],
    markdown: Callable[[Any], str],
    json_obj: Callable[[Any], Any],
) -> int:
    """Shared body of `eval` and `compare`: check the checkpoints, load the target, compute,
    print markdown, optionally write JSON; bad input is a one-line error and exit code 2."""
    try:
        for d in args.drafters:
            checkpoint_of(d)
        result = compute(setup_target(args))
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(markdown(result))
    if args.json:
        write_json(args.json, json_obj(result))
        print(f"wrote {args.json}")
    return 0


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
