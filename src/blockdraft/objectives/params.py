"""How an objective declares its parameters: one frozen dataclass, each field's default and
check said once (`param(default, check)`).

Why: the config section, `make_objective`, the CLI help and the trainer all read the same
declaration, so a parameter's default lives in one place and a bad value fails at start-up
naming its key (`ObjectiveParamError.key`), not hours into a run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any


class ObjectiveParamError(ValueError):
    """A bad objective name or parameter; `key` names it ("name", "alpha", ...)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


Check = Callable[[Any], Any]  # value -> the value to keep; ValueError("must be ...") if bad


def param(default: Any, check: Check) -> Any:
    """A parameter field: its default and the check every value passes."""
    return field(default=default, metadata={"check": check})


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def unit_interval(value: Any) -> float:
    if not _number(value) or not 0.0 <= value <= 1.0:
        raise ValueError("must be a number in [0, 1]")
    return float(value)


def positive_number(value: Any) -> float:
    if not _number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError("must be a positive finite number")
    return float(value)


def positive_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError("must be a positive int")
    return value


def optional(check: Check) -> Check:
    """`check`, or None (which keeps the None)."""

    def checked(value: Any) -> Any:
        try:
            return None if value is None else check(value)
        except ValueError as exc:
            raise ValueError(f"{exc} (or null)") from None

    return checked


def one_of(*choices: str) -> Check:
    def checked(value: Any) -> str:
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return value

    return checked


@dataclass(frozen=True)
class ObjectiveParams:
    """Base of every objective's parameters: runs each field's check on construction."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            try:
                object.__setattr__(self, f.name, f.metadata["check"](value))
            except ValueError as exc:
                raise ObjectiveParamError(f.name, f"{f.name} {exc}, got {value!r}") from None


__all__ = [
    "ObjectiveParamError",
    "ObjectiveParams",
    "one_of",
    "optional",
    "param",
    "positive_int",
    "positive_number",
    "unit_interval",
]
