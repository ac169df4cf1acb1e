"""The sampling-mode scores of EDR's proposals: `A = min(1, q(x)/p(x))`, the TV cost and
(for the `gradient` round-start sampler) each proposal's logit-gradient moments, from the
drafter's hidden states or logits and the target's processed distribution p.

Split from `edr_step.py`, which decides which round starts are scored and drafted.
"""

from __future__ import annotations

import torch

from blockdraft.objectives.cross_entropy import default_chunk_rows, token_logprobs
from blockdraft.objectives.edr import acceptance_and_cost
from blockdraft.objectives.edr_fused import scores_with_gradient_moments
from blockdraft.objectives.row_chunks import by_row_chunks, fused_chunk_rows
from blockdraft.training.draft_space import DraftSpace


def head_chunked_scores(drafter, space, hidden, prev, p, ids, columns, settings, stops, moments):
    """`(A, c, log q(label) or None, moments or None)` of every proposal, with the LM head
    run inside row chunks of `default_chunk_rows` (~64 MB of logits): under autograd each
    chunk is checkpointed (`row_chunks.by_row_chunks`), so its logits are recomputed in
    backward, as `target_logprobs` does for the cross-entropy (rows that fit one chunk
    run as one piece: no recompute where the memory is small). Why: whole, the step held
    the `[blocks*K, V]` logits, the q the fused kernel keeps for backward and their
    gradient, ~1 GB each at the Gemma shape, where `uniform` holds <= 256 MB.
    `columns` (logged steps): the labels' columns, -1 where none, for the detached T = 1
    log q(label) of the statistics; `moments`: the `gradient` sampler's scoring pass."""
    width = p.shape[-1]

    def rows_fn(h, prv, pp, x, col):
        z = DraftSpace.drafter_logits(drafter, space, h, prv)
        if moments:
            return scores_and_moments(z, pp, x, settings, stops)
        acc, cost = acceptance_and_cost(
            z, pp, x, mode="sampling", temperature=settings.temperature,
            target_is_probs=True, stop_token_ids=stops,
        )  # fmt: skip
        if col is None:
            return acc, cost
        with torch.no_grad():
            return acc, cost, token_logprobs(z, col)

    flat = [
        hidden.reshape(-1, hidden.shape[-1]),
        prev.reshape(-1),
        p.reshape(-1, width),
        ids.reshape(-1),
        None if columns is None else columns.reshape(-1),
    ]
    chunk = default_chunk_rows(width)
    # logits of at most one chunk are kept (nothing recomputed); more go chunk by chunk
    one_piece = flat[0].shape[0] <= chunk
    outs = rows_fn(*flat) if one_piece else by_row_chunks(rows_fn, flat, chunk)
    acc, cost = (o.view(ids.shape) for o in outs[:2])
    extra = outs[2] if len(outs) > 2 else None
    if moments:
        return acc, cost, None, extra.view(*ids.shape, 3)
    return acc, cost, None if extra is None else extra.view(ids.shape), None


def scores_and_moments(logits, p, ids, settings, stop_token_ids):
    """`(A, c, moments [B, A, K, 3])` of every proposal: `acceptance_and_cost`'s sampling
    values (c zeroed at stop tokens and clamped at 1, as it does) and the logit-gradient
    moments of `scores_with_gradient_moments`, in one pass over the vocabulary."""
    vocab = logits.shape[-1]
    stops = None
    if len(stop_token_ids):
        stops = torch.as_tensor(list(stop_token_ids), dtype=torch.long, device=logits.device)
    acc, cost, moments = scores_with_gradient_moments(
        logits.reshape(-1, vocab),
        p.reshape(-1, vocab),
        ids.reshape(-1),
        temperature=settings.temperature,
        target_is_probs=True,
        stops=stops,
        chunk_rows=fused_chunk_rows(None, vocab, logits.device),
    )
    acc, cost = acc.view(ids.shape), cost.view(ids.shape).clamp(max=1.0)
    if stops is not None:
        cost = torch.where(torch.isin(ids, stops), torch.zeros((), dtype=cost.dtype), cost)
    return acc, cost, moments.view(*ids.shape, 3)
