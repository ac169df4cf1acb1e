"""`blockdraft suite --target NAME --suite FILE DRAFTER...`: every drafter on every benchmark.

Generates each benchmark's rollouts when missing (cached per target, prompts and settings),
scores the drafters with the exact offline evaluator and prints the papers' table: MAL
with CI per benchmark and on the mean, the baseline (prompt lookup) first, paired gains
over it and between drafters. `blockdraft.evaluation.suite.run_suite` is the Python API.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from blockdraft.artifacts import refuse_existing
from blockdraft.cli.arguments import PrintAndExit, positive_int
from blockdraft.cli.drafter_options import (
    add_scoring_args,
    add_target_args,
    drafter_dtype_of,
    drafter_spec,
    setup_target,
    write_json_flag,
)
from blockdraft.evaluation.suite import (
    Suite,
    SuiteError,
    benchmark_arg,
    load_suite,
    run_suite,
    with_benchmarks,
)
from blockdraft.pipeline.report import suite_tables
from blockdraft.pipeline.report_plots import plot_suite
from blockdraft.recipes import SUITE, recipe_listing, resolve_recipe
from blockdraft.serialization.drafter_spec import checkpoint_of

EXAMPLE = """examples:
  blockdraft suite --target tiny --suite tiny blockdraft-demo/runs/dpace blockdraft-demo/runs/edr
  blockdraft suite --target smollm2-135m --suite smollm2 --data-dir ../shared/data runs/dpace
  blockdraft suite --list-suites      # the shipped suites (a path to any suite file works too)
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "suite",
        help="score drafters on a suite of held-out benchmarks, next to prompt lookup",
        description="Exact offline MAL of each drafter on each benchmark of a suite (rollouts "
        "generated and cached when missing), the mean over benchmarks, and paired gains over "
        "the baseline (prompt lookup unless the suite says otherwise) and between drafters.",
        epilog=EXAMPLE,
    )
    add_target_args(p)
    p.add_argument(
        "--suite",
        default=None,
        help="suite YAML file, or the name of a shipped suite (`--list-suites`; format in "
        "docs/evaluation.md)",
    )
    p.add_argument(
        "--list-suites",
        action=PrintAndExit,
        text=lambda: recipe_listing(SUITE),
        help="list the shipped suites and exit",
    )
    p.add_argument(
        "--benchmark",
        action="append",
        default=[],
        metavar="NAME=SPEC",
        help="add a benchmark from a prompt spec (any JSONL: `code=my.jsonl:prompt`); repeatable",
    )
    p.add_argument("--data-dir", default=None, help="replaces the suite's data_dir")
    p.add_argument(
        "--limit", type=positive_int, default=None, help="at most N prompts per benchmark"
    )
    p.add_argument("--baseline", type=drafter_spec, help="baseline drafter spec (default: ngram)")
    p.add_argument(
        "--rollouts-dir",
        default=None,
        help="where benchmark rollouts are kept (default: the user cache, <cache>/suites)",
    )
    p.add_argument(
        "--plot", default=None, help="write a PNG bar chart here (a new file: see --overwrite)"
    )
    p.add_argument(
        "--split",
        action="store_true",
        help="also split each benchmark's round starts by how many tokens the baseline gets "
        "accepted there, with each drafter's mean accepted length per group and the MAL of "
        "a per-round oracle choosing between the two (where a drafter loses to lookup)",
    )
    add_scoring_args(p)
    p.add_argument(
        "drafters",
        nargs="*",
        type=drafter_spec,
        help="checkpoint or run directories, `ngram[:...]`, `suffix[:...]`, `hybrid:PATH`, "
        "`trim:PATH` (the baseline is always scored first, then the suite's references)",
    )
    p.set_defaults(func=run)


def suite_from_args(args: argparse.Namespace) -> Suite:
    """The suite file with `--benchmark`, `--limit` and `--baseline` applied."""
    if args.suite is None and not args.benchmark:
        raise SuiteError("give --suite FILE or at least one --benchmark NAME=SPEC")
    suite = (
        load_suite(resolve_recipe(args.suite, SUITE, "--suite"), data_dir=args.data_dir)
        if args.suite
        else Suite("cli", benchmarks=[])
    )
    extra = [benchmark_arg(b) for b in args.benchmark]
    taken = {b.name for b in suite.benchmarks}
    clash = next((b.name for b in extra if b.name in taken), None)
    if clash is not None:
        raise SuiteError(f"--benchmark {clash}: the suite already has a benchmark of that name")
    return with_benchmarks(suite, extra, args.limit, args.baseline)


def run(args: argparse.Namespace) -> int:
    suite = suite_from_args(args)
    for d in args.drafters:
        checkpoint_of(d)  # a missing checkpoint fails before any rollout is generated
    if args.plot:
        refuse_existing(args.plot, "--plot", args.overwrite)
    target = setup_target(args)
    result = run_suite(
        target,
        suite,
        list(args.drafters),
        rollouts_root=args.rollouts_dir,
        cache_dir=args.cache_dir,
        n_boot=args.n_boot,
        seed=args.seed,
        progress=not args.no_progress,
        drafter_dtype=drafter_dtype_of(args, target),
        split=args.split,
        allow_download=args.allow_download,
    )
    print("\n".join(suite_tables(result)))
    write_json_flag(args, result)
    if args.plot:
        refuse_existing(args.plot, "--plot", args.overwrite)
        print(f"wrote {plot_suite(result, Path(args.plot))}")
    return 0
