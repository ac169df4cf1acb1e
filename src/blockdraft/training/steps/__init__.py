"""One micro-batch through target, drafter and objective, per objective family.

Every family's step has one signature (`MicroStep`), picked once per run by
`micro_step_for`: `block.py` for the block objectives (cross-entropy, E2E) on sampled
anchors, `rounds.py` for EDR on every round start (`proposal_scores.py`: its sampling
scores). Both draft in the layout of `anchored_blocks.py`; `interface.py` holds the types.
"""

from blockdraft.objectives import Objective
from blockdraft.training.steps.block import block_step
from blockdraft.training.steps.interface import MicroOutput, MicroStep, StepInputs, StepStats
from blockdraft.training.steps.rounds import rounds_step


def micro_step_for(objective: Objective) -> MicroStep:
    """The step of `objective`'s family: rounds objectives score whole rollouts, every
    other objective anchored blocks."""
    return rounds_step if objective.is_rounds_objective else block_step


__all__ = [
    "MicroOutput",
    "MicroStep",
    "StepInputs",
    "StepStats",
    "block_step",
    "micro_step_for",
    "rounds_step",
]
