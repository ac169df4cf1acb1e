"""The `blockdraft` command: one sub-command per pipeline stage.

Each stage is a module `blockdraft.cli.<stage>` whose `register(subparsers)` adds its
parser and sets `func(args) -> exit code`, so a stage only parses, runs and prints.
Exit codes are the same for every sub-command: 0 done; 2 a user or file error (one
`error: ...` line, as argparse does for a bad command line); 130 Ctrl-C and 143 SIGTERM,
both after keeping finished work so the same command resumes; 1 a check that ran and said
no (`export --check`, `train --plan`); 3 training stopped on a non-finite loss.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import signal
import sys

from blockdraft.cli.arguments import OneLineParser
from blockdraft.errors import BlockdraftError, os_error_message

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
    "serve-check",
    "demo",
    "target",
]


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="blockdraft",
        description="Train and evaluate parallel block draft models for speculative decoding.",
        epilog="examples:\n"
        "  blockdraft demo            # the whole pipeline on the embedded target\n"
        "  blockdraft COMMAND --help  # each command's options and examples\n",
    )
    parser.add_argument("--version", action="version", version=f"blockdraft {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for stage in STAGES:
        importlib.import_module(f"blockdraft.cli.{stage.replace('-', '_')}").register(sub)
    return parser


def _version() -> str:
    """The installed distribution's version (`pyproject.toml`), or `unknown` when the
    package runs from a source tree that was never installed."""
    try:
        return importlib.metadata.version("blockdraft")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's stop, `kill PID`, `timeout`), raised like Ctrl-C's
    KeyboardInterrupt so the same cleanup runs: finished shards and checkpoints stay and
    half-written ones are never left in place."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated()


KEPT = "finished work is kept and the run can be resumed"


def main(argv: list[str] | None = None) -> int:
    """Run one sub-command; user and file errors print one line (`error: ...`), exit 2.

    `BLOCKDRAFT_TRACEBACK=1` re-raises them instead (for debugging).
    """
    parser = build_parser()
    args = parser.parse_args(argv)  # a bad command line: one line, SystemExit(2)
    previous = _install_sigterm()
    try:
        return int(args.func(args) or 0)
    except Terminated:
        print(f"terminated (SIGTERM); {KEPT}", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print(f"interrupted; {KEPT}", file=sys.stderr)
        return 130
    except (BlockdraftError, OSError) as exc:
        if os.environ.get("BLOCKDRAFT_TRACEBACK"):
            raise
        msg = os_error_message(exc) if isinstance(exc, OSError) else str(exc)
        print(f"error: {msg.splitlines()[0] if msg else type(exc).__name__}", file=sys.stderr)
        return 2
    finally:
        if previous is not _NOT_SET:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


_NOT_SET = object()


def _install_sigterm() -> object:
    """Turn SIGTERM into `Terminated` for this command; the old handler (to restore), or
    `_NOT_SET` where signals cannot be set (not the main thread)."""
    try:
        return signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:  # signal.signal works in the main thread only
        return _NOT_SET


if __name__ == "__main__":
    raise SystemExit(main())
