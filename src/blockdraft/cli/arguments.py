"""Value checks for every numeric command-line flag, and the one-line argparse error.

Used as argparse `type=` callables, the checks run while the command line is parsed,
before any model loads or file is written, and the message names the flag (`argument
--batch-size: must be an integer >= 1, got '0'`). `OneLineParser` prints it as the one
`error: ...` line (exit 2) and suggests the closest name for a mistyped sub-command, flag
or choice (`difflib`); `HelpFormatter` keeps every epilog's examples as written.
"""

from __future__ import annotations

import argparse
import difflib
import math
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

# `key.sub=value`: a dotted config override (`train`, `demo`), wherever it is typed
OVERRIDE = re.compile(r"^[A-Za-z_][\w.]*=")


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, except that text with line breaks (the examples of an epilog,
    a module docstring used as description) is printed as written instead of re-wrapped."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text.strip():
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def closest(word: str, candidates: Sequence[str]) -> str | None:
    """The candidate `word` most likely misspells (difflib), or None."""
    found = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return found[0] if found else None


def user_error(message: object) -> int:
    """Print a command's one `error: ...` line (a user or file error) and return its exit
    code, 2, the code argparse gives a bad command line."""
    print(f"error: {message}", file=sys.stderr)
    return 2


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one `error: ...` line (exit 2), like all others.

    Sub-parsers inherit the class and `HelpFormatter`. At the top, `parse_args` takes
    dotted overrides in any position and answers an unknown flag with the closest one of
    the chosen sub-command."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        # no prefix matching: `--drafter` must not silently become `--drafter-dtype`;
        # a mistyped or shortened flag gets the closest name instead (`_check_flag`)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self._fail(message, self.prog)

    def _fail(self, message: str, prog: str) -> NoReturn:
        hint = self._choice_hint(message)
        if hint is not None:
            message, prog = hint
        print(f"error: {message} (see `{prog} --help`)", file=sys.stderr)
        raise SystemExit(2)

    def _choice_hint(self, message: str) -> tuple[str, str] | None:
        """(message, prog whose help to name) for argparse's `invalid choice` error with
        the closest choice added; None for other errors."""
        m = re.match(r"argument (\S+): invalid choice: (['\"]?)(.*?)\2 \(choose from", message)
        if m is None:
            return None
        name, value = m.group(1), m.group(3)
        for action in self._actions:
            if not action.choices or not {name, *name.split("/")} & {
                action.dest,
                *action.option_strings,
            }:
                continue
            guess = closest(value, [str(c) for c in action.choices])
            if isinstance(action, argparse._SubParsersAction):
                what = f"unknown command {value!r}"
                if guess is None:
                    return f"{what}: choose from {', '.join(action.choices)}", self.prog
                return f"{what}: did you mean {guess!r}?", f"{self.prog} {guess}"
            if guess is not None:
                return f"{message.split(' (choose from')[0]}: did you mean {guess!r}?", self.prog
        return None

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        self._check_command(argv)
        # unknown flags first: argparse would report a missing required flag before them
        chosen = _typed_parser(self, argv)
        for arg in argv:
            if arg == "--":
                break
            if arg.startswith("--"):
                self._check_flag(arg, chosen)
        ns, extras = self.parse_known_args(argv, namespace)
        if extras and getattr(ns, "overrides", None) is not None:
            taken = [a for a in extras if OVERRIDE.match(a)]
            ns.overrides = [*ns.overrides, *taken]
            extras = [a for a in extras if not OVERRIDE.match(a)]
        if not extras:
            return ns
        for arg in extras:
            if arg.startswith("-"):
                self._check_flag(arg, chosen)
        self._fail(f"unrecognized arguments: {' '.join(extras)}", chosen.prog)

    def _check_command(self, argv: list[str]) -> None:
        """The first word that is not a flag must be a sub-command: a mistyped one
        (`evaluate`) is named with the closest command before its flags are judged
        against the top-level parser (`--target` is not one of its flags)."""
        for action in self._actions:
            if not isinstance(action, argparse._SubParsersAction):
                continue
            for word in argv:
                if word in ("-h", "--help", "--version", "--"):
                    return
                if word.startswith("-") or OVERRIDE.match(word):
                    continue
                if word not in action.choices:
                    self.error(
                        f"argument {action.dest}: invalid choice: {word!r} (choose from "
                        f"{', '.join(map(repr, action.choices))})"
                    )
                return

    def _check_flag(self, arg: str, parser: argparse.ArgumentParser) -> None:
        """Fail on a flag `parser` does not know (nor abbreviates), naming the closest one."""
        flag = arg.split("=", 1)[0]
        flags = [o for a in parser._actions for o in a.option_strings]
        if any(o == flag or (parser.allow_abbrev and o.startswith(flag)) for o in flags):
            return
        note = _positional_note(flag, parser) or _sampling_note(flag, parser)
        if note is not None:
            self._fail(f"unrecognized argument {arg}: {note}", parser.prog)
        guess = closest(flag, flags)
        if guess is None:
            self._fail(f"unrecognized argument {arg}", parser.prog)
        self._fail(f"unrecognized argument {arg}: did you mean {guess!r}?", parser.prog)


