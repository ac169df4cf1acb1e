"""`blockdraft report RUN_DIR... [--eval JSON...] [--compare JSON...] [--decode JSON...] --out DIR`.

Collects training logs (each run directory's `metrics.jsonl`), offline results
(`blockdraft eval --json`), paired comparisons (`blockdraft compare --json`) and online
decoding results (`blockdraft decode --json`) into PNG plots and `DIR/report.md`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from blockdraft.cli.arguments import user_error
from blockdraft.pipeline.report import drafters_from_eval, existing_report_files, write_report

EXAMPLE = """example:
  blockdraft report runs/dpace runs/edr --eval eval.json --compare compare.json \\
      --decode decode.json --out report
"""


# the key that marks each command's --json output (what `report` reads from it)
_KINDS = {"eval": "benchmarks", "compare": "comparisons", "decode": "tau"}


def _results(path: str, kind: str) -> dict[str, Any]:
    """`blockdraft KIND --json` output read from `path`; a file of another kind is one line
    naming the flag it belongs to (never skipped in silence or drawn as junk)."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if isinstance(data, dict) and _KINDS[kind] in data:
        problem = _shape_problem(data, kind)
        if problem:
            raise ValueError(f"{path}: {problem} (not what `blockdraft {kind} --json` writes)")
        return data
    other = next((k for k, key in _KINDS.items() if isinstance(data, dict) and key in data), None)
    hint = (
        f": it is a `blockdraft {other} --json` file: pass it with --{other}"
        if other
        else f" (no {_KINDS[kind]!r} key)"
    )
    raise ValueError(f"{path}: not a `blockdraft {kind} --json` file{hint}")


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _shape_problem(data: dict[str, Any], kind: str) -> str | None:
    """The first key of a `--json` file whose type the report cannot read, or None."""
    if kind == "decode":
        return None if _is_number(data["tau"]) else f"'tau' is {data['tau']!r:.40}, not a number"
    key = _KINDS[kind]
    rows = data[key]
    if not isinstance(rows, list):
        return f"{key!r} is {rows!r:.40}, not a list"
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            return f"{key}[{i}] is {row!r:.40}, not an object"
        if kind == "compare" and not (
            {"a", "b"} <= row.keys()
            and _is_number(row.get("mal_a"))
            and _is_number(row.get("mal_b"))
        ):
            return f"{key}[{i}] has no 'a', 'b' and numeric 'mal_a', 'mal_b'"
        if kind == "eval":
            drafters = row.get("drafters", [])
            if not isinstance(drafters, list):
                return f"{key}[{i}].drafters is {drafters!r:.40}, not a list"
            for j, d in enumerate(drafters):
                if not (isinstance(d, dict) and "name" in d and _is_number(d.get("mal"))):
                    return f"{key}[{i}].drafters[{j}] has no 'name' and numeric 'mal'"
    return None


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "report",
        help="plots (PNG) and a markdown summary of training runs and evaluations",
        description="Write acceptance-rate, accepted-length, training-curve and D-PACE weight "
        "plots plus report.md that embeds them.",
        epilog=EXAMPLE,
    )
    p.add_argument("runs", nargs="*", help="training run directories (with metrics.jsonl)")
    # one file per flag, repeatable: a greedy nargs would swallow the run directories
    for kind in _KINDS:
        p.add_argument(
            f"--{kind}",
            action="append",
            default=[],
            metavar="JSON",
            help=f"a JSON file from `blockdraft {kind} --json` (repeatable)",
        )
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument(
        "--title", default="blockdraft report", help="report.md's heading (default: %(default)s)"
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the report (report.md and its plots) already in --out",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        drafters = [d for f in args.eval for d in drafters_from_eval(_results(f, "eval"))]
        comparisons = [c for f in args.compare for c in _results(f, "compare")["comparisons"]]
        online = {}
        for f in args.decode:
            data = _results(f, "decode")
            online[data.get("drafter", Path(f).stem)] = data
        logs = {}
        for run_dir in args.runs:
            metrics = Path(run_dir) / "metrics.jsonl"
            if not metrics.is_file():
                raise FileNotFoundError(
                    f"{run_dir}: no metrics.jsonl (not a training run directory)"
                )
            logs[Path(run_dir).resolve().name] = metrics
        if not (drafters or comparisons or online or logs):
            raise ValueError(
                "nothing to report: give run directories and/or --eval/--compare/--decode files"
            )
        if Path(args.out).exists() and not Path(args.out).is_dir():
            raise ValueError(
                f"--out {args.out}: is a file, not a directory; the report is a directory of "
                "report.md and its plots: choose a directory"
            )
        present = existing_report_files(args.out)
        if present and not args.overwrite:
            raise ValueError(
                f"--out {args.out}: already holds {present[0]} (an earlier report); pass "
                "--overwrite to replace it or choose another directory"
            )
        path = write_report(args.out, drafters, comparisons, logs, online, title=args.title)
    except (FileNotFoundError, ValueError) as exc:
        return user_error(exc)
    print(f"wrote {path}")
    return 0
