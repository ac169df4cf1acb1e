"""Pick a training objective by name: the one place the trainer and the CLI go through.

An objective is a class of `objective_types.py` (or of any module) with its `Params`, registered
here under a name by `register_objective(name, cls)`. `make_objective(name, mode,
**params)` checks the name and every parameter up front (a typo in a config fails at
start-up with the valid choices, not hours later); the trainer then asks the object
(`needs_target_distribution`, `is_rounds_objective`, its `params`), never its name.
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any

from blockdraft.objectives.objective_types import (
    DecayObjective,
    DPaceObjective,
    E2EObjective,
    EDRObjective,
    Objective,
    WeightedCEObjective,
)
from blockdraft.objectives.params import ObjectiveParamError, ObjectiveParams

MODES = ("sampling", "greedy")  # how the training rollouts were generated
OBJECTIVES: dict[str, type[Objective]] = {}


def register_objective(name: str, cls: type[Objective]) -> type[Objective]:
    """Make `cls` (an `Objective` with its `Params`) the objective `name`."""
    OBJECTIVES[name] = cls
    return cls


for _name, _cls in (
    ("uniform", WeightedCEObjective),
    ("decay", DecayObjective),
    ("dpace", DPaceObjective),
    ("e2e", E2EObjective),
    ("edr", EDRObjective),
):
    register_objective(_name, _cls)
OBJECTIVE_NAMES = tuple(OBJECTIVES)  # the built-in ones; `OBJECTIVES` also holds later ones
DEFAULT_OBJECTIVE = "dpace"
# names older configs use: the D-PACE variants as objectives of their own
ALIASES = {f"dpace-{v}": {"name": "dpace", "variant": v} for v in ("cumulative", "continuation")}


def resolve_alias(section: dict[str, Any]) -> dict[str, Any]:
    """An objective section (name + parameters) with an older name spelled as today."""
    return {**section, **ALIASES.get(section.get("name"), {})}


def objective_class(name: Any) -> type[Objective]:
    """The objective registered as `name`, or an `ObjectiveParamError` naming the choices."""
    if name not in OBJECTIVES:
        raise ObjectiveParamError(
            "name", f"unknown objective {name!r}; valid: {', '.join(OBJECTIVES)}"
        )
    return OBJECTIVES[name]


def objective_params(name: str) -> dict[str, Any]:
    """The parameters `name` accepts, with their defaults (for CLI help and configs)."""
    return {f.name: f.default for f in fields(objective_class(name).Params)}


def parameter_defaults() -> dict[str, Any]:
    """Every registered objective's parameters and their defaults: the keys an objective
    section may hold (another objective's only at its default, as older run.yaml files do)."""
    out: dict[str, Any] = {}
    for cls in OBJECTIVES.values():
        out.update({f.name: f.default for f in fields(cls.Params) if f.default is not MISSING})
    return out


def check_objective(name: str, params: dict[str, Any]) -> ObjectiveParams:
    """`params` as objective `name`'s `Params` (defaults filled in), or an
    `ObjectiveParamError` naming the bad key: the one validation configs and
    `make_objective` share."""
    cls = objective_class(name).Params
    valid = [f.name for f in fields(cls)]
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise ObjectiveParamError(
            unknown[0],
            f"unknown parameter(s) {', '.join(unknown)} for objective {name!r}; valid: "
            f"{', '.join(valid) or 'none'}",
        )
    return cls(**params)


def make_objective(name: str, mode: str = "sampling", **params: Any) -> Objective:
    """Build the objective `name` for rollouts of `mode` ("sampling" | "greedy") with
    validated `params` (its `Params` fields: docs/training.md, "Objectives")."""
    if mode not in MODES:
        raise ObjectiveParamError("mode", f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    params = resolve_alias({**params, "name": name})
    name = params.pop("name")
    return objective_class(name)(name, check_objective(name, params), mode)


__all__ = [
    "DEFAULT_OBJECTIVE",
    "OBJECTIVES",
    "OBJECTIVE_NAMES",
    "ObjectiveParamError",
    "make_objective",
    "objective_class",
    "objective_params",
    "parameter_defaults",
    "register_objective",
    "resolve_alias",
]
