"""`blockdraft features`: cache a rollout set's target features for offline training.

Prints the disk the features will take before computing anything and refuses sets
above `--max-gb` (hidden states are large). Re-running the same command resumes it.
`--dtype` is the target's dtype, as in every command; the stored one is `--store-dtype`.
"""

from __future__ import annotations

import argparse
import sys

from blockdraft.cli.arguments import (
    int_at_least_2,
    nonnegative_int,
    positive_float,
    positive_int,
    user_error,
)
from blockdraft.cli.target_options import add_target_options, load_target_from_args
from blockdraft.data.feature_store import FeatureError
from blockdraft.data.feature_writer import plan_features, write_features
from blockdraft.data.rollouts.store import RolloutError
from blockdraft.devices import DTYPES, add_device_args, resolve_flags
from blockdraft.targets.mask_token import MaskTokenError
from blockdraft.targets.registry import load_target
from blockdraft.threads import add_threads_arg, configure_cpu

EXAMPLE = """example:
  blockdraft features --target tiny --rollouts rollouts/tiny-greedy --out features/tiny
  blockdraft train --config tiny data.train_rollouts=rollouts/tiny-greedy \\
      data.features=features/tiny
"""
STORE_DTYPES = ("bfloat16", "float16", "float32")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "features",
        help="cache target features of a rollout set (offline training; resumable)",
        description="Run the target once over every rollout and store the drafter's context "
        "features (hidden states of the target's layer_ids) in shards, so `blockdraft train "
        "data.features=OUT` skips the target forward on every step.",
        epilog=EXAMPLE,
    )
    add_target_options(p)
    p.add_argument("--rollouts", required=True, help="rollout directory (blockdraft rollout)")
    p.add_argument(
        "--out", required=True, help="features directory (created; resumed if it exists)"
    )
    p.add_argument(
        "--store-dtype",
        default=None,
        choices=STORE_DTYPES,
        help="dtype the features are stored in (default bfloat16: half the disk of float32)",
    )
    p.add_argument(
        "--layer-ids",
        type=nonnegative_int,
        nargs="+",
        default=None,
        help="target layers feeding the drafter (default: the target's; must match training's "
        "target.layer_ids)",
    )
    p.add_argument(
        "--max-seq-len",
        type=int_at_least_2,
        default=None,
        help="truncate like training's data.max_seq_len (default: keep whole sequences)",
    )
    p.add_argument(
        "--max-gb",
        type=positive_float,
        default=20.0,
        help="refuse sets larger than this (default 20)",
    )
    p.add_argument(
        "--batch-size", type=positive_int, default=8, help="sequences per target forward"
    )
    p.add_argument("--shard-size", type=positive_int, default=32, help="rollouts per shard file")
    add_device_args(p, "the target")
    p.set_defaults(dtype=None)  # None: not given (auto), so an explicit --dtype gets the note
    # the old name of --dtype here, still accepted
    p.add_argument("--target-dtype", default=None, choices=list(DTYPES), help="the same as --dtype")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_threads_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    configure_cpu(args.threads, args.device)
    if args.dtype is not None and args.store_dtype is None:  # --dtype once named the stored one
        print(
            "note: features --dtype is the target's dtype (as in every command); the stored "
            "features' dtype is --store-dtype (default bfloat16)",
            file=sys.stderr,
        )
    target_dtype = args.dtype or args.target_dtype or "auto"
    device, dtype = resolve_flags(args.device, target_dtype)  # one-line error if bad
    try:
        target = load_target_from_args(
            args,
            loader=load_target,
            rollouts=[args.rollouts],
            device=device,
            dtype=dtype,
            progress=not args.no_progress,
        )
    except MaskTokenError:
        raise
    except (ValueError, OSError) as exc:
        return user_error(f"cannot load target {args.target!r}: {exc}")
    if args.layer_ids is not None:  # checked once the layer count is known
        bad = [i for i in args.layer_ids if i >= target.num_layers]
        if bad:
            return user_error(
                f"--layer-ids: {bad} out of range for the {target.num_layers}-layer "
                f"target {args.target!r} (valid: 0..{target.num_layers - 1})"
            )
        target.layer_ids = list(args.layer_ids)
    try:
        plan = plan_features(
            target,
            args.rollouts,
            args.out,
            dtype=args.store_dtype or "bfloat16",
            max_seq_len=args.max_seq_len,
            shard_size=args.shard_size,
        )
        print(plan.summary(), flush=True)
        gb = plan.total_bytes / 1e9
        if gb > args.max_gb:
            return user_error(
                f"--max-gb: the features would take {gb:.3g} GB > {args.max_gb:g} GB; "
                f"pass --max-gb {gb * 1.1:.2g} to allow it (or use fewer rollouts / --max-seq-len)"
            )
        store = write_features(
            target, plan, batch_size=args.batch_size, progress=not args.no_progress
        )
    except (FeatureError, RolloutError) as exc:
        return user_error(exc)
    print(
        f"{store.num_rows} rollouts, {store.manifest['num_tokens']} tokens of features -> "
        f"{args.out} (train with data.features={args.out})"
    )
    return 0
