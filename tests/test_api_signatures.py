"""The Python API's keyword defaults are those of the functions it wraps.

`blockdraft.api` restates each wrapped function's parameters (it takes names and plain
numbers where the library takes parsed objects); a default changed on one side only would
make `blockdraft.decode(...)` and `decode(...)` differ silently. For every API function,
each parameter that a wrapped function also has, under the same name and with a default,
must have the same default; the exceptions are named below, each with its reason.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from blockdraft import api
from blockdraft.data.rollouts import generate_rollouts
from blockdraft.decoding.loop import decode
from blockdraft.evaluation import eval_compare, suite
from blockdraft.sampling import SamplingSettings
from blockdraft.serialization.export import export_drafter
from blockdraft.targets.mask_token import load_target_with_mask
from blockdraft.training.trainer import train

WRAPS = {
    "load_target": [load_target_with_mask],
    "generate_rollouts": [generate_rollouts, SamplingSettings],
    "train": [train],
    "evaluate": [eval_compare.evaluate],
    "compare": [eval_compare.compare],
    "run_suite": [suite.run_suite],
    "decode": [decode],
    "export": [export_drafter],
}
# (api function, parameter): parsed by the API from text into the library's type, or (decode's
# progress) shown by every API function as by the command, where the loop's callers are
# the command and the demo, which print their own
EXEMPT = {("load_target", "device"), ("load_target", "dtype"), ("export", "dtype")}
EXEMPT |= {("decode", "progress")}


def _defaults(fn) -> dict:
    if dataclasses.is_dataclass(fn):
        return {f.name: f.default for f in dataclasses.fields(fn)}
    return {
        name: p.default
        for name, p in inspect.signature(fn).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


def shared_defaults_that_differ(api_fn, wrapped, parsed=frozenset()) -> list[str]:
    mine = _defaults(api_fn)
    out = []
    for fn in wrapped:
        for name, default in _defaults(fn).items():
            if name in mine and name not in parsed and mine[name] != default:
                out.append(f"{name}: {mine[name]!r} here, {default!r} in {fn.__qualname__}")
    return out


@pytest.mark.parametrize("name", sorted(WRAPS))
def test_api_defaults_equal_the_wrapped_functions(name: str) -> None:
    parsed = {p for fn, p in EXEMPT if fn == name}
    assert not shared_defaults_that_differ(getattr(api, name), WRAPS[name], parsed)


def test_the_check_sees_a_default_that_differs() -> None:
    def wrapped(x, *, max_new_tokens: int = 64, seed: int = 0): ...

    def facade(x, *, max_new_tokens: int = 128, seed: int = 0, progress: bool = True): ...

    assert shared_defaults_that_differ(facade, [wrapped]) == [
        "max_new_tokens: 128 here, 64 in "
        + "test_the_check_sees_a_default_that_differs.<locals>.wrapped"
    ]


def test_every_api_function_is_checked() -> None:
    public = {
        n
        for n in api.__all__
        if inspect.isfunction(getattr(api, n, None)) and getattr(api, n).__module__ == api.__name__
    }
    assert public - set(WRAPS) <= {"open_rollouts", "load_drafter"}  # one-line delegations
