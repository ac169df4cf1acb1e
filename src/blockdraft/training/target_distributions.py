"""The target's distribution at each label position, as the training step needs it.

E2E and sampled EDR compare the drafter with the distribution each label was drawn from
(one-hot argmax when greedy), gathered from the target's logits a bounded number of rows
at a time. Rollouts written with `--store-topk K` under a top-k cutoff of at most K hold
all of it, so the rows come from the rollouts and the target need not run (`stored_topk`).
"""

from __future__ import annotations

import torch

from blockdraft.objectives.cross_entropy import default_chunk_rows
from blockdraft.sampling import sampling_probs


def target_probs_for(logits: torch.Tensor, positions: torch.Tensor, settings) -> torch.Tensor:
    """The target distribution each label was drawn from (one-hot argmax when greedy),
    `[B,A,K,V]` float32, built a bounded number of rows at a time (`gathered_rows`)."""
    if settings.greedy:
        return gathered_rows(logits, positions, _one_hot_argmax)
    return target_sampling_probs(logits, positions, settings)


def _one_hot_argmax(rows: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
    return out.scatter_(-1, rows.argmax(-1, keepdim=True), 1.0)


def target_sampling_probs(logits: torch.Tensor, positions: torch.Tensor, settings) -> torch.Tensor:
    """`[B,A,K,V]` float32: the distribution the token at each index in `positions` was
    sampled from (the logits at i - 1, processed as the rollouts were sampled)."""
    return gathered_rows(logits, positions, lambda rows: sampling_probs(rows, settings))


@torch.no_grad()
def gathered_rows(logits: torch.Tensor, positions: torch.Tensor, fn) -> torch.Tensor:
    """`fn(logits[b, positions - 1])` `[B,A,K,V]` float32, a bounded number of rows at a
    time (gathering all first would copy `[B*A*K, V]` rows once per step of `fn`)."""
    b, vocab = logits.shape[0], logits.shape[-1]
    src = (positions - 1).clamp_min(0).reshape(b, -1)
    out = torch.empty((b, src.shape[1], vocab), dtype=torch.float32, device=logits.device)
    step = default_chunk_rows(vocab)
    for i in range(b):
        for lo in range(0, src.shape[1], step):
            idx = src[i, lo : lo + step]
            out[i, lo : lo + step] = fn(logits[i].index_select(0, idx))
    return out.reshape(*positions.shape, vocab)


def stored_topk_is_whole(settings, stored_k: int) -> bool:
    """Whether a stored top-`stored_k` is a sampling distribution's whole support: sampling
    with a top-k cutoff of at most `stored_k` (every other token has probability 0)."""
    return not settings.greedy and 0 < settings.top_k <= stored_k


def stored_topk(batch, settings) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`(ids, logprobs) [B, T, K]`: the batch's stored top-K of each label's sampling
    distribution where that is the whole distribution (`stored_topk_is_whole`), else None
    (the target's logits are needed)."""
    ids = getattr(batch, "topk_ids", None)
    if ids is None or not stored_topk_is_whole(settings, ids.shape[-1]):
        return None
    return ids, batch.topk_logprobs


def stored_rows(stored, row: int, positions: torch.Tensor, table: torch.Tensor | None, width: int):
    """`[N, width]` float32: the stored distributions of sequence `row` at sequence indices
    `positions` (the distribution each of those tokens was drawn from), scattered into
    target columns (`table` None) or through `table` (target id -> column, the draft space)."""
    ids, logprobs = stored
    idx = ids[row].index_select(0, positions).to(torch.long)  # [N, K]; -1 where not stored
    probs = logprobs[row].index_select(0, positions).float().exp()  # -inf -> 0
    present = idx >= 0
    idx = idx.clamp_min(0)
    cols = idx if table is None else table[idx]
    out = torch.zeros((positions.numel(), width), dtype=torch.float32, device=probs.device)
    return out.scatter_add_(1, cols, torch.where(present, probs, torch.zeros_like(probs)))
