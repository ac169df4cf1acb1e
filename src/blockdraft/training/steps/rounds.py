"""The rounds objective's (EDR's) micro-step: every round start of every rollout.

EDR couples rounds (a round start's occupancy depends on every earlier one), so each
rollout's acceptance and cost cover all its round starts. Beyond `objective.max_anchors`
only that many are drafted with gradient (drawn by `objective.anchor_sampler`, weighted by
inverse inclusion probabilities); a chunked no-grad pass scores the rest. The maths lives
in `objectives.edr`; this module decides which blocks to draft, when, in which passes
(docs/training.md, "What a step does").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from blockdraft.data.anchors import round_start_anchors
from blockdraft.objectives import edr
from blockdraft.objectives.cross_entropy import DEFAULT_CHUNK_ELEMENTS, default_chunk_rows
from blockdraft.training.batching import Batch, derived_seed
from blockdraft.training.draft_forward import (
    DraftForward,
    has_selector,
    map_to_draft_vocab,
    with_unary_gradient,
)
from blockdraft.training.draft_space import DraftSpace, TargetRowTable, sampling_target_rows
from blockdraft.training.steps.anchored_blocks import (
    Blocks,
    block_stats,
    label_positions,
    pad_anchor_lists,
    target_output,
)
from blockdraft.training.steps.interface import MicroOutput, StepInputs
from blockdraft.training.steps.proposal_scores import (
    Proposals,
    SamplingTargets,
    head_chunked_scores,
    sampling_scores,
)
from blockdraft.training.target_distributions import stored_topk

# Most round starts per rollout per scoring pass (`default_score_chunk`): the default
# `max_anchors`, so a pass holds no more blocks than a default EDR step drafts with gradient.
DEFAULT_SCORE_CHUNK = 512

# A top-k target on at most this many columns is scored on them alone (`support_scores`);
# a wider one runs the whole-vocabulary kernels.
SUPPORT_COLUMNS = 64


@dataclass(frozen=True)
class RoundsBatch:
    """One micro-batch of whole rollouts as every drafter pass of the step reads it."""

    fwd: nn.Module  # DraftForward, possibly DDP/FSDP-wrapped
    stop_ids: Sequence[int]
    tout: Any  # the target's `TargetOutput` for `batch`
    batch: Batch
    settings: Any  # the rollouts' sampling settings
    mode: str  # "greedy" | "sampling"
    greedy_beta: float = 1.0  # greedy: the drafter temperature of `A = softmax(z / beta)(x)`
    # sampling: the step's target rows, built once for every pass (`TargetRowTable`)
    target_rows: TargetRowTable | None = None
    head_rows: int | None = None  # sampling, unwrapped: at most this many rows per LM-head product

    @property
    def drafter(self) -> nn.Module:
        return self.fwd.module.drafter if hasattr(self.fwd, "module") else self.fwd.drafter


@dataclass
class RoundStarts:
    """Each rollout's round starts (sequence indices), their number, how many carry
    gradient (all but the dead last one), and the rollouts with more of those than `limit`."""

    starts: list[torch.Tensor]
    rows: list[int]
    usable: list[int]
    long_rows: list[int]

    @classmethod
    def of(cls, batch: Batch, limit: int) -> RoundStarts:
        starts = [
            round_start_anchors(int(p), int(n))
            for p, n in zip(batch.prompt_lens, batch.response_lens, strict=True)
        ]
        rows = [int(s.numel()) for s in starts]
        # trainable rows: all but the dead last one (if no rollout has any, score the dead
        # rows anyway so the step still has a graph; their gradient is exactly zero)
        usable = [max(r - 1, 0) for r in rows]
        if not any(usable):
            usable = rows
        return cls(starts, rows, usable, [i for i, u in enumerate(usable) if u > limit])


def default_score_chunk(max_anchors: int, rollouts: int, width: int) -> int:
    """Round starts per rollout per sampling-mode scoring pass: as many as keep a pass's
    target rows (`width` columns) within the ~64 MB chunk budget, up to
    `DEFAULT_SCORE_CHUNK`, never fewer than `max_anchors`. Why: every pass re-projects the
    target context, so small passes cost a step ~10% (docs/training.md)."""
    fit = DEFAULT_CHUNK_ELEMENTS // max(1, rollouts * width)
    return max(max_anchors, min(DEFAULT_SCORE_CHUNK, fit))


def _sampling_targets(
    rb: RoundsBatch, space: DraftSpace | None, anchors: torch.Tensor
) -> tuple[SamplingTargets, torch.Tensor]:
    """The pass's target rows and each proposal's row index `[B, A, K]`: from the step's
    table, or built for this pass (`sampling_target_rows`)."""
    drafter, batch, settings = rb.drafter, rb.batch, rb.settings
    stops = rb.stop_ids if space is None else space.stop_columns
    k = drafter.config.block_size - 1
    positions = label_positions(anchors, k, batch.input_ids.shape[1])
    vocab = int(drafter.config.vocab_size)
    if rb.target_rows is not None:
        p_rows, p_index = rb.target_rows.rows, rb.target_rows.index(positions)
    else:
        p_rows, p_index = sampling_target_rows(
            rb.tout, positions, settings, space, default_chunk_rows(vocab),
            stored_topk(batch, settings), vocab,
        )  # fmt: skip
    support = None  # a top-k target: scored on its support (`support_scores`), unwrapped
    top_k = int(getattr(settings, "top_k", 0) or 0)
    if type(rb.fwd) is DraftForward and 0 < top_k < SUPPORT_COLUMNS:
        if rb.target_rows is not None:
            support = rb.target_rows.support(SUPPORT_COLUMNS)
        else:
            support = edr.target_support(p_rows, SUPPORT_COLUMNS)
    return SamplingTargets(p_rows, settings, stops, space, support), p_index


def _acceptance(
    rb: RoundsBatch,
    anchors: torch.Tensor,
    with_grad: bool,
    want_logq: bool = True,
    moments: bool = False,
):
    """(A, c, hidden, logq, blocks, moments) for anchors `[B, A]`. Sampling mode: `logq`
    only feeds the logged statistics (None unless `want_logq`, saving a log-softmax), and
    `moments` asks for the `gradient` sampler's logit-gradient moments `[B, A, K, 3]`."""
    fwd, tout, batch, stop_ids = rb.fwd, rb.tout, rb.batch, rb.stop_ids
    drafter = rb.drafter
    selector = has_selector(drafter)  # DFlash2: A, c of the selector; unary gets the weights
    blocks = Blocks.of(batch, anchors, drafter.config.block_size)
    labels, prev = blocks.labels, blocks.prev
    grad_moments = None
    ctx = torch.enable_grad() if with_grad else torch.no_grad()
    with ctx:
        sampling = rb.mode == "sampling"
        # sampling: compare in the draft vocabulary + 2 columns if the drafter has one
        space = DraftSpace.of(drafter, stop_ids) if sampling else None
        ids = labels.clamp_min(0) if space is None else space.labels(labels.clamp_min(0))
        if sampling:
            targets, p_index = _sampling_targets(rb, space, anchors)
        if sampling and type(fwd) is DraftForward:
            # DraftForward's own steps with the LM head inside the row chunks: the
            # `[blocks*K, V]` logits and targets never exist whole (`head_chunked_scores`).
            # Only unwrapped: DDP/FSDP must see their module's forward.
            hidden = fwd.drafter.forward_blocks(tout.features, batch.input_ids, anchors)
            columns = torch.where(labels >= 0, ids, -1) if with_grad and want_logq else None
            proposals = Proposals(hidden, prev, p_index, ids, columns)
            acc, cost, logq, grad_moments = head_chunked_scores(
                fwd.drafter, proposals, targets, moments, rb.head_rows
            )
        elif sampling:
            p, stops, settings = targets.rows[p_index], targets.stops, rb.settings
            out = fwd(tout.features, batch.input_ids, anchors, labels, prev, True,
                      unary=selector)  # fmt: skip
            hidden, logq, logits = out[:3]
            if moments:  # the gradient sampler's scoring pass: A, c and moments at once
                acc, cost, grad_moments = edr.sampling_scores_and_moments(
                    logits, p, ids, temperature=settings.temperature, stop_token_ids=stops
                )
            else:
                acc, cost = sampling_scores(logits, p, ids, settings, stops)
                if selector and with_grad:  # the unary logits get the same weights
                    acc_u, cost_u = sampling_scores(out[3][0], p, ids, settings, stops)
                    acc, cost = with_unary_gradient(acc, acc_u), with_unary_gradient(cost, cost_u)
        else:  # greedy EDR needs only q(x): no [.., K, V] logits (262k vocab = gigabytes)
            # A = softmax(z / beta)(x): beta = objective.greedy_temperature (docs/methods.md)
            out = fwd(
                tout.features, batch.input_ids, anchors, labels, prev, False, rb.greedy_beta,
                unary=selector,
            )  # fmt: skip
            hidden, logq = out[:2]
            _, in_vocab = map_to_draft_vocab(drafter, labels)
            logq_x = torch.where(in_vocab, logq, torch.full_like(logq, -math.inf))
            acc, cost = edr.greedy_soft_from_logprobs(logq_x, ids, stop_ids)
            if selector and with_grad:
                acc_u, cost_u = edr.greedy_soft_from_logprobs(out[3][1], ids, stop_ids)
                acc, cost = with_unary_gradient(acc, acc_u), with_unary_gradient(cost, cost_u)
    return acc, cost, hidden, logq, blocks, grad_moments


