"""The `blockdraft` command: one sub-command per pipeline stage.

Each stage lives in its own module `blockdraft.cli.<stage>` exposing
`register(subparsers)`, which adds its parser and sets `func` to a callable taking the
parsed `argparse.Namespace` and returning an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys

STAGES = [
    "rollout",
    "features",
    "train",
    "eval",
    "compare",
    "decode",
    "report",
    "export",
    "demo",
    "target",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="blockdraft",
        description="Train and evaluate parallel block draft models for speculative decoding.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for stage in STAGES:
        try:
            module = importlib.import_module(f"blockdraft.cli.{stage}")
        except ModuleNotFoundError as exc:
            if exc.name == f"blockdraft.cli.{stage}":
                continue  # stage not built yet
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted; finished work is kept and the run can be resumed", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
