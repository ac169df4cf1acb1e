"""The options every command that runs drafters on a target takes, and their set-up.

Why one module: `eval`, `compare`, `suite`, `decode` and `serve-check` load a target on
`--device` in `--dtype`, cast drafters by `--drafter-dtype`, read `--rollouts` and keep
acceptance tensors in `--cache-dir`; defined here once, the flags mean the same in each,
and no command module imports another.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from blockdraft.artifacts import refuse_existing
from blockdraft.cli.arguments import positive_int, seed_int, user_error
from blockdraft.cli.target_options import add_target_options, load_target_from_args
from blockdraft.devices import (
    add_device_args,
    add_drafter_dtype_arg,
    device_and_dtype,
    drafter_dtype,
)
from blockdraft.evaluation.eval_compare import write_json
from blockdraft.serialization.drafter_spec import DrafterSpec, DrafterSpecError, checkpoint_of
from blockdraft.threads import add_threads_arg, configure_cpu

DRAFTER_HELP = (
    "drafter checkpoint directory (or run dir with final/); `ngram` or "
    "`ngram:k=7,max=3,min=1` for prompt lookup; `suffix[:k=7]` for suffix decoding; "
    "`hybrid[:conf=C]:RUN` for RUN with prompt lookup as a per-slot fallback; "
    "`trim[:conf=C]:RUN` for RUN proposing each block only up to its first slot below C"
)


def drafter_spec(text: str) -> DrafterSpec:
    """`type=` of every drafter argument: the spec is parsed with the command line, so a
    bad one is argparse's one-line error naming the argument."""
    try:
        return DrafterSpec.parse(text)
    except DrafterSpecError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_target_args(p: argparse.ArgumentParser) -> None:
    """The target options, `--cache-dir`, `--device`/`--dtype`, `--drafter-dtype`,
    `--threads` and `--no-progress`."""
    add_target_options(p)
    p.add_argument("--cache-dir", default=None, help="acceptance cache (default: user cache dir)")
    add_device_args(p)
    add_drafter_dtype_arg(p)
    add_threads_arg(p)
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")


def add_json_arg(p: argparse.ArgumentParser, what: str = "results") -> None:
    """`--json PATH` and the `--overwrite` it needs to replace an existing file."""
    p.add_argument(
        "--json", default=None, help=f"write the {what} as JSON here (a new file: see --overwrite)"
    )
    p.add_argument("--overwrite", action="store_true", help="let --json replace a file that exists")


def add_scoring_args(p: argparse.ArgumentParser, what: str = "results") -> None:
    """`--json`, `--n-boot` and `--seed` of the commands that report bootstrap CIs."""
    add_json_arg(p, what)
    p.add_argument(
        "--n-boot",
        type=positive_int,
        default=2000,
        help="bootstrap resamples of the rollouts for the 95%% CIs (default 2000)",
    )
    p.add_argument(
        "--seed", type=seed_int, default=0, help="seed of the bootstrap resampling (default 0)"
    )


def add_scored_args(p: argparse.ArgumentParser, drafters_help: str) -> None:
    """The target options, `--rollouts DIR` (repeatable: one benchmark per rollout set) and
    the drafters of `eval` and `compare`."""
    add_target_args(p)
    p.add_argument(
        "--rollouts",
        required=True,
        action="append",
        help="rollout directory (a benchmark); repeat for several",
    )
    p.add_argument("drafters", nargs="+", type=drafter_spec, help=drafters_help)


def add_allow_incomplete(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--allow-incomplete",
        action="store_true",
        help="score rollout sets whose `blockdraft rollout` was interrupted (refused otherwise)",
    )


def setup_target(args: argparse.Namespace) -> Any:
    """The target on `--device` in `--dtype` (drafters follow it: `drafter_dtype_of`);
    first a `--json` file that would be refused, before anything is computed."""
    if getattr(args, "json", None):
        refuse_existing(args.json, "--json", args.overwrite)
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


def run_scored_command(
    args: argparse.Namespace,
    compute: Callable[..., Any],
    markdown: Callable[[Any], str],
    json_obj: Callable[[Any], Any],
    **options: Any,
) -> int:
    """Shared body of `eval` and `compare`: check the checkpoints, load the target, run
    `compute` (`evaluate` or `compare`) on the flags, print markdown, optionally write JSON;
    bad input is a one-line error and exit code 2."""
    try:
        for d in args.drafters:
            checkpoint_of(d)
        target = setup_target(args)
        result = compute(
            target,
            args.drafters,
            args.rollouts,
            n_boot=args.n_boot,
            seed=args.seed,
            cache_dir=args.cache_dir,
            progress=not args.no_progress,
            allow_incomplete=args.allow_incomplete,
            drafter_dtype=drafter_dtype_of(args, target),
            **options,
        )
    except (FileNotFoundError, ValueError) as exc:
        return user_error(exc)
    print(markdown(result))
    write_json_flag(args, json_obj(result))
    return 0


def write_json_flag(args: argparse.Namespace, obj: Any) -> None:
    """`--json PATH`: write `obj` there (strict JSON, atomically; an existing file only
    with `--overwrite`) and say so; nothing without it."""
    if args.json:
        write_json(args.json, obj, overwrite=args.overwrite)
        print(f"wrote {args.json}")
