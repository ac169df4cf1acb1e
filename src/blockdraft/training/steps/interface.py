"""What every micro-step takes and returns: `StepInputs` and a batch in, `MicroOutput` out.

Why one interface: the loop runs a micro-batch through whichever objective family the
run trains (`MicroStep`, chosen once by `steps.micro_step_for`), never branching on it.
Why a numerator and a denominator: every objective is a ratio whose denominator is a
detached count or weight sum over the batch (CE weights, blocks for E2E, emitted tokens
for EDR). Each micro-batch back-propagates its *un-normalised* numerator and the loop
divides the summed gradient by the all-reduced global denominator, so N processes x M
accumulation steps give exactly the gradient of one process on the whole batch
(averaging per-micro-batch losses would weight micro-batches equally instead).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from blockdraft.objectives import Objective
from blockdraft.training.batching import Batch
from blockdraft.training.feature_sources import FeatureSource


@dataclass(frozen=True)
class StepInputs:
    """Everything a micro-step reads besides the batch, fixed for the whole run."""

    fwd: nn.Module  # DraftForward, possibly DDP/FSDP-wrapped: what runs with gradient
    drafter: nn.Module  # the unwrapped drafter (its config, vocabulary, head)
    features: FeatureSource  # online target or cached features (`training/feature_sources.py`)
    objective: Objective
    settings: Any  # the rollouts' sampling settings (temperature, top-k, top-p, greedy)
    seed: int = 0  # with the step number and rollout index: every anchor and row draw
    mode: str = "greedy"  # rounds objective: "greedy" | "sampling"
    stop_token_ids: Sequence[int] = ()  # the target's: EDR's cost is 0 at a stop token
    num_anchors: int = 512  # block objectives: anchors sampled per sequence
    profile_alpha: float = 0.5  # the logged D-PACE weight profile's alpha and variant
    profile_variant: str = "full"
    score_chunk: int | None = None  # rounds objective: round starts per scoring pass


@dataclass
class StepStats:
    """Sums over a micro-batch (reduced across micro-batches and ranks before logging)."""

    k: int
    acc_correct: torch.Tensor = None  # [K]
    acc_count: torch.Tensor = None  # [K]
    profile_sum: torch.Tensor = None  # [K] normalised D-PACE weight profile summed over blocks
    profile_blocks: torch.Tensor = None  # [] blocks in profile_sum
    extra: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        z = torch.zeros(self.k, dtype=torch.float64)
        self.acc_correct = z.clone() if self.acc_correct is None else self.acc_correct
        self.acc_count = z.clone() if self.acc_count is None else self.acc_count
        self.profile_sum = z.clone() if self.profile_sum is None else self.profile_sum
        self.profile_blocks = (
            torch.zeros((), dtype=torch.float64)
            if self.profile_blocks is None
            else self.profile_blocks
        )

    def add(self, other: StepStats) -> None:
        self.acc_correct += other.acc_correct
        self.acc_count += other.acc_count
        self.profile_sum += other.profile_sum
        self.profile_blocks += other.profile_blocks

    def packed(self) -> torch.Tensor:
        """All sums as one float64 vector (one all-reduce)."""
        return torch.cat(
            [self.acc_correct, self.acc_count, self.profile_sum, self.profile_blocks.view(1)]
        )

    @classmethod
    def unpack(cls, vec: torch.Tensor, k: int) -> StepStats:
        vec = vec.cpu()
        return cls(
            k,
            vec[:k].clone(),
            vec[k : 2 * k].clone(),
            vec[2 * k : 3 * k].clone(),
            vec[3 * k].clone(),
        )


@dataclass
class MicroOutput:
    numerator: torch.Tensor  # differentiable: local loss * denominator
    denominator: torch.Tensor  # detached float64 scalar
    stats: StepStats
    tokens: int


class MicroStep(Protocol):
    """One micro-batch through target, drafter and objective (no backward here).

    `step`: the optimizer step (0-based; seeds the step's draws); `want_acc`: the step is
    logged (per-slot accuracies and the log q statistics are computed)."""

    def __call__(
        self, inputs: StepInputs, batch: Batch, step: int, want_acc: bool
    ) -> MicroOutput: ...
