"""The block objectives' micro-step (uniform, decay, D-PACE cross-entropy; E2E).

Each sequence trains on `num_anchors` anchors drawn uniformly among its response
positions (the DFlash recipe), every block scored on its own. Sampled E2E compares the
drafter with each label's target distribution (`training/draft_space.py`); greedy E2E
needs only q(label) at the relaxation's temperature.
"""

from __future__ import annotations

import torch

from blockdraft.data.anchors import sample_anchors
from blockdraft.objectives.cross_entropy import default_chunk_rows
from blockdraft.objectives.e2e import overlap_with_logits
from blockdraft.training.batching import Batch, anchor_generator
from blockdraft.training.draft_forward import (
    has_selector,
    map_to_draft_vocab,
    soft_target_logq,
    with_unary_gradient,
)
from blockdraft.training.draft_space import DraftSpace, sampling_targets
from blockdraft.training.steps.anchored_blocks import (
    Blocks,
    block_stats,
    label_positions,
    pad_anchor_lists,
    target_output,
)
from blockdraft.training.steps.interface import MicroOutput, StepInputs
from blockdraft.training.target_distributions import stored_topk


def sampled_anchors(
    batch: Batch, num_anchors: int, block_size: int, seed: int, step: int
) -> torch.Tensor:
    """DFlash recipe: up to `num_anchors` round starts per sequence, uniformly at random."""
    lists = []
    for i in range(batch.input_ids.shape[0]):
        p, l_resp = int(batch.prompt_lens[i]), int(batch.response_lens[i])
        gen = anchor_generator(seed, step, int(batch.rollout_index[i]))
        lists.append(sample_anchors(p, p + l_resp, num_anchors, block_size, gen))
    return pad_anchor_lists(lists)


def block_step(inputs: StepInputs, batch: Batch, step: int, want_acc: bool) -> MicroOutput:
    """Forward + objective for a block objective on one micro-batch (no backward here)."""
    drafter, objective, settings = inputs.drafter, inputs.objective, inputs.settings
    block_size = drafter.config.block_size
    k = block_size - 1
    device = batch.input_ids.device
    # Greedy rollouts: the target is one-hot at the label, so E2E's overlap is q(label)
    # and no [B, A, K, V] distributions are needed (gigabytes at a 262k vocabulary).
    greedy_overlap = bool(objective.needs_target_distribution) and settings.greedy
    need_full = bool(objective.needs_target_distribution) and not greedy_overlap
    # the rollouts' stored distributions where they are whole: no target logits then
    stored = stored_topk(batch, settings) if need_full else None
    with_logits = need_full and stored is None
    tout = target_output(inputs, batch, with_logits)
    anchors = sampled_anchors(batch, inputs.num_anchors, block_size, inputs.seed, step)
    blocks = Blocks.of(batch, anchors.to(device), block_size)
    anchors, labels, mask = blocks.anchors, blocks.labels, blocks.mask
    # greedy E2E: the overlap q(x) at the drafter temperature beta (greedy EDR's relaxation)
    beta = objective.params.greedy_temperature if greedy_overlap else 1.0
    selector = has_selector(drafter)
    out = inputs.fwd(
        tout.features, batch.input_ids, anchors, labels, blocks.prev, need_full, beta,
        unary=selector,
    )  # fmt: skip
    hidden, logq, logits = out[:3]
    # DFlash2: the objective scores the selector; the unary logits get its weights
    unary_logits, unary_logq = out[3] if selector else (None, None)
    _, in_vocab = map_to_draft_vocab(drafter, labels)
    train_mask = mask & in_vocab
    valid = blocks.valid
    kwargs = {}
    if greedy_overlap:
        overlap = torch.where(in_vocab, logq.exp(), torch.zeros_like(logq))
        if selector:
            overlap = with_unary_gradient(overlap, unary_logq.exp())
        kwargs = {"overlap": overlap[valid]}
    if need_full:
        positions = label_positions(anchors, k, batch.input_ids.shape[1])
        # q at the rollout temperature, over row chunks of the full tensors and only then
        # indexed (`logits[valid] / temp` would copy the [.., K, V] logits twice)
        temp = settings.temperature if settings.temperature > 0 else 1.0
        vocab = int(drafter.config.vocab_size)
        p = sampling_targets(
            tout, positions, settings, DraftSpace.of(drafter),
            default_chunk_rows(vocab), stored, vocab,
        )  # fmt: skip
        chunk = getattr(objective.params, "chunk_rows", None)
        overlap = overlap_with_logits(p, logits, chunk, temperature=temp)
        if selector:
            unary_overlap = overlap_with_logits(p, unary_logits, chunk, temperature=temp)
            overlap = with_unary_gradient(overlap, unary_overlap)
        kwargs = {"overlap": overlap[valid]}
        del p
    train_logq = logq
    if selector and not objective.needs_target_distribution:  # weighted cross-entropy
        train_logq = with_unary_gradient(logq, unary_logq)
    if getattr(objective.params, "soft_target_weight", 0.0) > 0:
        if batch.topk_ids is None:
            raise ValueError(
                "objective.soft_target_weight: the training rollouts store no top-k "
                "distribution (write them with `blockdraft rollout --store-topk N`)"
            )
        positions = label_positions(anchors, k, batch.input_ids.shape[1])
        rows = torch.arange(positions.shape[0], device=device)[:, None, None]
        soft = soft_target_logq(
            drafter, hidden, batch.topk_ids[rows, positions], batch.topk_logprobs[rows, positions],
            logq,
        )  # fmt: skip
        kwargs["soft_logq"] = soft[valid]
    out = objective.loss(train_logq[valid], train_mask[valid], **kwargs)
    if objective.needs_target_distribution:  # E2E: mean over blocks with a real proposal
        denom = float(train_mask[valid].any(-1).sum())
    else:
        denom = float(out.metrics["weight_sum"])
    stats = block_stats(inputs, hidden, blocks, logq.detach(), want_acc)
    return MicroOutput(
        out.loss * denom, torch.tensor(denom, dtype=torch.float64), stats, batch.num_tokens
    )
