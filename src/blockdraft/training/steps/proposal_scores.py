"""Sampling-mode scores of a pass's proposals (A, the TV cost c, gradient moments), with
the LM head run in checkpointed row chunks.

Why chunks: whole, a sampled EDR step held the `[blocks*K, V]` logits, the fused kernel's
q and their gradient, ~1 GB each at the Gemma shape. Each chunk (~64 MB of logits) reads
its targets from the distinct rows of `SamplingTargets` and, under autograd, is
recomputed in backward (`row_chunks.by_row_chunks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from blockdraft.objectives import edr
from blockdraft.objectives.cross_entropy import default_chunk_rows, token_logprobs
from blockdraft.objectives.row_chunks import by_row_chunks
from blockdraft.training.draft_forward import has_selector, with_unary_gradient
from blockdraft.training.draft_space import DraftSpace

Tensor = torch.Tensor


@dataclass
class SamplingTargets:
    """The target side of a sampling-mode pass: the distinct target rows `[N, W]`
    (`draft_space.sampling_target_rows`), compared in `space` (None: target space)."""

    rows: Tensor
    settings: Any  # the rollouts' sampling settings (their temperature)
    stops: Sequence[int]  # stop columns: target ids, or the draft space's
    space: DraftSpace | None = None
    # `[N, k]` a top-k target's columns (`target_support`): both passes of a drafter, and a
    # selector's unary term, read those and one exp pass per row (`support_scores`)
    support: Tensor | None = None


@dataclass
class Proposals:
    """A pass's proposals, each `[B, A, K]` (hidden `[B, A, K, H]`): the drafter's hidden
    state, the token before, its target row in `SamplingTargets.rows`, its column, and
    (logged steps) the label's column for the T = 1 log q(label), -1 where none."""

    hidden: Tensor
    prev: Tensor
    index: Tensor
    ids: Tensor
    columns: Tensor | None = None


def sampling_scores(logits: Tensor, p: Tensor, ids: Tensor, settings, stops) -> tuple[Tensor, ...]:
    """Sampling-mode `(A, c)` of proposals scored with `logits` at the rollout temperature."""
    return edr.acceptance_and_cost(
        logits, p, ids, mode="sampling", temperature=settings.temperature,
        target_is_probs=True, stop_token_ids=stops,
    )  # fmt: skip


def head_chunked_scores(
    drafter: nn.Module,
    proposals: Proposals,
    targets: SamplingTargets,
    moments: bool,
    head_rows: int | None = None,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """`(A, c, log q(label) or None, moments or None)` of every proposal, the LM head run
    inside row chunks (one piece, no recompute, when they fit one). `head_rows` caps the
    rows per chunk. A DFlash2 selector is scored on its top-k candidates
    (`candidate_scores`, docs/methods.md); only its unary term is dense."""
    p_rows, settings, space = targets.rows, targets.settings, targets.space
    support, stops = targets.support, targets.stops
    width = p_rows.shape[-1]
    selector = has_selector(drafter)
    stop_columns = torch.as_tensor(list(stops), dtype=torch.long, device=p_rows.device)

    def dense_scores(z, at, x, want_moments):
        """`(A, c, moments or None)` of dense logits `z`: on the target's support, else
        against its whole rows."""
        if support is not None:
            return edr.support_scores(
                z, support, p_rows, at, x, temperature=settings.temperature,
                stops=stop_columns, moments=want_moments,
            )  # fmt: skip
        if want_moments:
            return edr.sampling_scores_and_moments(
                z, p_rows, x, temperature=settings.temperature, stop_token_ids=stops, p_index=at
            )
        return (*sampling_scores(z, p_rows.index_select(0, at), x, settings, stops), None)

    def rows_fn(h, prv, at, x, col):
        if selector:  # q lives on the top-k candidates: scored as `[rows, k]`
            u = drafter.unary_logits(h)  # one head product for the selector and the unary
            cand, scores = drafter.select(h, prv, u)
            acc, cost, m = edr.candidate_scores(
                scores, cand, p_rows, at, x, temperature=settings.temperature,
                stops=stop_columns, moments=moments,
            )  # fmt: skip
            if moments:
                return acc, cost, m
            if torch.is_grad_enabled():  # the unary logits get the same weights
                u = u if space is None else space.logits(u)
                acc_u, cost_u, _ = dense_scores(u, at, x, False)
                acc, cost = with_unary_gradient(acc, acc_u), with_unary_gradient(cost, cost_u)

            def logits():  # the selector's, in the drafter's layout (-inf off the candidates)
                z = scores.new_full((scores.shape[0], width), float("-inf"))
                return z.scatter(-1, cand, scores)
        else:
            z = DraftSpace.drafter_logits(drafter, space, h, prv)
            acc, cost, m = dense_scores(z, at, x, moments)
            if moments:
                return acc, cost, m

            def logits():
                return z

        if col is None:
            return acc, cost
        with torch.no_grad():  # logged steps: the T = 1 log q(label)
            return acc, cost, token_logprobs(logits(), col)

    hidden, ids, columns = proposals.hidden, proposals.ids, proposals.columns
    flat = [
        hidden.reshape(-1, hidden.shape[-1]),
        proposals.prev.reshape(-1),
        proposals.index.reshape(-1),
        ids.reshape(-1),
        None if columns is None else columns.reshape(-1),
    ]
    chunk = default_chunk_rows(width)
    if head_rows is not None:
        chunk = max(1, min(chunk, head_rows))
    # logits of at most one chunk are kept (nothing recomputed); more go chunk by chunk
    one_piece = flat[0].shape[0] <= chunk
    outs = rows_fn(*flat) if one_piece else by_row_chunks(rows_fn, flat, chunk)
    acc, cost = (o.view(ids.shape) for o in outs[:2])
    extra = outs[2] if len(outs) > 2 else None
    if moments:
        return acc, cost, None, extra.view(*ids.shape, 3)
    return acc, cost, None if extra is None else extra.view(ids.shape), None
