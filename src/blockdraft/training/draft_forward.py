"""From a batch of sequences and anchors to the drafter's `log q(label)` per block slot.

`DraftForward` is the one `nn.Module` whose `forward` runs every trainable parameter
(DDP/FSDP synchronise gradients on `forward`, so it is what gets wrapped); the plain
parallel head scores labels through the chunked LM head (no `[N, K, V]` logits unless an
objective needs them). DFlash2: objectives score the selector; the unary logits get its
per-position weights (`with_unary_gradient`).
"""

from __future__ import annotations

import torch
from torch import nn

from blockdraft.drafters.draft_vocab import target_to_draft
from blockdraft.drafters.semi_ar import SemiARDrafter
from blockdraft.kernels.row_argmax import row_argmax
from blockdraft.objectives.cross_entropy import (
    check_chunk_rows,
    target_logprobs,
    target_logprobs_and_top,
    token_logprobs,
)
from blockdraft.objectives.row_chunks import by_row_chunks
from blockdraft.training.draft_space import DraftSpace


def map_to_draft_vocab(
    drafter: nn.Module, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Target ids -> `(draft-vocab ids, in_vocab)`, for the rows of `drafter.head_weight`:
    labels outside a reduced vocabulary get -1 and drop out of the cross-entropy (the
    evaluation still counts them as rejections)."""
    draft_ids = getattr(drafter, "draft_ids", None)
    if draft_ids is None:
        return labels, labels >= 0

    table = target_to_draft(draft_ids.to(labels.device), int(drafter.config.vocab_size))
    mapped = torch.where(labels >= 0, table[labels.clamp_min(0)], torch.full_like(labels, -1))
    return mapped, mapped >= 0


LOGQ_FLOOR = -30.0  # log q of a label the selector cannot propose (q = 1e-13)


def has_selector(drafter: nn.Module) -> bool:
    """True for a DFlash2 drafter (proposals re-ranked by a candidate selector)."""
    return hasattr(drafter, "candidate_selector")


def with_unary_gradient(selector_term: torch.Tensor, unary_term: torch.Tensor) -> torch.Tensor:
    """The selector's value, and the gradients of both: what the objective sees for a
    DFlash2 drafter, so its per-position weights (computed from the value) also weight the
    unary logits' term."""
    return selector_term + (unary_term - unary_term.detach())


def floored_logq(logq: torch.Tensor) -> torch.Tensor:
    """`log q` with -inf (label not a candidate) replaced by `LOGQ_FLOOR` (no gradient)."""
    return torch.where(torch.isfinite(logq), logq, torch.full_like(logq, LOGQ_FLOOR))


class DraftForward(nn.Module):
    """Runs the drafter on anchored blocks and scores the labels (what DDP wraps)."""

    def __init__(self, drafter: nn.Module, chunk_rows: int | None = None) -> None:
        super().__init__()
        self.drafter = drafter
        self.chunk_rows = chunk_rows

    def forward(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        anchors: torch.Tensor,
        labels: torch.Tensor,
        prev: torch.Tensor,
        full_logits: bool = False,
        temperature: float = 1.0,
        unary: bool = False,
    ):
        """(hidden [B,A,K,H], logq [B,A,K] float32 (0 where label < 0), logits or None).

        `labels` are target ids (-1 = none); `logits` (with `full_logits`) are in the
        target vocabulary or a reduced vocabulary's `DraftSpace` columns. `temperature`:
        logq is `log softmax(z / temperature)(label)` (greedy EDR's relaxation; the plain
        head divides the hidden state instead, the same since `z = h W^T`).

        DFlash2: logq and logits are the selector's; `logq` carries the unary term's
        gradient too, unless `unary`, which returns `(unary logits, unary logq)` as a
        fourth element for the caller to weight (`with_unary_gradient`).
        """
        if full_logits and temperature != 1.0:
            raise ValueError("temperature scales logq only; not with full_logits")
        hidden = self.drafter.forward_blocks(features, input_ids, anchors)
        if has_selector(self.drafter):
            if full_logits:
                u = self.drafter.unary_logits(hidden)
                sel = self.drafter.selector_logits(hidden, prev, u)
                space, columns = DraftSpace.of(self.drafter), labels
                if space is not None:  # a reduced vocabulary: its DraftSpace columns
                    u, sel = space.logits(u), space.logits(sel)
                    columns = torch.where(labels >= 0, space.labels(labels.clamp_min(0)), -1)
                logq = floored_logq(chunked_token_logprobs(sel, columns, self.chunk_rows))
                logq_u = chunked_token_logprobs(u, columns, self.chunk_rows)
                # a label outside the draft vocabulary: no unary term (not -inf: its
                # gradient is all that is used, `with_unary_gradient`)
                logq_u = torch.where(torch.isfinite(logq_u), logq_u, torch.zeros_like(logq_u))
            else:  # log q(label) only: no [N, K, V] tensor is kept (`select_compact`)
                u, sel = None, None
                logq, logq_u = _selector_logq(
                    self.drafter, hidden, labels, prev, self.chunk_rows, temperature
                )
            if unary:
                return hidden, logq, sel, (u, logq_u)
            return hidden, with_unary_gradient(logq, logq_u), sel
        space = DraftSpace.of(self.drafter) if full_logits else None
        if space is not None:
            logits = DraftSpace.drafter_logits(self.drafter, space, hidden, prev)
            columns = torch.where(labels >= 0, space.labels(labels.clamp_min(0)), -1)
            return hidden, chunked_token_logprobs(logits, columns, self.chunk_rows), logits
        if full_logits or not _is_plain_parallel(self.drafter):
            logits = self.drafter.compute_logits(hidden, prev)
            scaled = logits if temperature == 1.0 else logits / temperature
            logq = chunked_token_logprobs(scaled, labels, self.chunk_rows)
            return hidden, logq, logits if full_logits else None
        draft_labels, _ = map_to_draft_vocab(self.drafter, labels)
        weight = self.drafter.head_weight
        h = hidden.to(weight.dtype)
        h = h if temperature == 1.0 else h / temperature
        logq = target_logprobs(h, weight, draft_labels, self.chunk_rows)
        return hidden, logq, None


def _selector_logq(drafter, hidden, labels, prev, chunk_rows, temperature=1.0):
    """(floored selector log q(label), unary log q(label)) without full logits, both at
    the drafter temperature (the candidates, a top-k, do not depend on it)."""
    columns, in_vocab = map_to_draft_vocab(drafter, labels)  # candidates are draft columns
    if _is_plain_head(drafter) and temperature == 1.0:
        # one head product gives the unary log q(label) and the candidates' logits
        weight = drafter.head_weight
        logq_u, top, candidates = target_logprobs_and_top(
            hidden.to(weight.dtype), weight, columns, drafter.candidate_selector.top_k, chunk_rows
        )
        prev_rows = drafter.predecessor_rows(prev)
        scores = drafter.candidate_selector.score(hidden, candidates, top, prev_rows)
    else:
        candidates, scores = drafter.select_compact(hidden, prev)
        if _is_plain_head(drafter):
            weight = drafter.head_weight
            h = hidden.to(weight.dtype) / temperature
            logq_u = target_logprobs(h, weight, columns, chunk_rows)
        else:
            unary = drafter.unary_logits(hidden) / temperature
            logq_u = chunked_token_logprobs(unary, columns, chunk_rows)
    hit = candidates == columns.clamp_min(0).unsqueeze(-1)
    logp = torch.log_softmax(scores.float() / temperature, -1)
    inside = hit.any(-1) & in_vocab
    sel = torch.where(hit, logp, torch.zeros((), dtype=logp.dtype, device=logp.device)).sum(-1)
    sel = torch.where(inside, sel, torch.full_like(sel, LOGQ_FLOOR))
    sel = torch.where(labels >= 0, sel, torch.zeros_like(sel))
    return sel, logq_u


def chunked_token_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, chunk_rows: int | None = None
) -> torch.Tensor:
    """`token_logprobs` a bounded number of rows at a time (`objectives.row_chunks`): the
    fused cross-entropy keeps a `[rows, V]` float32 log-softmax for backward."""
    vocab = logits.shape[-1]
    if logits.numel() == 0:
        return token_logprobs(logits, labels)
    (out,) = by_row_chunks(
        token_logprobs,
        [logits.reshape(-1, vocab), labels.reshape(-1)],
        check_chunk_rows(chunk_rows, vocab),
    )
    return out.reshape(labels.shape)


