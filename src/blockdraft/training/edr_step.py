"""One EDR micro-batch: every round start of every rollout, as the paper trains it.

EDR's loss couples rounds (the occupancy of a round start depends on every earlier
round), so unlike the block objectives it cannot train on a random handful of anchors:
each rollout's acceptance `A [L-1, K]` and cost `c [L-1, K]` must cover all round starts.
When a rollout has more than `objective.max_anchors` round starts, a no-grad drafter pass
over all of them gives the occupancies, `sample_round_starts` draws at most
`max_anchors` rows proportionally to round-start occupancy, and only those rows are
recomputed with gradient; the other rows enter the recursions detached with weight 0,
and the sampled rows carry inverse-inclusion weights, so loss and gradient stay unbiased.

Acceptance follows the rollouts: sampling rollouts use lossless speculative sampling
(`A = min(1, q(x)/p(x))`, TV-form cost, p = the rollout's processed sampling
distribution from the same target forward that gave the features, q = softmax(logits / T)
as the decoder samples proposals at the rollout temperature T); greedy rollouts use the
smooth "greedy EDR" relaxation `A = q(x)`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from blockdraft.data.anchors import round_start_anchors
from blockdraft.objectives.edr import (
    acceptance_and_cost,
    dense_row_weights,
    greedy_soft_from_logprobs,
    occupancy_and_value,
    sample_round_starts,
)
from blockdraft.training.batching import Batch, derived_seed
from blockdraft.training.draft_forward import map_to_draft_vocab
from blockdraft.training.objective_step import (
    MicroOutput,
    block_stats,
    label_positions,
    labels_and_prev,
    pad_anchor_lists,
    target_probs_for,
)


def _acceptance(fwd, target, tout, batch, anchors, settings, mode, with_grad: bool):
    """(A, c, hidden, logq, labels, mask, prev) for the given anchors `[B, A]`."""
    drafter = fwd.module.drafter if hasattr(fwd, "module") else fwd.drafter
    block_size = drafter.config.block_size
    labels, mask, prev = labels_and_prev(batch, anchors, block_size)
    ctx = torch.enable_grad() if with_grad else torch.no_grad()
    with ctx:
        sampling = mode == "sampling"
        hidden, logq, logits = fwd(tout.features, batch.input_ids, anchors, labels, prev, sampling)
        ids = labels.clamp_min(0)
        if sampling:
            positions = label_positions(anchors, block_size - 1, batch.input_ids.shape[1])
            p = target_probs_for(tout.logits, positions, settings)
            acc, cost = acceptance_and_cost(
                logits,
                p,
                ids,
                mode="sampling",
                temperature=settings.temperature,
                target_is_probs=True,
                stop_token_ids=target.stop_token_ids,
            )
        else:  # greedy EDR needs only q(x): no [.., K, V] logits (262k vocab = gigabytes)
            _, in_vocab = map_to_draft_vocab(drafter, labels)
            logq_x = torch.where(in_vocab, logq, torch.full_like(logq, -math.inf))
            acc, cost = greedy_soft_from_logprobs(logq_x, ids, target.stop_token_ids)
    return acc, cost, hidden, logq, labels, mask, prev


def edr_micro_step(
    fwd: nn.Module,
    drafter: nn.Module,
    target,
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
) -> MicroOutput:
    """Forward + EDR loss on one micro-batch of whole rollouts (no backward here)."""
    device = batch.input_ids.device
    tout = target.forward(  # greedy EDR needs no target logits: skip the LM head
        batch.input_ids, attention_mask=batch.attention_mask.long(), with_logits=mode == "sampling"
    )
    starts = [
        round_start_anchors(int(p), int(n))
        for p, n in zip(batch.prompt_lens, batch.response_lens, strict=True)
    ]
    rows = [int(s.numel()) for s in starts]
    limit = objective.max_anchors
    full_acc: dict[int, torch.Tensor] = {}
    full_cost: dict[int, torch.Tensor] = {}
    chosen: list[torch.Tensor] = []
    weights: list[torch.Tensor | None] = []
    long_rows = [i for i, r in enumerate(rows) if r > limit]
    if long_rows:  # detached pass over every round start of the long rollouts
        sub = Batch(**{k: v[long_rows] for k, v in batch.__dict__.items()})
        logits = None if tout.logits is None else tout.logits[long_rows]
        sub_out = type(tout)(logits=logits, features=tout.features[long_rows])
        a_all = pad_anchor_lists([starts[i] for i in long_rows]).to(device)
        acc, cost, *_ = _acceptance(
            fwd, target, sub_out, sub, a_all, settings, mode, with_grad=False
        )
        for j, i in enumerate(long_rows):
            full_acc[i], full_cost[i] = acc[j, : rows[i]], cost[j, : rows[i]]
    for i, r in enumerate(rows):
        if i in full_acc:
            occ = occupancy_and_value(full_acc[i], full_cost[i]).round_start
            gen = torch.Generator().manual_seed(
                derived_seed(seed, 13, step, int(batch.rollout_index[i]))
            )
            # float32 round-off can leave occupancies like -1e-9; they are zero
            idx, w = sample_round_starts(occ.clamp_min(0).cpu(), limit, gen)
            chosen.append(idx)
            weights.append(dense_row_weights(idx, w.double(), r))
        else:
            chosen.append(torch.arange(r))
            weights.append(None)
    anchors = pad_anchor_lists([starts[i][chosen[i]] for i in range(len(rows))]).to(device)
    acc, cost, hidden, logq, labels, mask, prev = _acceptance(
        fwd, target, tout, batch, anchors, settings, mode, with_grad=True
    )
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
            acc_list.append(acc[i, :r])
            cost_list.append(cost[i, :r])
        keep.append(weights[i].to(device) if weights[i] is not None else None)
    valid = anchors >= 0
    stats = block_stats(
        drafter,
        hidden,
        prev,
        labels,
        mask,
        logq.detach(),
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
