"""Value checks for every numeric command-line flag, and the one-line argparse error.

Why one place: a `--batch-size 0` or `--temperature -1` used to reach the library and
end in a traceback or in an error naming a parameter (`temperature must be >= 0`) rather
than the flag. Used as argparse `type=` callables, these checks run while the command
line is parsed, before any model loads or any file is written, and argparse puts the flag
in the message (`argument --batch-size: must be an integer >= 1, got '0'`).
`OneLineParser` prints that message as the one `error: ...` line every other user error
gets, with exit status 2 (argparse's own status for a bad command line).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one `error: ...` line (exit 2), like all others.

    Sub-parsers inherit the class (argparse makes them with the parent's type).
    """

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(2)


def _number(kind: type, value: str) -> int | float:
    try:
        number = kind(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected {'an integer' if kind is int else 'a number'}, got {value!r}"
        ) from None
    if isinstance(number, float) and not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {value!r}")
    return number


def _bounded(kind: type, low: float, *, strict: bool = False, high: float | None = None):
    what = "an integer" if kind is int else "a number"
    if high is not None:
        rule = f"in ({low:g}, {high:g}]" if strict else f"in [{low:g}, {high:g}]"
    else:
        rule = f"> {low:g}" if strict else f">= {low:g}"

    def check(value: str) -> int | float:
        number = _number(kind, value)
        ok = number > low if strict else number >= low
        if high is not None:
            ok = ok and number <= high
        if not ok:
            raise argparse.ArgumentTypeError(f"must be {what} {rule}, got {value!r}")
        return number

    check.__name__ = f"{kind.__name__} {rule}"  # what argparse shows for other failures
    return check


positive_int: Callable[[str], int] = _bounded(int, 1)
nonnegative_int: Callable[[str], int] = _bounded(int, 0)
positive_float: Callable[[str], float] = _bounded(float, 0.0, strict=True)
nonnegative_float: Callable[[str], float] = _bounded(float, 0.0)
probability: Callable[[str], float] = _bounded(float, 0.0, strict=True, high=1.0)  # top-p
seed_int: Callable[[str], int] = nonnegative_int  # torch and numpy seeds are >= 0
int_at_least_2: Callable[[str], int] = _bounded(int, 2)  # lengths, block sizes
top_k_or_minus_one: Callable[[str], int] = _bounded(int, -1)  # engines write -1 for "off"
