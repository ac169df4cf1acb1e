"""The `blockdraft` command: one sub-command per pipeline stage.

Each stage lives in its own module `blockdraft.cli.<stage>` exposing
`register(subparsers)`, which adds its parser and sets `func` to a callable taking the
parsed `argparse.Namespace` and returning an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

STAGES = [
    "rollout",
    "features",
    "train",
    "eval",
    "compare",
    "suite",
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
    """Run one sub-command; user and file errors print one line (`error: ...`), exit 2.

    `BLOCKDRAFT_TRACEBACK=1` re-raises them instead (for debugging).
    """
    from blockdraft.errors import BlockdraftError, os_error_message

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted; finished work is kept and the run can be resumed", file=sys.stderr)
        return 130
    except (BlockdraftError, OSError) as exc:
        if os.environ.get("BLOCKDRAFT_TRACEBACK"):
            raise
        msg = os_error_message(exc) if isinstance(exc, OSError) else str(exc)
        print(f"error: {msg.splitlines()[0] if msg else type(exc).__name__}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
