"""One micro-batch through target, drafter and objective, per objective family.

Every family's step has one signature (`MicroStep`: `StepInputs`, the batch, the step
number, whether the step is logged -> `MicroOutput`), and `micro_step_for(objective)`
picks it once per run, so the loop never asks which objective it trains:

- `block.py`: block objectives (uniform, decay, D-PACE cross-entropy; E2E), a few
  sampled anchors per sequence, each block scored on its own;
- `rounds.py`: the rounds objective (EDR), every round start of every rollout (the
  sampling-mode scores of its proposals: `proposal_scores.py`).

Both draft in the layout of `anchored_blocks.py`; `interface.py` holds the types.
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
