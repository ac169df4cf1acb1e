"""One EDR micro-batch: every round start of every rollout, as the paper trains it.

EDR's loss couples rounds (a round start's occupancy depends on every earlier round), so
each rollout's acceptance and cost must cover all its round starts. Beyond
`objective.max_anchors`, only that many rows are drafted with gradient, drawn by
`objective.anchor_sampler` and weighted by inverse inclusion probabilities; the others
are scored by a chunked no-grad pass (sampled rows' occupancies depend on all of them);
the last round start is never drafted. Sampling rollouts use `A = min(1, q(x)/p(x))` and
the TV cost, greedy ones `A = softmax(z / beta)(x)`, beta = `objective.greedy_temperature`
(samplers, costs: docs/training.md, "What a step does").
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from blockdraft.data.anchors import round_start_anchors
from blockdraft.objectives.cross_entropy import (
    DEFAULT_CHUNK_ELEMENTS,
    default_chunk_rows,
    token_logprobs,
)
from blockdraft.objectives.edr import (
    acceptance_and_cost,
    dense_row_weights,
    gradient_sizes,
    greedy_gradient_moments,
    greedy_soft_from_logprobs,
    occupancy_and_value,
    sample_round_starts,
    sample_round_starts_uniformly,
    state_occupancy,
)
from blockdraft.objectives.edr.acceptance import (
    candidate_scores,
    scores_with_gradient_moments,
    support_scores,
    target_support,
)
from blockdraft.objectives.row_chunks import by_row_chunks, fused_chunk_rows
from blockdraft.training.batching import Batch, derived_seed
from blockdraft.training.draft_forward import (
    DraftForward,
    has_selector,
    map_to_draft_vocab,
    with_unary_gradient,
)
from blockdraft.training.draft_space import DraftSpace, TargetRowTable, sampling_target_rows
from blockdraft.training.steps.block import (
    MicroOutput,
    block_stats,
    label_positions,
    labels_and_prev,
    pad_anchor_lists,
    response_logits_to_keep,
)
from blockdraft.training.target_distributions import stored_topk

# Most round starts per rollout per pass of the no-grad scoring pass, unless the caller
# names a number (`default_score_chunk`): the paper's (and the library's default)
# `max_anchors`, so a pass holds no more blocks than a default EDR step drafts with gradient.
DEFAULT_SCORE_CHUNK = 512

# The most target columns per row for which the no-grad scoring pass reads only those
# (`support_scores`: a top-k sampling target's k, plus a draft space's two mass columns);
# a target on more runs the whole-vocabulary kernels.
SUPPORT_COLUMNS = 64


def default_score_chunk(max_anchors: int, rollouts: int, width: int) -> int:
    """Round starts per rollout per sampling-mode scoring pass: as many as fit, not
    `max_anchors`.

    Why: every pass re-projects the target context and re-derives its positions' target
    rows, so passes of 16 or 32 round starts cost a T = 1 step ~10% (bench/
    edr_finetune_cost.py --score-chunks; docs/training.md). Up to `DEFAULT_SCORE_CHUNK`,
    and only as many as keep a pass's target rows (`width` columns: V or a draft space's)
    within the cross-entropy's ~64 MB chunk budget; never fewer than `max_anchors`, the
    old default. The pass's LM-head products stay at the gradient pass's rows
    (`score_round_starts`' `head_rows`), so its logits are no larger than before."""
    fit = DEFAULT_CHUNK_ELEMENTS // max(1, rollouts * width)
    return max(max_anchors, min(DEFAULT_SCORE_CHUNK, fit))


def _acceptance(
    fwd,
    stop_ids,
    tout,
    batch,
    anchors,
    settings,
    mode,
    with_grad: bool,
    want_logq: bool = True,
    moments: bool = False,
    greedy_beta: float = 1.0,
    head_rows: int | None = None,
    target_rows: TargetRowTable | None = None,
):
    """(A, c, hidden, logq, labels, mask, prev, moments) for the given anchors `[B, A]`.
    In sampling mode `logq` (T = 1 log q(label), detached) only feeds the logged
    statistics: None unless `want_logq` (a full-vocabulary log-softmax saved on unlogged
    steps). `moments` (sampling mode, for the `gradient` sampler): the proposals'
    logit-gradient moments `[B, A, K, 3]` (`scores_with_gradient_moments`), else None.
    `greedy_beta`: greedy mode's drafter temperature (`A = softmax(z / beta)(x)`);
    `head_rows`: at most this many rows per LM-head product (sampling, unwrapped);
    `target_rows`: the step's target rows, built once for every pass (sampling)."""
    drafter = fwd.module.drafter if hasattr(fwd, "module") else fwd.drafter
    selector = has_selector(drafter)  # DFlash2: A, c of the selector; unary gets the weights
    block_size = drafter.config.block_size
    labels, mask, prev = labels_and_prev(batch, anchors, block_size)
    grad_moments = None
    ctx = torch.enable_grad() if with_grad else torch.no_grad()
    with ctx:
        sampling = mode == "sampling"
        # sampling: compare in the draft vocabulary + 2 columns if the drafter has one
        space = DraftSpace.of(drafter, stop_ids) if sampling else None
        ids = labels.clamp_min(0) if space is None else space.labels(labels.clamp_min(0))
        if sampling:
            stops = stop_ids if space is None else space.stop_columns
            positions = label_positions(anchors, block_size - 1, batch.input_ids.shape[1])
            vocab = int(drafter.config.vocab_size)
            if target_rows is not None:
                p_rows, p_index = target_rows.rows, target_rows.index(positions)
            else:
                p_rows, p_index = sampling_target_rows(
                    tout, positions, settings, space, default_chunk_rows(vocab),
                    stored_topk(batch, settings), vocab,
                )  # fmt: skip
        if sampling and type(fwd) is DraftForward:
            # DraftForward's own steps with the LM head inside the row chunks: the
            # `[blocks*K, V]` logits and targets never exist whole (`head_chunked_scores`).
            # Only unwrapped: DDP/FSDP must see their module's forward.
            hidden = fwd.drafter.forward_blocks(tout.features, batch.input_ids, anchors)
            columns = torch.where(labels >= 0, ids, -1) if with_grad and want_logq else None
            support = None  # a top-k target: scored on its support (`support_scores`)
            top_k = int(getattr(settings, "top_k", 0) or 0)
            if 0 < top_k < SUPPORT_COLUMNS:
                if target_rows is not None:
                    support = target_rows.support(SUPPORT_COLUMNS)
                else:
                    support = target_support(p_rows, SUPPORT_COLUMNS)
            acc, cost, logq, grad_moments = head_chunked_scores(
                fwd.drafter, space, hidden, prev, p_rows, p_index, ids, columns, settings,
                stops, moments, head_rows, support,
            )  # fmt: skip
        elif sampling:
            p = p_rows[p_index]
            out = fwd(tout.features, batch.input_ids, anchors, labels, prev, True,
                      unary=selector)  # fmt: skip
            hidden, logq, logits = out[:3]
            if moments:  # the gradient sampler's scoring pass: A, c and moments at once
                acc, cost, grad_moments = scores_and_moments(logits, p, ids, settings, stops)
            else:
                acc, cost = _sampling_scores(logits, p, ids, settings, stops)
                if selector and with_grad:  # the unary logits get the same weights
                    acc_u, cost_u = _sampling_scores(out[3][0], p, ids, settings, stops)
                    acc, cost = with_unary_gradient(acc, acc_u), with_unary_gradient(cost, cost_u)
        else:  # greedy EDR needs only q(x): no [.., K, V] logits (262k vocab = gigabytes)
            # A = softmax(z / beta)(x): beta = objective.greedy_temperature (docs/methods.md)
            out = fwd(
                tout.features,
                batch.input_ids,
                anchors,
                labels,
                prev,
                False,
                greedy_beta,
                unary=selector,
            )
            hidden, logq = out[:2]
            _, in_vocab = map_to_draft_vocab(drafter, labels)
            logq_x = torch.where(in_vocab, logq, torch.full_like(logq, -math.inf))
            acc, cost = greedy_soft_from_logprobs(logq_x, ids, stop_ids)
            if selector and with_grad:
                acc_u, cost_u = greedy_soft_from_logprobs(out[3][1], ids, stop_ids)
                acc, cost = with_unary_gradient(acc, acc_u), with_unary_gradient(cost, cost_u)
    return acc, cost, hidden, logq, labels, mask, prev, grad_moments


def score_round_starts(
    fwd,
    stop_ids,
    tout,
    batch,
    anchors: torch.Tensor,
    settings,
    mode: str,
    chunk: int,
    moments: bool = False,
    greedy_beta: float = 1.0,
    head_rows: int | None = None,
    target_rows: TargetRowTable | None = None,
) -> tuple[torch.Tensor, ...]:
    """Detached `(A, c)` `[B, A, K]` for anchors `[B, A]` (-1 = padding), scoring at most
    `chunk` anchors per rollout per drafter pass so peak memory does not grow with the
    rollout length (each block is independent given the target features). With
    `moments` (sampling mode) a third tensor: the proposals' logit-gradient moments
    `[B, A, K, 3]` for the `gradient` sampler. `head_rows`: at most this many rows per
    LM-head product in sampling mode (a pass of many round starts then holds no more
    logits than the gradient pass does). `target_rows`: the step's target rows (sampling),
    built once for this pass and the gradient pass (`TargetRowTable`)."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"score_chunk must be a positive int, got {chunk!r}")
    if moments and mode != "sampling":
        raise ValueError("moments come from the sampling-mode scoring pass (greedy: from A)")
    accs, costs, extra = [], [], []
    # An unwrapped DraftForward scores in inference mode (no autograd bookkeeping at all:
    # ~5% of the pass); DDP/FSDP keep no_grad (FSDP's gathered parameters must not become
    # inference tensors). `torch.cat` below hands back ordinary tensors.
    no_autograd = torch.inference_mode if type(fwd) is DraftForward else torch.no_grad
    with no_autograd():
        for lo in range(0, anchors.shape[1], chunk):
            acc, cost, *_, m = _acceptance(
                fwd, stop_ids, tout, batch, anchors[:, lo : lo + chunk], settings, mode, False,
                moments=moments, greedy_beta=greedy_beta, head_rows=head_rows,
                target_rows=target_rows,
            )  # fmt: skip
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
    fwd,
    stop_ids,
    tout,
    batch,
    objective,
    starts,
    long_rows,
    usable,
    *,
    settings,
    mode,
    seed,
    step,
    chunk,
    target_rows=None,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """For each rollout in `long_rows` (more usable round starts than
    `objective.max_anchors`): `(rows drawn [m], dense inclusion weights [L-1], detached
    A [L-1, K], detached c [L-1, K])`, where A and c hold the no-grad scores of every row
    the gradient pass will not draft (zeros elsewhere: the gradient pass fills them).
    `target_rows`: the step's `TargetRowTable` (sampling), or None."""
    limit = objective.max_anchors
    rows = [int(starts[i].numel()) for i in long_rows]
    gens = [
        torch.Generator().manual_seed(derived_seed(seed, 13, step, int(batch.rollout_index[i])))
        for i in long_rows
    ]
    drawn: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(long_rows)
    if objective.anchor_sampler == "uniform":  # draw first, score only the other rows
        scored = []
        for j, i in enumerate(long_rows):
            idx, w = sample_round_starts_uniformly(usable[i], limit, gens[j])
            drawn[j] = idx, dense_row_weights(idx, w, rows[j])
            left = torch.ones(usable[i], dtype=torch.bool)
            left[idx] = False
            scored.append(left.nonzero().flatten())
    else:  # occupancy PPS: score every usable row, then draw from the occupancies
        scored = [torch.arange(usable[i]) for i in long_rows]
    if len(long_rows) == batch.input_ids.shape[0]:  # every rollout: no copy of the logits
        sub, sub_out = batch, tout
    else:
        logits = None if tout.logits is None else tout.logits[long_rows]
        sub_out = dataclasses.replace(tout, logits=logits, features=tout.features[long_rows])
        sub = batch.rows(long_rows)
        if target_rows is not None:
            target_rows = target_rows.sequences(long_rows)
    anchors = pad_anchor_lists([starts[i][r] for i, r in zip(long_rows, scored, strict=True)])
    # the gradient sampler's sizes need the proposals' logit-gradient moments: sampling
    # mode gets them from the scoring pass (every usable row is scored), greedy from A
    want_moments = objective.anchor_sampler == "gradient" and mode == "sampling"
    # the head rows the gradient pass multiplies at once: no scoring product holds more
    drafter = fwd.module.drafter if hasattr(fwd, "module") else fwd.drafter
    head_rows = batch.input_ids.shape[0] * limit * (drafter.config.block_size - 1)
    acc, cost, *moments = score_round_starts(
        fwd, stop_ids, sub_out, sub, anchors.to(batch.input_ids.device), settings, mode, chunk,
        moments=want_moments, greedy_beta=objective.greedy_temperature, head_rows=head_rows,
        target_rows=target_rows,
    )  # fmt: skip
    full = []
    for j, r in enumerate(scored):
        at = r.to(acc.device)
        full.append(
            tuple(
                x.new_zeros((rows[j], x.shape[-1])).index_copy(0, at, x[j, : at.numel()])
                for x in (acc, cost)
            )
        )
    if objective.anchor_sampler != "uniform":  # one batched recursion on the host
        padded = acc.new_zeros((2, len(long_rows), max(rows), acc.shape[-1]))
        for j, (a, c) in enumerate(full):
            padded[0, j, : rows[j]], padded[1, j, : rows[j]] = a, c
        padded, lengths = padded.cpu(), torch.tensor([r + 1 for r in rows])
        if objective.anchor_sampler == "gradient":
            state = occupancy_and_value(padded[0], padded[1], lengths)
            if want_moments:  # rows 0 .. usable-1 in order; the dead last row stays 0
                grads = moments[0].new_zeros((*padded.shape[1:], 3))
                for j in range(len(long_rows)):
                    grads[j, : rows[j] - 1] = moments[0][j, : rows[j] - 1]
                grads = grads.cpu()
            else:
                grads = greedy_gradient_moments(padded[0])
            sizes = gradient_sizes(state.occupancy, state.td, grads)
        else:
            sizes = state_occupancy(padded[0], lengths)[..., 0]
        for j in range(len(long_rows)):
            idx, w = sample_round_starts(sizes[j, : rows[j]], limit, gens[j])
            drawn[j] = idx, dense_row_weights(idx, w.double(), rows[j])
    return [(*d, *f) for d, f in zip(drawn, full, strict=True)]


def edr_micro_step(
    fwd: nn.Module,
    drafter: nn.Module,
    features,
    stop_ids,
    objective,
    batch: Batch,
    *,
    seed: int,
    step: int,
    settings,
    mode: str,
    want_acc: bool,
    alpha: float,
    variant: str,
    score_chunk: int | None = None,
) -> MicroOutput:
    """Forward + EDR loss on one micro-batch of whole rollouts (no backward here).

    `score_chunk`: round starts per rollout per pass of the no-grad scoring pass (None:
    `default_score_chunk`)."""
    device = batch.input_ids.device
    sampling = mode == "sampling"
    # greedy EDR needs no target logits (skip the LM head), nor sampling EDR on rollouts
    # whose stored distributions are whole (`stored_topk`)
    with_logits = sampling and stored_topk(batch, settings) is None
    tout = features.features(
        batch,
        with_logits=with_logits,
        logits_to_keep=response_logits_to_keep(batch) if with_logits else 0,
    )
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
    limit = objective.max_anchors
    chosen: list[torch.Tensor] = [torch.arange(u) for u in usable]
    weights: list[torch.Tensor | None] = [None] * len(rows)
    full_acc: dict[int, torch.Tensor] = {}
    full_cost: dict[int, torch.Tensor] = {}
    long_rows = [i for i, u in enumerate(usable) if u > limit]
    chunk = score_chunk
    space = DraftSpace.of(drafter, stop_ids) if sampling else None
    width = int(drafter.config.vocab_size) if space is None else space.width
    if long_rows and chunk is None:
        # greedy, and DDP/FSDP (whose forward returns a pass's whole logits): passes of
        # max_anchors; an unwrapped sampling step caps its head rows (`head_rows`)
        chunk = limit
        if sampling and type(fwd) is DraftForward:
            chunk = default_score_chunk(limit, len(long_rows), width)
    target_rows = None
    block_size = drafter.config.block_size
    if (
        long_rows
        and sampling
        and type(fwd) is DraftForward
        and sum(u + block_size for u in usable) * width <= DEFAULT_CHUNK_ELEMENTS
    ):  # both passes read their rows from one table (no more than one scoring pass holds)
        every = pad_anchor_lists([starts[i][: usable[i]] for i in range(len(rows))]).to(device)
        seq_len = batch.input_ids.shape[1]
        vocab = int(drafter.config.vocab_size)
        target_rows = TargetRowTable.build(
            tout, label_positions(every, block_size - 1, seq_len), seq_len, settings, space,
            default_chunk_rows(vocab), stored_topk(batch, settings), vocab,
        )  # fmt: skip
    if long_rows:
        drawn = _draw_round_starts(
            fwd, stop_ids, tout, batch, objective, starts, long_rows, usable,
            settings=settings, mode=mode, seed=seed, step=step, chunk=chunk,
            target_rows=target_rows,
        )  # fmt: skip
        for i, (idx, w, acc_i, cost_i) in zip(long_rows, drawn, strict=True):
            chosen[i], weights[i], full_acc[i], full_cost[i] = idx, w, acc_i, cost_i
    anchors = pad_anchor_lists([starts[i][chosen[i]] for i in range(len(rows))]).to(device)
    acc, cost, hidden, logq, labels, mask, prev, _ = _acceptance(
        fwd, stop_ids, tout, batch, anchors, settings, mode, with_grad=True, want_logq=want_acc,
        greedy_beta=objective.greedy_temperature, target_rows=target_rows,
    )  # fmt: skip
    acc_list, cost_list, keep = [], [], []
    for i, r in enumerate(rows):
        if r == 0:
            continue  # a 1-token response has no drafting round
        m = int(chosen[i].numel())
        if i in full_acc:
            idx = chosen[i].to(device)
            acc_list.append(full_acc[i].index_copy(0, idx, acc[i, :m]))
            cost_list.append(full_cost[i].index_copy(0, idx, cost[i, :m]))
        else:
            acc_list.append(_with_dead_row(acc[i, :m], r))
            cost_list.append(_with_dead_row(cost[i, :m], r))
        keep.append(weights[i].to(device) if weights[i] is not None else None)
    valid = anchors >= 0
    stats = block_stats(
        drafter,
        hidden,
        prev,
        labels,
        mask,
        None if logq is None else logq.detach(),
        valid,
        want_acc=want_acc,
        alpha=alpha,
        variant=variant,
    )
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


# ---- sampling-mode scores of the proposals (A, TV cost, gradient moments), the LM head
# run in checkpointed row chunks ----


def head_chunked_scores(
    drafter, space, hidden, prev, p_rows, p_index, ids, columns, settings, stops, moments,
    head_rows=None, support=None,
):  # fmt: skip
    """`(A, c, log q(label) or None, moments or None)` of every proposal, with the LM head
    run inside row chunks of `default_chunk_rows` (~64 MB of logits), each chunk taking its
    targets from the distinct rows `p_rows[p_index]` (`sampling_target_rows`, no `[blocks*K,
    V]` copy of them); under autograd each
    chunk is checkpointed (`row_chunks.by_row_chunks`), so its logits are recomputed in
    backward, as `target_logprobs` does for the cross-entropy (rows that fit one chunk
    run as one piece: no recompute where the memory is small). Why: whole, the step held
    the `[blocks*K, V]` logits, the q the fused kernel keeps for backward and their
    gradient, ~1 GB each at the Gemma shape, where `uniform` holds <= 256 MB.
    `columns` (logged steps): the labels' columns, -1 where none, for the detached T = 1
    log q(label) of the statistics; `moments`: the `gradient` sampler's scoring pass;
    `head_rows`: a smaller cap on the rows per chunk (the scoring pass's). A DFlash2
    selector's q lives on its top-k candidates, so its A, c and moments are computed on
    them (`candidate_scores`, docs/methods.md); only its unary logits' term is dense.
    `support [R, k]` (a top-k target: `target_support`): both passes of another drafter,
    and a selector's unary term, read the target's few columns and one exp pass per row
    (`support_scores`)."""
    width = p_rows.shape[-1]
    selector = has_selector(drafter)
    stop_columns = torch.as_tensor(list(stops), dtype=torch.long, device=p_rows.device)

    def rows_fn(h, prv, at, x, col):
        if selector:  # q lives on the top-k candidates: scored as `[rows, k]`
            u = drafter.unary_logits(h)  # one head product for the selector and the unary
            cand, scores = drafter.select(h, prv, u)
            acc, cost, m = candidate_scores(
                scores, cand, p_rows, at, x, temperature=settings.temperature,
                stops=stop_columns, moments=moments,
            )  # fmt: skip
            if moments:
                return acc, cost, m
            if torch.is_grad_enabled():  # the unary logits get the same weights
                u = u if space is None else space.logits(u)
                if support is not None:
                    acc_u, cost_u, _ = support_scores(
                        u, support, p_rows, at, x, temperature=settings.temperature,
                        stops=stop_columns, moments=False,
                    )  # fmt: skip
                else:
                    pp = p_rows.index_select(0, at)
                    acc_u, cost_u = _sampling_scores(u, pp, x, settings, stops)
                acc, cost = with_unary_gradient(acc, acc_u), with_unary_gradient(cost, cost_u)

            def logits():  # the selector's, in the drafter's layout (-inf off the candidates)
                z = scores.new_full((scores.shape[0], width), float("-inf"))
                return z.scatter(-1, cand, scores)
        else:
            z = DraftSpace.drafter_logits(drafter, space, h, prv)
            if support is not None:
                acc, cost, m = support_scores(
                    z, support, p_rows, at, x, temperature=settings.temperature,
                    stops=stop_columns, moments=moments,
                )  # fmt: skip
                if moments:
                    return acc, cost, m
            elif moments:
                return scores_and_moments(z, p_rows, x, settings, stops, at)
            else:
                acc, cost = _sampling_scores(z, p_rows.index_select(0, at), x, settings, stops)

            def logits():
                return z

        if col is None:
            return acc, cost
        with torch.no_grad():  # logged steps: the T = 1 log q(label)
            return acc, cost, token_logprobs(logits(), col)

    flat = [
        hidden.reshape(-1, hidden.shape[-1]),
        prev.reshape(-1),
        p_index.reshape(-1),
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


def _sampling_scores(logits, p, ids, settings, stops):
    """Sampling-mode `(A, c)` of proposals scored with `logits` at the rollout temperature."""
    return acceptance_and_cost(
        logits, p, ids, mode="sampling", temperature=settings.temperature,
        target_is_probs=True, stop_token_ids=stops,
    )  # fmt: skip


def scores_and_moments(logits, p, ids, settings, stop_token_ids, p_index=None):
    """`(A, c, moments [B, A, K, 3])` of every proposal: `acceptance_and_cost`'s sampling
    values (c zeroed at stop tokens and clamped at 1, as it does) and the logit-gradient
    moments of `scores_with_gradient_moments`, in one pass over the vocabulary. `p_index`:
    proposal i's target row is `p[p_index[i]]` (distinct rows), else `p` is laid out."""
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
        target_index=None if p_index is None else p_index.reshape(-1),
    )
    acc, cost = acc.view(ids.shape), cost.view(ids.shape).clamp(max=1.0)
    moments = moments.view(*ids.shape, 3)
    if stops is not None:
        stop = torch.isin(ids, stops)
        cost = torch.where(stop, torch.zeros((), dtype=cost.dtype), cost)
        # c is 0 at a stop label whatever the logits: its gradient moments are 0 there too
        keep = torch.tensor([1.0, 0.0, 0.0], dtype=moments.dtype, device=moments.device)
        moments = torch.where(stop.unsqueeze(-1), moments * keep, moments)
    return acc, cost, moments
