"""A trained drafter with prompt lookup as a per-slot fallback (`hybrid[:conf=C]:PATH`).

Why: their errors are complementary (research/results.md): the trained drafter wins the first
slots, prompt lookup the late slots of text that repeats its context. So slot h takes
the drafter's token where the drafter is confident (max probability >= `min_confidence`)
or lookup has nothing there, and the looked-up token otherwise. The choice depends only
on the round's context, never on sampled draft tokens, so the block is an ordinary
proposal with per-slot q'_h = the drafter's q_h or a one-hot: standard verification stays
lossless, and the offline acceptance is `min(1, q'_h(x)/p(x))`.
"""

from __future__ import annotations

from typing import Any

import torch

from blockdraft.drafters.draft_vocab import sample_draft_logits
from blockdraft.drafters.ngram import NgramDrafter
from blockdraft.drafters.trimmed import slot_confidence

DEFAULT_MIN_CONFIDENCE = 0.3


class HybridDrafter:
    """`drafter` (a trained block drafter) + `ngram`, merged slot by slot."""

    objective = "hybrid"

    def __init__(
        self,
        drafter: Any,
        ngram: NgramDrafter | None = None,
        min_confidence: float = DEFAULT_MIN_CONFIDENCE,
    ) -> None:
        cfg = getattr(drafter, "config", None)
        k = int(getattr(cfg, "num_proposals", None) or drafter.num_proposals)
        if getattr(cfg, "arch", "dflash") != "dflash" or getattr(drafter, "sequential", False):
            # a semi-AR drafter's confidences depend on the drafted tokens, so the choice
            # would differ between offline (teacher-forced) and online: not supported
            raise ValueError("hybrid: needs a parallel (dflash) drafter, not semi_ar")
        self.drafter = drafter
        self.ngram = ngram or NgramDrafter(num_proposals=k)
        if self.ngram.num_proposals != k:
            raise ValueError(f"hybrid: ngram K={self.ngram.num_proposals} != drafter K={k}")
        if not 0.0 <= min_confidence <= 1.0:
            raise ValueError(f"hybrid: conf must be in [0, 1], got {min_confidence}")
        self.min_confidence = float(min_confidence)
        self.config = cfg

    @property
    def num_proposals(self) -> int:
        return self.ngram.num_proposals

    def eval(self) -> HybridDrafter:
        self.drafter.eval()
        return self

    # --- inference: the decoding loop keeps the drafter's context through these ---------
    def new_state(self) -> Any:
        return self.drafter.new_state()

    def extend_context(self, state: Any, features: torch.Tensor, start: int) -> None:
        self.drafter.extend_context(state, features, start)

    @torch.no_grad()
    def draft_block(
        self,
        state: Any,
        anchor_id: int,
        anchor_position: int,
        looked_up: list[int],
        temperature: float,
        top_p: float = 1.0,
        top_k: int = 0,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(tokens [K], q' [K, V] they were drawn from; None at T = 0) of one round.

        `looked_up` is the prompt-lookup proposal over the verified text (0..K tokens).
        Confidence and the greedy argmax come from the drafter's own vocabulary (a
        reduced one: its D columns, not the target's V; the same softmax and argmax, as
        the offline evaluator computes them); only T > 0 expands q to the target's."""
        hidden = self.drafter.draft_hidden(state, anchor_id, anchor_position)
        return self.block_from_hidden(hidden, looked_up, temperature, top_p, top_k, generator)

    @torch.no_grad()
    def block_from_hidden(
        self,
        hidden: torch.Tensor,
        looked_up: list[int],
        temperature: float,
        top_p: float = 1.0,
        top_k: int = 0,
        generator: torch.Generator | None = None,
        products: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`draft_block` from the drafter's hidden states `[K, H]` of the round (the loop's
        lean round computes them faster than `draft_hidden`); `products`: the head's
        `hidden @ W^T` from a faster kernel (the loop's packed head)."""
        if products is None:
            logits = self.drafter.compute_draft_logits(hidden)  # [K, V_draft]
        else:
            logits = self.drafter.slot_logits(hidden, None, products)
        use = self.use_lookup(logits, len(looked_up))
        lookup = torch.full((logits.shape[0],), -1, dtype=torch.long, device=logits.device)
        if looked_up:
            lookup[: len(looked_up)] = torch.tensor(looked_up, device=logits.device)
        ids = self.drafter.draft_ids
        if temperature == 0:
            best = logits.argmax(-1)
            best = best if ids is None else ids.to(best.device)[best]
            return torch.where(use, lookup, best), None
        vocab = int(self.config.vocab_size) if ids is not None else logits.shape[-1]
        drawn, q = sample_draft_logits(logits, ids, vocab, temperature, top_p, top_k, generator)
        tokens = torch.where(use, lookup, drawn)
        one_hot = torch.zeros_like(q).scatter_(-1, tokens.clamp_min(0).view(-1, 1), 1.0)
        return tokens, torch.where(use.unsqueeze(-1), one_hot, q)

    def use_lookup(self, logits: torch.Tensor, looked_up: int | torch.Tensor) -> torch.Tensor:
        """`[..., K]` bool: slots that take the looked-up token.

        `logits` `[..., K, V]` are the drafter's raw logits (confidence is the softmax at
        temperature 1 whatever the sampling temperature, so that one threshold means the
        same thing in greedy and sampled decoding); `looked_up` is how many tokens the
        lookup proposed (slots past it always keep the drafter's token)."""
        conf = slot_confidence(logits)
        slots = torch.arange(conf.shape[-1], device=conf.device)
        return (conf < self.min_confidence) & (slots < looked_up)
