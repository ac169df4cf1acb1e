"""`blockdraft serve-check --target NAME --rollouts DIR DRAFTER`: the drafter served by an engine.

Exports the drafter (when given a run or checkpoint), serves it in `--engine` (vLLM by
default) three ways on the rollout set's prompts and settings (the drafter through
`dflash`, the engine's `ngram`, no speculation; `--ways` adds `suffix`, suffix decoding,
which in vLLM needs arctic-inference) and prints, per benchmark, whether the outputs equal
the rollouts (T = 0), the engine's rounds, tau and accepted tokens per position next to
the offline evaluator's on the same text, and each way's tokens/s at batch 1 and at
`--batch-size`. Needs the engine (vLLM: `make engine`);
`blockdraft.serving.serve_check.serve_check` is the Python API.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from blockdraft.cli.arguments import positive_int, user_error
from blockdraft.cli.drafter_options import (
    add_json_arg,
    add_target_args,
    drafter_spec,
    setup_target,
    write_json_flag,
)
from blockdraft.engines.interface import EngineError
from blockdraft.engines.registry import DEFAULT_ENGINE, engine_names
from blockdraft.evaluation.suite import benchmark_rollouts, load_suite
from blockdraft.serving.serve_check import DEFAULT_WAYS, WAYS, rounds_trace, serve_check

EXAMPLE = """example:
  blockdraft serve-check --target tiny --rollouts blockdraft-demo/rollouts/eval/set \\
      blockdraft-demo/runs/edr --limit 16 --json serve-check.json
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve-check",
        help="serve a drafter in an engine and compare it with the offline evaluator",
        description=__doc__,
        epilog=EXAMPLE,
    )
    add_target_args(p)
    p.add_argument(
        "drafter",
        type=drafter_spec,
        help="drafter run directory, checkpoint or export (exported on the fly), or "
        "hybrid[:conf=C]:PATH (served with its prompt-lookup fallback by blockdraft's plugin), "
        "or trim[:conf=C]:PATH (each block cut before its first slot below confidence C)",
    )
    p.add_argument(
        "--rollouts",
        action="append",
        default=[],
        help="rollout directory (a benchmark); repeat for several",
    )
    p.add_argument(
        "--suite", default=None, help="suite YAML: its benchmarks' rollout sets (made if missing)"
    )
    p.add_argument(
        "--limit", type=positive_int, default=None, help="use the first N prompts of each set"
    )
    p.add_argument(
        "--batch-size",
        type=positive_int,
        default=8,
        help="the larger batch whose tokens/s is measured beside batch 1 (default 8)",
    )
    p.add_argument(
        "--ways",
        default=",".join(DEFAULT_WAYS),
        help=f"comma-separated ways to serve, of {','.join(WAYS)} "
        f"(default: {','.join(DEFAULT_WAYS)})",
    )
    p.add_argument(
        "--engine", choices=engine_names(), default=DEFAULT_ENGINE, help="the serving engine"
    )
    p.add_argument(
        "--engine-dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="the engine's dtype (default: the target's, so greedy outputs can equal the rollouts)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        metavar="I",
        help="instead: serve prompt I of the first rollout set and compare the engine's proposals "
        "with the evaluator round by round (where a served/offline gap comes from)",
    )
    p.add_argument("--n-boot", type=positive_int, default=2000, help="bootstrap draws for CIs")
    add_json_arg(p, "full comparison")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not args.rollouts and not args.suite:
        return user_error("give --rollouts DIR (repeatable) or --suite FILE")
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    try:
        target = setup_target(args)
        if args.rounds is not None:
            if not args.rollouts:
                raise ValueError("--rounds I needs --rollouts DIR")
            trace = rounds_trace(target, args.drafter, args.rollouts[0], args.rounds, args.engine)
            print(render_rounds(trace))
            write_json_flag(args, trace)
            return 0 if trace["first_difference"] is None else 1
        dirs = list(args.rollouts)
        if args.suite:
            suite = load_suite(args.suite)
            dirs += [
                str(d)
                for d in benchmark_rollouts(
                    target, suite, allow_download=args.allow_download
                ).values()
            ]
        result = serve_check(
            target,
            args.drafter,
            dirs,
            ways=ways,
            limit=args.limit,
            batch_size=args.batch_size,
            dtype=args.engine_dtype,
            n_boot=args.n_boot,
            log=lambda msg: print(msg, file=sys.stderr, flush=True),
            engine=args.engine,
        )
    except (EngineError, FileNotFoundError, ValueError) as exc:
        return user_error(exc)
    print(render(result))
    write_json_flag(args, result)
    return 0


