"""A batch as anchored blocks, the layout every micro-step drafts in.

An anchor is a sequence index; its block drafts the K = block_size - 1 tokens after it,
each with the token before it (`prev`, what a Markov head or selector conditions on).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockdraft.data.anchors import block_labels
from blockdraft.objectives.dpace import dpace_weights
from blockdraft.training.batching import Batch
from blockdraft.training.draft_forward import slot_argmax
from blockdraft.training.steps.interface import StepInputs, StepStats


def pad_anchor_lists(lists: list[torch.Tensor]) -> torch.Tensor:
    """Per-sequence anchor lists -> `[B, A]`, -1 where a sequence has fewer."""
    width = max([int(a.numel()) for a in lists] + [1])
    out = torch.full((len(lists), width), -1, dtype=torch.long)
    for i, a in enumerate(lists):
        out[i, : a.numel()] = a
    return out


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


@dataclass
class Blocks:
    """A batch's anchored blocks: `anchors [B, A]` (-1 = padding) and per slot `[B, A, K]`
    the label (-1 where unsupervised), whether it is supervised, and the token before it."""

    anchors: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor
    prev: torch.Tensor

    @classmethod
    def of(cls, batch: Batch, anchors: torch.Tensor, block_size: int) -> Blocks:
        return cls(anchors, *labels_and_prev(batch, anchors, block_size))

    @property
    def valid(self) -> torch.Tensor:
        """`[B, A]`: a real anchor, not padding."""
        return self.anchors >= 0


def response_logits_to_keep(batch: Batch) -> int:
    """Trailing positions whose target logits the sampling objectives read: labels start
    after the shortest prompt, so the LM head skips the prompts' other positions."""
    seq_len = batch.input_ids.shape[1]
    return max(1, seq_len - max(0, int(batch.prompt_lens.min()) - 1))


def target_output(inputs: StepInputs, batch: Batch, with_logits: bool):
    """The target's `TargetOutput` for `batch`; `with_logits`: its logits from the first
    label position on (`response_logits_to_keep`)."""
    keep = response_logits_to_keep(batch) if with_logits else 0
    return inputs.features.features(batch, with_logits=with_logits, logits_to_keep=keep)


def label_positions(anchors: torch.Tensor, k: int, seq_len: int) -> torch.Tensor:
    """`[B, A, K]`: the sequence index of each slot's label."""
    return (anchors.unsqueeze(-1) + torch.arange(1, k + 1, device=anchors.device)).clamp(
        0, seq_len - 1
    )


def block_stats(
    inputs: StepInputs,
    hidden: torch.Tensor,
    blocks: Blocks,
    logq: torch.Tensor | None,
    want_acc: bool,
) -> StepStats:
    """Per-slot accuracy (argmax == label) and the mean normalised D-PACE weight profile
    (none without `logq`), over blocks whose K slots are all supervised (a truncated
    block would pile weight on early slots). Whatever the objective, the profile shows
    where the configured D-PACE would put the weight."""
    labels, mask = blocks.labels, blocks.mask
    stats = StepStats(labels.shape[-1])
    with torch.no_grad():
        if want_acc:
            am = slot_argmax(inputs.drafter, hidden, blocks.prev)
            correct = (am == labels) & mask
            stats.acc_correct = correct.sum(dim=(0, 1)).double().cpu()
            stats.acc_count = mask.sum(dim=(0, 1)).double().cpu()
        full = mask.all(-1) & blocks.valid
        if logq is not None and full.any():
            w = dpace_weights(
                logq[full].exp(), alpha=inputs.profile_alpha, variant=inputs.profile_variant
            )
            w = w / w.sum(-1, keepdim=True).clamp_min(1e-30)
            stats.profile_sum = w.sum(0).double().cpu()
            stats.profile_blocks = torch.tensor(float(full.sum()), dtype=torch.float64)
    return stats
