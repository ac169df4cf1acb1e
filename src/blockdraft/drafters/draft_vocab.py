"""Reduced draft vocabulary: the drafter scores only the N most frequent target tokens.

With a 262k-token target the LM head dominates drafting and training cost on a CPU;
keeping only the head rows of the tokens that occur in the training data cuts it by V/N
and loses almost no acceptance (rare tokens are rarely accepted anyway). Verification
stays lossless: q is zero outside the draft vocabulary. Storage follows EAGLE-3 / vLLM,
so files need no conversion: a buffer `d2t` of length N, `d2t[i] = target_id(i) - i`
(an offset, not an absolute id).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from blockdraft.sampling import processed_probs, sample


def most_frequent_tokens(
    sequences: Iterable[Sequence[int] | torch.Tensor],
    size: int,
    vocab_size: int,
    always_include: Iterable[int] = (),
) -> torch.Tensor:
    """Target ids of the `size` most frequent tokens in `sequences`, sorted ascending.

    `always_include` (e.g. stop tokens) are kept whatever their count. Ties break toward
    the lower id, and unseen ids fill up a short list in id order, so the result is
    deterministic and always has exactly `size` entries.
    """
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocab size {size} must be in [1, {vocab_size}]")
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for seq in sequences:
        ids = torch.as_tensor(seq, dtype=torch.long).flatten()
        if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(
                f"token id outside the target vocab [0, {vocab_size}) in draft-vocab data"
            )
        counts += torch.bincount(ids, minlength=vocab_size).double()
    forced = sorted(set(int(t) for t in always_include))
    if len(forced) > size:
        raise ValueError(f"{len(forced)} always-included tokens exceed draft vocab size {size}")
    counts[forced] = float("inf")
    # stable sort on -count keeps ascending id order among equal counts
    order = torch.sort(-counts, stable=True).indices
    return torch.sort(order[:size]).values


def d2t_offsets(draft_ids: torch.Tensor) -> torch.Tensor:
    """EAGLE-3/vLLM `d2t`: `draft_ids[i] - i`."""
    return draft_ids.long() - torch.arange(draft_ids.numel(), device=draft_ids.device)


def draft_ids_from_d2t(d2t: torch.Tensor) -> torch.Tensor:
    """Inverse of `d2t_offsets`: absolute target ids of the draft vocabulary."""
    return d2t.long() + torch.arange(d2t.numel(), device=d2t.device)


def target_to_draft(draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`[vocab_size]` map from target id to draft id, -1 for tokens outside the draft vocab."""
    table = torch.full((vocab_size,), -1, dtype=torch.long, device=draft_ids.device)
    table[draft_ids.long()] = torch.arange(draft_ids.numel(), device=draft_ids.device)
    return table


def sample_draft_logits(
    draft_logits: torch.Tensor,
    draft_ids: torch.Tensor | None,
    vocab_size: int,
    temperature: float,
    top_p: float,
    top_k: int,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(target ids `[k]`, target-space q `[k, V]`) drawn from `[k, V_draft]` logits.

    Processing and the draw run on the D columns (the same top-k/top-p, softmax and
    inverse-CDF order as on the -inf-padded target row, since `draft_ids` ascend); only
    the returned q, which verification needs, is placed in target space."""
    q_draft = processed_probs(draft_logits, temperature, top_p, top_k)
    if draft_ids is None:
        return sample(q_draft, generator), q_draft
    ids = draft_ids.to(q_draft.device)
    return ids[sample(q_draft, generator)], in_target_space(q_draft, ids, vocab_size)


def in_target_space(q_draft: torch.Tensor, draft_ids: torch.Tensor, vocab_size: int):
    """`[k, V_draft]` draft-column probabilities -> `[k, V]` target-space ones (0 elsewhere)."""
    q = q_draft.new_zeros((q_draft.shape[0], vocab_size))
    return q.index_copy_(-1, draft_ids.to(q_draft.device), q_draft)
