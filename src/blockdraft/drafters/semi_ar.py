"""Semi-autoregressive drafter (DSpark style): the DFlash backbone plus a Markov head.

The parallel backbone drafts all K slots at once, so its proposals for consecutive slots
can be individually plausible but jointly inconsistent. A low-rank bigram bias from the
previous token, `logits_k = U_k + W1[x_{k-1}] @ W2` (W1 `[V, r]`, W2 `[r, V_draft]`),
fixes the worst of it for one `[r] x [r, V]` product per slot: teacher-forced in training
(`prev_tokens`), sampled slot by slot at inference. W2 starts at zero, so a fresh semi-AR
drafter equals its backbone (W1 is random, so W2 gets gradient from step one). Serving
engines have no such head: `export.validate_for_serving` refuses it.
"""

from __future__ import annotations

import torch
from torch import nn

from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig, DrafterState, sample_from_logits


class MarkovHead(nn.Module):
    """Low-rank previous-token bias `w1[prev] @ w2`, in draft-vocab space."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(vocab_size, rank) / rank**0.5)
        self.w2 = nn.Parameter(torch.zeros(rank, draft_vocab_size))

    def forward(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        # Negative ids (padding past the sequence end) index row 0; those slots are masked
        # out of every loss by the caller, so they only need to stay finite.
        return self.w1[prev_tokens.clamp(min=0)] @ self.w2


class SemiARDrafter(BlockDrafter):
    """BlockDrafter + MarkovHead; q of `sample_block` is the per-slot distribution used."""

    def __init__(self, config: DrafterConfig) -> None:
        if config.arch != "semi_ar":
            raise ValueError(
                f"SemiARDrafter needs a config with arch='semi_ar', got {config.arch!r}"
            )
        super().__init__(config)
        draft_vocab = config.draft_vocab_size or config.vocab_size
        self.markov_head = MarkovHead(config.vocab_size, draft_vocab, config.markov_rank)

    def _prev_token_bias(self, prev_tokens: torch.Tensor | None) -> torch.Tensor | None:
        if prev_tokens is None:
            return None
        return self.markov_head(prev_tokens.to(self.markov_head.w1.device))

    @torch.no_grad()
    def sample_block(
        self,
        state: DrafterState,
        anchor_id: int,
        anchor_position: int,
        temperature: float,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft slot by slot: slot k's logits get the bias of the token drafted at k-1."""
        hidden = self.draft_hidden(state, anchor_id, anchor_position)
        weight = self.head_weight.to(device=hidden.device, dtype=hidden.dtype)
        backbone = torch.nn.functional.linear(hidden, weight)  # [K, V_draft]
        prev = torch.tensor(int(anchor_id), device=hidden.device)
        tokens, qs = [], []
        for k in range(backbone.shape[0]):
            logits = self._finish_logits(backbone[k] + self.markov_head(prev).to(backbone.dtype))
            token, q = sample_from_logits(logits, temperature, generator)
            tokens.append(token)
            qs.append(q)
            prev = token
        return torch.stack(tokens), torch.stack(qs)