def _f(x: Any, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def render(result: dict[str, Any]) -> str:
    """The comparison as markdown: per benchmark, one row per way of serving."""
    lines = [f"# serve-check: {result['drafter']} on {result['target']} ({result['engine']})"]
    b = result["batch_size"]
    for bench in result["benchmarks"]:
        n, served, offline = bench["num_prompts"], bench["served"], bench["offline"]
        greedy = bench["settings"]["temperature"] == 0
        lines += [
            "",
            f"## {bench['name']} ({n} prompts, T = {bench['settings']['temperature']:g})",
            "",
            f"| way | outputs = rollouts | served rounds | offline rounds | served tau | offline "
            f"MAL [95% CI] | engine mean acc. length | tok/s batch 1 | tok/s batch {b} |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for way, row in served.items():
            off = offline.get(way, {})
            equal = f"{row['outputs_equal_rollouts']}/{n}" if greedy else "(sampled)"
            ci = off.get("mal_ci95")
            lines.append(
                f"| {way} | {equal} | {row.get('rounds', '-')} | "
                f"{_f(off.get('expected_rounds'), 1) if off else '-'} | "
                f"{_f(row.get('served_tau'))} | "
                + (f"{_f(off['mal'])} [{_f(ci[0])}, {_f(ci[1])}]" if off else "-")
                + f" | {_f(row.get('engine_mean_acceptance_length'))} | "
                f"{_f(row['tokens_per_s_batch1'], 1)} | {_f(row[f'tokens_per_s_batch{b}'], 1)} |"
            )
        for way, agree in bench["agreement"].items():
            lines.append(f"- {way}: {_verdict(way, agree, served[way], offline[way], greedy)}")
        for way in bench.get("engine_rules", []):
            lines.append(
                f"- {way}: {result['engine'].split()[0]}'s own rule, not blockdraft's: its "
                "rounds are reported, not compared (the offline row is blockdraft's rule)"
            )
    return "\n".join(lines)


def _verdict(
    way: str, agree: dict[str, Any], row: dict[str, Any], off: dict[str, Any], greedy: bool
) -> str:
    """One line on how the engine's numbers for a way sit against the offline evaluator's."""
    if not greedy:
        inside = "inside" if agree["inside_offline_ci95"] else "OUTSIDE"
        return f"served tau {_f(row['served_tau'])} {inside} the offline MAL's 95% CI"
    # `ngram` too: vLLM's prompt lookup is set to blockdraft's rule (earliest occurrence
    # of the longest suffix), so its rounds are compared prompt by prompt like a drafter's
    if agree["exact"]:
        text = "rounds equal the offline evaluator's on every prompt, so served tau = offline MAL"
    elif not agree["rounds_differ_on"]:  # an output differs: the engine's numerics, or loss
        other = len(row["outputs_equal"]) - agree["rounds_compared_on"]
        text = (
            f"rounds equal the offline evaluator's on the {agree['rounds_compared_on']} "
            f"prompt(s) whose output equals the rollout ({other} differ"
            f"{'s' if other == 1 else ''}: see whether `none` differs there too)"
        )
    else:
        text = (
            f"rounds differ on prompts {agree['rounds_differ_on'][:8]} "
            f"(of {agree['rounds_compared_on']} with outputs equal to the rollouts)"
        )
    if agree.get("accepted_past_end", 0) < 0:  # an engine drafting no further than the budget
        text += (
            f"; the engine accepted {-agree['accepted_past_end']:g} token(s) fewer than the "
            "evaluator, in last rounds where it drafted nothing (per position "
            f"{agree['accepted_past_end_per_position']})"
        )
    elif "accepted_past_end" in agree:
        text += (
            f"; the engine's mean acceptance length also counts {agree['accepted_past_end']:g} "
            "token(s) it accepted past the end of a response (per position "
            f"{agree['accepted_past_end_per_position']})"
        )
    return text


def render_rounds(trace: dict[str, Any]) -> str:
    """`--rounds`: one line per drafting round; `!` marks where engine and evaluator part."""
    lines = [
        f"# prompt {trace['prompt']}: the served output "
        f"{'equals' if trace['output_equals_rollout'] else 'DIFFERS FROM'} the rollout",
        "",
        "| round | start | served accepted | offline accepted | proposed | rollout's next tokens |",
        "|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(trace["rounds"]):
        mark = "" if r["served_accepted"] == r["offline_accepted"] else " !"
        lines.append(
            f"| {i}{mark} | {r['start']} | {r['served_accepted']} | {r['offline_accepted']} | "
            f"{r['proposed']} | {r['rollout_next']} |"
        )
    first = trace["first_difference"]
    lines.append(
        ""
        if first is None
        else f"\nfirst difference: round {first} (start {trace['rounds'][first]['start']})"
    )
    lines.append(
        "every round: the engine accepted what the evaluator accepts"
        if first is None
        else "from there the served and offline rounds part"
    )
    return "\n".join(lines)