def score_round_starts(
    rb: RoundsBatch, anchors: torch.Tensor, chunk: int, moments: bool = False
) -> tuple[torch.Tensor, ...]:
    """Detached `(A, c)` `[B, A, K]` for anchors `[B, A]` (-1 = padding), at most `chunk`
    anchors per rollout per pass, so memory does not grow with the rollout length; with
    `moments` (sampling mode) also the logit-gradient moments `[B, A, K, 3]`."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"score_chunk must be a positive int, got {chunk!r}")
    if moments and rb.mode != "sampling":
        raise ValueError("moments come from the sampling-mode scoring pass (greedy: from A)")
    accs, costs, extra = [], [], []
    # An unwrapped DraftForward scores in inference mode (no autograd bookkeeping at all:
    # ~5% of the pass); DDP/FSDP keep no_grad (FSDP's gathered parameters must not become
    # inference tensors). `torch.cat` below hands back ordinary tensors.
    no_autograd = torch.inference_mode if type(rb.fwd) is DraftForward else torch.no_grad
    with no_autograd():
        for lo in range(0, anchors.shape[1], chunk):
            acc, cost, *_, m = _acceptance(rb, anchors[:, lo : lo + chunk], False, moments=moments)
            accs.append(acc)
            costs.append(cost)
            extra.append(m)
    if not moments:
        return torch.cat(accs, dim=1), torch.cat(costs, dim=1)
    return torch.cat(accs, dim=1), torch.cat(costs, dim=1), torch.cat(extra, dim=1)


def _with_dead_row(x: torch.Tensor, rows: int) -> torch.Tensor:
    """`[m, K]` scored rows -> `[rows, K]`, zero-filled below (the dead last row, which
    the recursions never read)."""
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.shape[0], x.shape[1]))], dim=0)


def _draw_round_starts(
    rb: RoundsBatch,
    objective,
    starts: RoundStarts,
    generators: list[torch.Generator],
    chunk: int,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per rollout of `starts.long_rows`, drawn with `generators[j]`: `(rows drawn [m],
    dense inclusion weights [L-1], A [L-1, K], c [L-1, K])`, A and c holding the no-grad
    scores of the rows the gradient pass will not draft (zeros where it will)."""
    limit, sampler, long_rows = objective.max_anchors, objective.anchor_sampler, starts.long_rows
    batch, usable = rb.batch, starts.usable
    rows = [starts.rows[i] for i in long_rows]
    drawn: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(long_rows)
    if sampler == "uniform":  # draw first, score only the other rows
        scored = []
        for j, i in enumerate(long_rows):
            idx, w = edr.sample_round_starts_uniformly(usable[i], limit, generators[j])
            drawn[j] = idx, edr.dense_row_weights(idx, w, rows[j])
            left = torch.ones(usable[i], dtype=torch.bool)
            left[idx] = False
            scored.append(left.nonzero().flatten())
    else:  # occupancy PPS: score every usable row, then draw from the occupancies
        scored = [torch.arange(usable[i]) for i in long_rows]
    sub = rb
    if len(long_rows) != batch.input_ids.shape[0]:  # else every rollout: no copy of the logits
        tout = rb.tout
        logits = None if tout.logits is None else tout.logits[long_rows]
        sub = dataclasses.replace(
            rb,
            tout=dataclasses.replace(tout, logits=logits, features=tout.features[long_rows]),
            batch=batch.rows(long_rows),
            target_rows=None if rb.target_rows is None else rb.target_rows.sequences(long_rows),
        )
    anchors = pad_anchor_lists(
        [starts.starts[i][r] for i, r in zip(long_rows, scored, strict=True)]
    )
    # the gradient sampler's sizes need the proposals' logit-gradient moments: sampling
    # mode gets them from the scoring pass (every usable row is scored), greedy from A
    want_moments = sampler == "gradient" and rb.mode == "sampling"
    # the head rows the gradient pass multiplies at once: no scoring product holds more
    head_rows = batch.input_ids.shape[0] * limit * (rb.drafter.config.block_size - 1)
    sub = dataclasses.replace(sub, head_rows=head_rows)
    acc, cost, *moments = score_round_starts(
        sub, anchors.to(batch.input_ids.device), chunk, moments=want_moments
    )
    full = []
    for j, r in enumerate(scored):
        at = r.to(acc.device)
        full.append(
            tuple(
                x.new_zeros((rows[j], x.shape[-1])).index_copy(0, at, x[j, : at.numel()])
                for x in (acc, cost)
            )
        )
    if sampler != "uniform":  # one batched recursion on the host
        padded = acc.new_zeros((2, len(long_rows), max(rows), acc.shape[-1]))
        for j, (a, c) in enumerate(full):
            padded[0, j, : rows[j]], padded[1, j, : rows[j]] = a, c
        padded = padded.cpu()
        grads = None  # greedy: from A
        if want_moments:  # rows 0 .. usable-1 in order; the dead last row stays 0
            grads = moments[0].new_zeros((*padded.shape[1:], 3))
            for j in range(len(long_rows)):
                grads[j, : rows[j] - 1] = moments[0][j, : rows[j] - 1]
            grads = grads.cpu()
        drawn = edr.draw_scored_round_starts(
            sampler, padded[0], padded[1], rows, limit, generators, grads
        )
    return [(*d, *f) for d, f in zip(drawn, full, strict=True)]