SAMPLING_WORDS = ("--temperature", "--top-p", "--top-k")


def _positional_note(flag: str, parser: argparse.ArgumentParser) -> str | None:
    """`--drafter PATH` where the command takes DRAFTER positionally (`decode` keeps the
    flag too): say so, rather than suggest a flag that merely starts the same way."""
    name = flag.lstrip("-").replace("-", "_")
    for action in parser._actions:
        if not action.option_strings and name in (action.dest, action.dest.rstrip("s")):
            shown = action.metavar or action.dest.upper()
            return f"{parser.prog.split()[-1]} takes {shown} as a positional argument: drop {flag}"
    return None


def _sampling_note(flag: str, parser: argparse.ArgumentParser) -> str | None:
    """For a command without sampling flags, a flag that looks like one (`--temprature`)
    is answered with where the settings come from, not with the closest unrelated flag."""
    flags = {o for a in parser._actions for o in a.option_strings}
    if "--rollouts" not in flags or any(f in flags for f in SAMPLING_WORDS):
        return None
    if closest(flag, SAMPLING_WORDS) is None:
        return None
    return (
        f"{parser.prog.split()[-1]} has no sampling flags: the rollouts carry their "
        "temperature, top-p and top-k (set them in `blockdraft rollout`)"
    )


class PrintAndExit(argparse.Action):
    """A flag that prints `text()` and exits 0 while the command line is parsed (like
    `--version`), so that it needs none of the command's required flags."""

    def __init__(self, option_strings: list[str], dest: str, text: Callable[[], str], **kw: Any):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)
        self.text = text

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None):
        print(self.text())
        parser.exit()


def _typed_parser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The (sub-)sub-command parser the words of `argv` name (for its flags and help)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for i, word in enumerate(argv):
                if word in action.choices:
                    return _typed_parser(action.choices[word], argv[i + 1 :])
    return parser


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


SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "max_new_tokens", "seed")


def add_sampling_args(
    p: argparse.ArgumentParser,
    helps: dict[str, str],
    defaults: dict[str, Any] | None = None,
    top_k: Callable[[str], int] = nonnegative_int,
) -> None:
    """The sampling flags `helps` names (`temperature` -> `--temperature`), in its order,
    each with its checked type; a flag missing from `defaults` defaults to None."""
    types = {
        "temperature": nonnegative_float,
        "top_p": probability,
        "top_k": top_k,
        "max_new_tokens": positive_int,
        "seed": seed_int,
    }
    for name, text in helps.items():
        flag = "--" + name.replace("_", "-")
        p.add_argument(flag, type=types[name], default=(defaults or {}).get(name), help=text)
