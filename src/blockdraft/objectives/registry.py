"""Pick a training objective by name: the one place the trainer and the CLI go through.

`make_objective(name, **params)` validates the name and every parameter up front (a typo
in a config fails at start-up with the valid choices, not hours later) and returns one of
the types of `losses.py`. Its `needs_target_distribution` tells the trainer whether to
provide full target distributions (E2E, sampling-mode EDR) and `is_rounds_objective`
whether to build whole-rollout acceptance tensors instead of teacher-forced blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from blockdraft.objectives.dpace import dpace_weights
from blockdraft.objectives.losses import (
    E2EObjective,
    EDRObjective,
    Objective,
    WeightedCEObjective,
)
from blockdraft.objectives.schedules import decay_weights, default_decay_gamma, uniform_weights

OBJECTIVE_NAMES = (
    "uniform",
    "decay",
    "dpace",
    "dpace-cumulative",
    "dpace-continuation",
    "e2e",
    "edr",
)
EDR_MODES = ("sampling", "greedy")
ANCHOR_SAMPLERS = ("gradient", "occupancy", "uniform")  # edr round starts beyond max_anchors


class ObjectiveParamError(ValueError):
    """A bad objective name or parameter; `key` names it ("name", "alpha", ...)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def _alpha(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"alpha must be a number in [0, 1], got {value!r}")
    return float(value)


def _soft_weight(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"soft_weight must be a number in [0, 1], got {value!r}")
    return float(value)


def _optional_gamma(value: Any) -> float | None:
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(
            f"gamma must be a positive number (or None for DFlash's default), got {value!r}"
        )
    return float(value)


def _optional_positive_int(key: str) -> Callable[[Any], int | None]:
    def check(value: Any) -> int | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be a positive int (or None), got {value!r}")
        return value

    return check


def _positive_int(key: str) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be a positive int, got {value!r}")
        return value

    return check


def _positive_number(key: str) -> Callable[[Any], float]:
    def check(value: Any) -> float:
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value <= 0
        ):
            raise ValueError(f"{key} must be a positive finite number, got {value!r}")
        return float(value)

    return check


def _edr_mode(value: Any) -> str:
    if value not in EDR_MODES:
        hint = (
            " ('greedy' is the trainable soft relaxation A = q(x_t))"
            if value in ("greedy_soft", "greedy_hard")
            else ""
        )
        raise ValueError(f"edr mode must be one of {', '.join(EDR_MODES)}, got {value!r}{hint}")
    return value


def _anchor_sampler(value: Any) -> str:
    if value not in ANCHOR_SAMPLERS:
        raise ValueError(
            f"edr anchor_sampler must be one of {', '.join(ANCHOR_SAMPLERS)}, got {value!r}"
        )
    return value


# name -> {param: (default, validator)}
_PARAM_SPECS: dict[str, dict[str, tuple[Any, Callable[[Any], Any]]]] = {
    "uniform": {"soft_weight": (0.0, _soft_weight)},
    "decay": {"gamma": (None, _optional_gamma), "soft_weight": (0.0, _soft_weight)},
    "dpace": {"alpha": (0.5, _alpha), "soft_weight": (0.0, _soft_weight)},
    "dpace-cumulative": {"alpha": (0.5, _alpha), "soft_weight": (0.0, _soft_weight)},
    "dpace-continuation": {"alpha": (0.5, _alpha), "soft_weight": (0.0, _soft_weight)},
    "e2e": {
        "chunk_rows": (None, _optional_positive_int("chunk_rows")),
        "greedy_temperature": (0.5, _positive_number("greedy_temperature")),
    },
    "edr": {
        "mode": ("sampling", _edr_mode),
        "max_anchors": (512, _positive_int("max_anchors")),
        "anchor_sampler": ("gradient", _anchor_sampler),
        "greedy_temperature": (0.5, _positive_number("greedy_temperature")),
    },
}


def objective_params(name: str) -> dict[str, Any]:
    """The parameters `name` accepts, with their defaults (for CLI help and configs)."""
    _check_name(name)
    return {key: default for key, (default, _) in _PARAM_SPECS[name].items()}


def _check_name(name: Any) -> None:
    if name not in _PARAM_SPECS:
        raise ObjectiveParamError(
            "name", f"unknown objective {name!r}; valid: {', '.join(OBJECTIVE_NAMES)}"
        )


def _resolve_params(name: str, given: dict[str, Any]) -> dict[str, Any]:
    spec = _PARAM_SPECS[name]
    unknown = sorted(set(given) - set(spec))
    if unknown:
        valid = ", ".join(spec) if spec else "none"
        raise ObjectiveParamError(
            unknown[0],
            f"unknown parameter(s) {', '.join(unknown)} for objective {name!r}; valid: {valid}",
        )
    resolved = {}
    for key, (default, check) in spec.items():
        try:
            resolved[key] = check(given.get(key, default))
        except ObjectiveParamError:
            raise
        except ValueError as exc:
            raise ObjectiveParamError(key, str(exc)) from None
    return resolved


def check_objective(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """`params` resolved for objective `name` (defaults filled in), or an
    `ObjectiveParamError` naming the bad key: the one validation configs and
    `make_objective` share."""
    _check_name(name)
    return _resolve_params(name, params)


def _decay_weight_fn(gamma: float | None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def weights(logq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        k = logq.shape[-1]
        g = default_decay_gamma(k + 1) if gamma is None else gamma
        return decay_weights(k, g, dtype=logq.dtype, device=logq.device)

    return weights


def _dpace_weight_fn(
    alpha: float, variant: str
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def weights(logq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return dpace_weights(logq.exp(), alpha=alpha, variant=variant, mask=mask)

    return weights


def _uniform_weight_fn(logq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return uniform_weights(logq.shape[-1], dtype=logq.dtype, device=logq.device)


def make_objective(name: str, **params: Any) -> Objective:
    """Build the objective `name` (one of OBJECTIVE_NAMES) with validated `params`.

    Parameters: decay `gamma` (None = DFlash default for the block size, resolved from K
    at loss time); dpace* `alpha` (smoothing, default 0.5); uniform, decay and dpace*
    `soft_weight` (lambda: the share of the target's stored top-k distribution in each
    slot's cross-entropy, next to the hard label; default 0); e2e `chunk_rows` (rows per
    vocabulary chunk, None = ~64 MB chunks) and `greedy_temperature` (greedy rollouts: the
    overlap is `softmax(z / beta)(x)`, as greedy EDR's acceptance; default 0.5); edr
    `mode` ("sampling" | "greedy") and `max_anchors` (round starts sampled per rollout,
    default 512) and `anchor_sampler` (how they are drawn beyond that: "gradient" (the
    default) | "occupancy" | "uniform", see `training/steps/rounds.py`) and
    `greedy_temperature` (greedy mode: beta of the relaxation `A = softmax(z / beta)(x)`,
    default 0.5; 1.0 is the old `A = q(x)`).
    """
    resolved = check_objective(name, params)
    if name == "uniform":
        return WeightedCEObjective(name, resolved, _uniform_weight_fn)
    if name == "decay":
        return WeightedCEObjective(name, resolved, _decay_weight_fn(resolved["gamma"]))
    if name.startswith("dpace"):
        variant = {
            "dpace": "full",
            "dpace-cumulative": "cumulative",
            "dpace-continuation": "continuation",
        }[name]
        return WeightedCEObjective(name, resolved, _dpace_weight_fn(resolved["alpha"], variant))
    if name == "e2e":
        return E2EObjective(name, resolved)
    return EDRObjective(name, resolved)