def _score_chunk(inputs: StepInputs, starts: RoundStarts, width: int) -> int | None:
    """Round starts per rollout per scoring pass: the configured number, else
    `max_anchors` (greedy, and DDP/FSDP, whose forward returns a pass's whole logits), or
    for an unwrapped sampling step as many as fit (`default_score_chunk`)."""
    chunk = inputs.score_chunk
    if starts.long_rows and chunk is None:
        chunk = inputs.objective.max_anchors
        if inputs.mode == "sampling" and type(inputs.fwd) is DraftForward:
            chunk = default_score_chunk(chunk, len(starts.long_rows), width)
    return chunk


def _target_row_table(
    rb: RoundsBatch, starts: RoundStarts, space: DraftSpace | None, width: int
) -> TargetRowTable | None:
    """The target rows of every usable round start, built once for both passes of an
    unwrapped sampling step when they fit one scoring pass's budget; else None."""
    drafter, batch = rb.drafter, rb.batch
    block_size = drafter.config.block_size
    if not (
        starts.long_rows
        and rb.mode == "sampling"
        and type(rb.fwd) is DraftForward
        and sum(u + block_size for u in starts.usable) * width <= DEFAULT_CHUNK_ELEMENTS
    ):
        return None
    every = pad_anchor_lists([s[:u] for s, u in zip(starts.starts, starts.usable, strict=True)])
    seq_len = batch.input_ids.shape[1]
    vocab = int(drafter.config.vocab_size)
    return TargetRowTable.build(
        rb.tout, label_positions(every.to(batch.input_ids.device), block_size - 1, seq_len),
        seq_len, rb.settings, space, default_chunk_rows(vocab), stored_topk(batch, rb.settings),
        vocab,
    )  # fmt: skip


