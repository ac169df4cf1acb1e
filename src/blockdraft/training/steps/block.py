"""One micro-batch through target, drafter and objective: loss numerator, denominator, stats.

Why the split: every objective is a ratio whose denominator is a detached count or weight
sum over the batch (CE weights, blocks for E2E, emitted tokens for EDR). Each micro-batch
back-propagates its *un-normalised* numerator and the loop divides the summed gradient by
the all-reduced global denominator, so N processes x M accumulation steps give exactly
the gradient of one process on the whole batch (averaging per-micro-batch losses would
weight micro-batches equally instead). Block objectives train on `num_anchors` sampled
anchors per sequence; the rounds objective (EDR) lives in `rounds.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from blockdraft.data.anchors import block_labels, sample_anchors
from blockdraft.objectives.cross_entropy import default_chunk_rows
from blockdraft.objectives.dpace import dpace_weights
from blockdraft.objectives.e2e import overlap_with_logits
from blockdraft.training.batching import Batch, anchor_generator
from blockdraft.training.draft_forward import (
    has_selector,
    map_to_draft_vocab,
    slot_argmax,
    soft_target_logq,
    with_unary_gradient,
)
from blockdraft.training.draft_space import DraftSpace, sampling_targets
from blockdraft.training.target_distributions import stored_topk


@dataclass
class StepStats:
    """Sums over a micro-batch (reduced across micro-batches and ranks before logging)."""

    k: int
    acc_correct: torch.Tensor = None  # [K]
    acc_count: torch.Tensor = None  # [K]
    profile_sum: torch.Tensor = None  # [K] normalised D-PACE weight profile summed over blocks
    profile_blocks: torch.Tensor = None  # [] blocks in profile_sum
    extra: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        z = torch.zeros(self.k, dtype=torch.float64)
        self.acc_correct = z.clone() if self.acc_correct is None else self.acc_correct
        self.acc_count = z.clone() if self.acc_count is None else self.acc_count
        self.profile_sum = z.clone() if self.profile_sum is None else self.profile_sum
        self.profile_blocks = (
            torch.zeros((), dtype=torch.float64)
            if self.profile_blocks is None
            else self.profile_blocks
        )

    def add(self, other: StepStats) -> None:
        self.acc_correct += other.acc_correct
        self.acc_count += other.acc_count
        self.profile_sum += other.profile_sum
        self.profile_blocks += other.profile_blocks

    def packed(self) -> torch.Tensor:
        """All sums as one float64 vector (one all-reduce)."""
        return torch.cat(
            [self.acc_correct, self.acc_count, self.profile_sum, self.profile_blocks.view(1)]
        )

    @classmethod
    def unpack(cls, vec: torch.Tensor, k: int) -> StepStats:
        vec = vec.cpu()
        return cls(
            k,
            vec[:k].clone(),
            vec[k : 2 * k].clone(),
            vec[2 * k : 3 * k].clone(),
            vec[3 * k].clone(),
        )


@dataclass
class MicroOutput:
    numerator: torch.Tensor  # differentiable: local loss * denominator
    denominator: torch.Tensor  # detached float64 scalar
    stats: StepStats
    tokens: int


def pad_anchor_lists(lists: list[torch.Tensor]) -> torch.Tensor:
    width = max([int(a.numel()) for a in lists] + [1])
    out = torch.full((len(lists), width), -1, dtype=torch.long)
    for i, a in enumerate(lists):
        out[i, : a.numel()] = a
    return out


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


def labels_and_prev(
    batch: Batch, anchors: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(labels [B,A,K] with -1 where unsupervised, mask, prev tokens [B,A,K])."""
    lengths = batch.attention_mask.sum(1)
    labels, mask = block_labels(batch.input_ids, anchors, block_size, lengths)
    labels = torch.where(mask, labels, torch.full_like(labels, -1))
    anchor_tok = batch.input_ids.gather(1, anchors.clamp_min(0))
    prev = torch.cat([anchor_tok.unsqueeze(-1), labels[..., :-1].clamp_min(0)], dim=-1)
    return labels, mask, prev


def response_logits_to_keep(batch: Batch) -> int:
    """How many trailing positions' target logits the sampling objectives read: labels
    start after the shortest prompt (the first anchor is the first response token), so
    the LM head (262k columns for Gemma) skips the prompts' other positions."""
    seq_len = batch.input_ids.shape[1]
    return max(1, seq_len - max(0, int(batch.prompt_lens.min()) - 1))


def label_positions(anchors: torch.Tensor, k: int, seq_len: int) -> torch.Tensor:
    return (anchors.unsqueeze(-1) + torch.arange(1, k + 1, device=anchors.device)).clamp(
        0, seq_len - 1
    )


