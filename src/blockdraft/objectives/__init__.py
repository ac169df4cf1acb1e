"""Training objectives for block drafters: pure tensor math, no models.

Block objectives weight a per-proposal cross-entropy (uniform, DFlash decay, D-PACE) or
maximise a block-local accepted-length surrogate (E2E); EDR (the `edr` package) scores
whole rollouts. `make_objective(name, mode, **params)` is the single entry point the trainer
uses; `register_objective(name, cls)` adds one (docs/architecture.md, "Adding an objective").
"""

from __future__ import annotations

from blockdraft.objectives.cross_entropy import (
    default_chunk_rows,
    target_logprobs,
    target_logprobs_and_top,
    token_logprobs,
    weighted_cross_entropy,
)
from blockdraft.objectives.dpace import DPACE_VARIANTS, dpace_weights
from blockdraft.objectives.e2e import (
    e2e_from_overlap,
    e2e_loss,
    expected_accepted_fraction,
    overlap,
    overlap_with_logits,
)
from blockdraft.objectives.edr import (
    acceptance_and_cost,
    edr_surrogate,
    expected_rounds,
    occupancy_and_value,
    rounds_objective,
    sample_round_starts,
    sample_round_starts_uniformly,
)
from blockdraft.objectives.losses import (
    E2EObjective,
    EDRObjective,
    LossOutput,
    Objective,
    WeightedCEObjective,
)
from blockdraft.objectives.params import ObjectiveParams, param
from blockdraft.objectives.registry import (
    OBJECTIVE_NAMES,
    make_objective,
    objective_params,
    register_objective,
)
from blockdraft.objectives.schedules import decay_weights, default_decay_gamma, uniform_weights

__all__ = [
    "acceptance_and_cost",
    "edr_surrogate",
    "expected_rounds",
    "occupancy_and_value",
    "rounds_objective",
    "sample_round_starts",
    "sample_round_starts_uniformly",
    "DPACE_VARIANTS",
    "OBJECTIVE_NAMES",
    "E2EObjective",
    "EDRObjective",
    "LossOutput",
    "Objective",
    "ObjectiveParams",
    "WeightedCEObjective",
    "decay_weights",
    "default_chunk_rows",
    "default_decay_gamma",
    "dpace_weights",
    "e2e_from_overlap",
    "e2e_loss",
    "expected_accepted_fraction",
    "make_objective",
    "objective_params",
    "overlap",
    "overlap_with_logits",
    "param",
    "register_objective",
    "target_logprobs",
    "target_logprobs_and_top",
    "token_logprobs",
    "uniform_weights",
    "weighted_cross_entropy",
]