def rounds_step(inputs: StepInputs, batch: Batch, step: int, want_acc: bool) -> MicroOutput:
    """Forward + EDR loss on one micro-batch of whole rollouts (no backward here)."""
    drafter, objective, settings = inputs.drafter, inputs.objective, inputs.settings
    stop_ids = inputs.stop_token_ids
    device = batch.input_ids.device
    sampling = inputs.mode == "sampling"
    # greedy EDR needs no target logits (skip the LM head), nor sampling EDR on rollouts
    # whose stored distributions are whole (`stored_topk`)
    with_logits = sampling and stored_topk(batch, settings) is None
    tout = target_output(inputs, batch, with_logits)
    starts = RoundStarts.of(batch, objective.max_anchors)
    rows, usable, long_rows = starts.rows, starts.usable, starts.long_rows
    chosen: list[torch.Tensor] = [torch.arange(u) for u in usable]
    weights: list[torch.Tensor | None] = [None] * len(rows)
    scored: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # no-grad (A, c) of long rows
    space = DraftSpace.of(drafter, stop_ids) if sampling else None
    width = int(drafter.config.vocab_size) if space is None else space.width
    chunk = _score_chunk(inputs, starts, width)
    rb = RoundsBatch(
        inputs.fwd, stop_ids, tout, batch, settings, inputs.mode, objective.greedy_temperature
    )
    # both passes read their rows from one table (no more than one scoring pass holds)
    rb = dataclasses.replace(rb, target_rows=_target_row_table(rb, starts, space, width))
    if long_rows:
        generators = [
            torch.Generator().manual_seed(
                derived_seed(inputs.seed, 13, step, int(batch.rollout_index[i]))
            )
            for i in long_rows
        ]
        drawn = _draw_round_starts(rb, objective, starts, generators, chunk)
        for i, (idx, w, acc_i, cost_i) in zip(long_rows, drawn, strict=True):
            chosen[i], weights[i], scored[i] = idx, w, (acc_i, cost_i)
    anchors = pad_anchor_lists([starts.starts[i][chosen[i]] for i in range(len(rows))])
    acc, cost, hidden, logq, blocks, _ = _acceptance(
        rb, anchors.to(device), True, want_logq=want_acc
    )
    acc_list, cost_list, keep = [], [], []
    for i, r in enumerate(rows):
        if r == 0:
            continue  # a 1-token response has no drafting round
        m = int(chosen[i].numel())
        if i in scored:
            (full_a, full_c), idx = scored[i], chosen[i].to(device)
            a, c = full_a.index_copy(0, idx, acc[i, :m]), full_c.index_copy(0, idx, cost[i, :m])
        else:
            a, c = (_with_dead_row(x[i, :m], r) for x in (acc, cost))
        acc_list.append(a)
        cost_list.append(c)
        keep.append(weights[i].to(device) if weights[i] is not None else None)
    stats = block_stats(inputs, hidden, blocks, None if logq is None else logq.detach(), want_acc)
    if not acc_list:
        zero = hidden.sum() * 0.0
        return MicroOutput(zero, torch.zeros((), dtype=torch.float64), stats, batch.num_tokens)
    out = objective.rounds_loss(
        acc_list, cost_list, keep if any(w is not None for w in keep) else None
    )
    denom = float(out.metrics["tokens"])
    return MicroOutput(
        out.loss * denom, torch.tensor(denom, dtype=torch.float64), stats, batch.num_tokens
    )