def block_stats(
    drafter: nn.Module,
    hidden: torch.Tensor,
    prev: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
    logq: torch.Tensor | None,
    valid: torch.Tensor,
    *,
    want_acc: bool,
    alpha: float,
    variant: str,
) -> StepStats:
    """Per-slot accuracy (argmax == label) and the mean normalised D-PACE weight profile
    (none without `logq`: the EDR step skips it on steps that are not logged).

    The profile is taken over blocks whose K slots are all supervised (a truncated block
    would pile its weight on early slots for a reason unrelated to the drafter) and uses
    the D-PACE variant/alpha configured, whatever objective is trained: for non-D-PACE
    runs it shows where D-PACE *would* put the weight.
    """
    k = labels.shape[-1]
    stats = StepStats(k)
    with torch.no_grad():
        if want_acc:
            am = slot_argmax(drafter, hidden, prev)
            correct = (am == labels) & mask
            stats.acc_correct = correct.sum(dim=(0, 1)).double().cpu()
            stats.acc_count = mask.sum(dim=(0, 1)).double().cpu()
        full = mask.all(-1) & valid
        if logq is not None and full.any():
            w = dpace_weights(logq[full].exp(), alpha=alpha, variant=variant)
            w = w / w.sum(-1, keepdim=True).clamp_min(1e-30)
            stats.profile_sum = w.sum(0).double().cpu()
            stats.profile_blocks = torch.tensor(float(full.sum()), dtype=torch.float64)
    return stats


def block_micro_step(
    fwd: nn.Module,
    drafter: nn.Module,
    features,
    objective,
    batch: Batch,
    *,
    num_anchors: int,
    seed: int,
    step: int,
    settings,
    want_acc: bool,
    alpha: float,
    variant: str,
) -> MicroOutput:
    """Forward + objective for a block objective on one micro-batch (no backward here)."""
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
    tout = features.features(
        batch,
        with_logits=with_logits,
        logits_to_keep=response_logits_to_keep(batch) if with_logits else 0,
    )
    anchors = sampled_anchors(batch, num_anchors, block_size, seed, step).to(device)
    labels, mask, prev = labels_and_prev(batch, anchors, block_size)
    # greedy E2E: the overlap q(x) at the drafter temperature beta (greedy EDR's relaxation)
    beta = objective.params.get("greedy_temperature", 0.5) if greedy_overlap else 1.0
    selector = has_selector(drafter)
    out = fwd(
        tout.features, batch.input_ids, anchors, labels, prev, need_full, beta, unary=selector
    )
    hidden, logq, logits = out[:3]
    # DFlash2: the objective scores the selector; the unary logits get its weights
    unary_logits, unary_logq = out[3] if selector else (None, None)
    _, in_vocab = map_to_draft_vocab(drafter, labels)
    train_mask = mask & in_vocab
    valid = anchors >= 0
    kwargs = {}
    if greedy_overlap:
        overlap = torch.where(in_vocab, logq.exp(), torch.zeros_like(logq))
        if selector:
            overlap = with_unary_gradient(overlap, unary_logq.exp())
        kwargs = {"overlap": overlap[valid]}
    if need_full:
        positions = label_positions(anchors, k, batch.input_ids.shape[1])
        # q at the rollout temperature: the distribution the decoder draws proposals from.
        # The overlap is computed over row chunks on the full tensors and only then
        # indexed: `logits[valid] / temp` would copy the [.., K, V] logits twice.
        temp = settings.temperature if settings.temperature > 0 else 1.0
        # (in the drafter's vocabulary + 2 columns if it has one: draft_space.py)
        vocab = int(drafter.config.vocab_size)
        p = sampling_targets(
            tout, positions, settings, DraftSpace.of(drafter),
            default_chunk_rows(vocab), stored, vocab,
        )  # fmt: skip
        chunk = getattr(objective, "params", {}).get("chunk_rows")
        overlap = overlap_with_logits(p, logits, chunk, temperature=temp)
        if selector:
            unary_overlap = overlap_with_logits(p, unary_logits, chunk, temperature=temp)
            overlap = with_unary_gradient(overlap, unary_overlap)
        kwargs = {"overlap": overlap[valid]}
        del p
    train_logq = logq
    if selector and not objective.needs_target_distribution:  # weighted cross-entropy
        train_logq = with_unary_gradient(logq, unary_logq)
    if objective.params.get("soft_weight", 0.0) > 0:
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
    return MicroOutput(
        out.loss * denom, torch.tensor(denom, dtype=torch.float64), stats, batch.num_tokens
    )
