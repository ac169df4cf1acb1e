"""A trained drafter that proposes only its confident prefix (`trim[:conf=C]:PATH`).

Why: a DFlash drafter proposes all K tokens every round, and where the target's verify
forward costs time per token checked (a CPU, a large batch) the unlikely tail of the block
costs more than it yields; prompt lookup, by contrast, proposes nothing when it has no
match. So a round's block ends before the first slot whose confidence (the softmax
maximum over the drafter's own vocabulary, at temperature 1) is below `min_confidence`.
The cut depends only on the round's context, never on sampled draft tokens, so the shorter
block is an ordinary proposal: verification stays lossless, and the offline acceptance of
a slot past the cut is 0.
"""

from __future__ import annotations

from typing import Any

import torch

DEFAULT_TRIM_CONFIDENCE = 0.3


def slot_confidence(logits: torch.Tensor) -> torch.Tensor:
    """`[..., K]` softmax maximum of the drafter's raw logits `[..., K, V]` (temperature 1
    whatever the sampling temperature, so one threshold means the same thing in greedy and
    sampled decoding)."""
    return torch.softmax(logits.float(), dim=-1).amax(-1)


class TrimmedDrafter:
    """`drafter` (a trained parallel block drafter) cut at its first unconfident slot."""

    objective = "trimmed"

    def __init__(self, drafter: Any, min_confidence: float = DEFAULT_TRIM_CONFIDENCE) -> None:
        cfg = getattr(drafter, "config", None)
        if getattr(cfg, "arch", "dflash") != "dflash" or getattr(drafter, "sequential", False):
            # a semi-AR drafter's confidences depend on the drafted tokens, so the cut
            # would differ between offline (teacher-forced) and online: not supported
            raise ValueError("trim: needs a parallel (dflash) drafter, not semi_ar")
        if not 0.0 <= min_confidence <= 1.0:
            raise ValueError(f"trim: conf must be in [0, 1], got {min_confidence}")
        self.drafter = drafter
        self.min_confidence = float(min_confidence)
        self.config = cfg

    @property
    def num_proposals(self) -> int:
        return int(getattr(self.config, "num_proposals", None) or self.drafter.num_proposals)

    def eval(self) -> TrimmedDrafter:
        self.drafter.eval()
        return self

    def kept(self, logits: torch.Tensor) -> torch.Tensor:
        """`[..., K]` bool: the slots proposed (the prefix before the first slot whose
        confidence is below `min_confidence`)."""
        confident = slot_confidence(logits) >= self.min_confidence
        return confident.long().cumprod(-1).bool()
