"""Every sub-command's `--help` is complete: an example in its epilog and a help text on
every flag and positional, so `blockdraft X --help` alone says how to use X."""

from __future__ import annotations

import argparse

import pytest

from blockdraft.cli import build_parser


def leaf_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every parser under `parser` (the sub-commands, and theirs), `parser` included."""
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                found += leaf_parsers(sub)
    return found


PARSERS = leaf_parsers(build_parser())


def test_every_command_is_walked():
    progs = {p.prog for p in PARSERS}
    for name in ("blockdraft eval", "blockdraft target sample", "blockdraft rollout-import"):
        assert name in progs, progs


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: p.prog.replace(" ", "-"))
def test_help_has_an_example_and_every_flag_says_what_it_does(parser):
    missing = [
        "/".join(a.option_strings) or a.dest
        for a in parser._actions
        if not isinstance(a, argparse._SubParsersAction) and not (a.help or "").strip()
    ]
    assert not missing, f"{parser.prog}: no help text on {missing}"
    assert "example" in (parser.epilog or ""), f"{parser.prog}: no example in its epilog"
    assert "blockdraft" in parser.format_help().split("example", 1)[1]