def _is_plain_head(drafter: nn.Module) -> bool:
    """Unary logits are `hidden @ head_weight.T` (no softcap, no multiplier)."""
    c = drafter.config
    return not c.final_logit_softcapping and c.output_multiplier == 1.0


def _is_plain_parallel(drafter: nn.Module) -> bool:
    """Logits are just `hidden @ head_weight.T` (`_is_plain_head`, no Markov head or
    selector), so `log q(label)` can be chunked over the vocabulary."""
    return (
        not isinstance(drafter, SemiARDrafter)
        and not getattr(drafter, "sequential", False)
        and _is_plain_head(drafter)
    )


def soft_target_logq(
    drafter: nn.Module,
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    fallback: torch.Tensor,
    chunk_rows: int = 4096,
) -> torch.Tensor:
    """`sum_j p(j) log q(j)` per slot `[B,A,K]`: the cross-entropy term of a soft target.

    `p` is the stored top-k `[B,A,K,k]` at each label position, renormalised over the ids
    the drafter can propose; a slot with none keeps `fallback` (its hard `log q(label)`).
    Plain parallel heads only: one product per row chunk, never a `[.., V]` tensor.
    """
    if not _is_plain_parallel(drafter):
        raise ValueError("soft targets need a plain parallel drafter head (drafter.arch: dflash)")
    ids, usable = map_to_draft_vocab(drafter, topk_ids)
    logp = torch.where(usable, topk_logprobs.float(), torch.full_like(topk_logprobs, -torch.inf))
    any_usable = usable.any(-1)
    p = torch.softmax(torch.where(any_usable.unsqueeze(-1), logp, torch.zeros_like(logp)), -1)
    p = torch.where(usable, p, torch.zeros_like(p))
    weight = drafter.head_weight
    flat_h = hidden.reshape(-1, hidden.shape[-1]).to(weight.dtype)
    flat_ids = ids.clamp_min(0).reshape(flat_h.shape[0], -1)
    parts = []
    for start in range(0, flat_h.shape[0], chunk_rows):
        logq = torch.log_softmax((flat_h[start : start + chunk_rows] @ weight.T).float(), -1)
        parts.append(logq.gather(-1, flat_ids[start : start + chunk_rows]))
    logq_top = torch.cat(parts).reshape(ids.shape)
    soft = (p * torch.where(usable, logq_top, torch.zeros_like(logq_top))).sum(-1)
    return torch.where(any_usable, soft, fallback)


@torch.no_grad()
def slot_argmax(
    drafter: nn.Module, hidden: torch.Tensor, prev: torch.Tensor, chunk_rows: int = 4096
) -> torch.Tensor:
    """Target-vocab argmax of q per slot `[B,A,K]`, chunked over rows for large vocabularies."""
    if not _is_plain_parallel(drafter):
        return row_argmax(drafter.compute_logits(hidden, prev))
    weight = drafter.head_weight
    flat = hidden.reshape(-1, hidden.shape[-1]).to(weight.dtype)
    out = torch.empty(flat.shape[0], dtype=torch.long, device=flat.device)
    for start in range(0, flat.shape[0], chunk_rows):
        out[start : start + chunk_rows] = row_argmax(flat[start : start + chunk_rows] @ weight.T)
    draft_ids = drafter.draft_ids
    if draft_ids is not None:
        out = draft_ids.to(out.device)[out]
    return out.reshape(hidden.shape[:-1])
