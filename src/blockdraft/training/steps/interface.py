"""What every micro-step takes and returns: `StepInputs` and a batch in, `MicroOutput` out.

One interface, so the loop never branches on the objective family. A numerator and a
denominator because every objective is a ratio over a detached batch count (CE weights,
E2E blocks, EDR tokens): micro-batches back-propagate un-normalised numerators and the
loop divides by the global denominator, so N processes x M accumulation steps give the
gradient of one process on the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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

    def __post_init__(self) -> None:
        for name in ("acc_correct", "acc_count", "profile_sum"):
            if getattr(self, name) is None:
                setattr(self, name, torch.zeros(self.k, dtype=torch.float64))
        if self.profile_blocks is None:
            self.profile_blocks = torch.zeros((), dtype=torch.float64)

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
        sums = (vec[i * k : (i + 1) * k].clone() for i in range(3))
        return cls(k, *sums, vec[3 * k].clone())


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
