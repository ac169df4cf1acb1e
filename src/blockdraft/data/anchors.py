"""Anchors and block labels: which drafting rounds a training sequence is cut into.

With prompt length P and response `x_1..x_L`, `x_1` comes from the prefill, so drafting
rounds start at n = 1..L-1 with anchor index `a = P + n - 1` in `[P, P+L-2]`; the block of
anchor a proposes indices `a+1..a+K`, and slots past the end are unsupervised
(docs/architecture.md, "Conventions"). DFlash trains on a random subset of round starts
per sequence (a fixed budget of blocks per forward pass), which `sample_anchors` draws.
Anchor tensors use -1 as padding throughout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def round_start_anchors(prompt_len: int, response_len: int) -> torch.Tensor:
    """All round-start anchor indices `P + n - 1` for n = 1..L-1 (empty if L < 2)."""
    if prompt_len < 0 or response_len < 0:
        raise ValueError(
            f"prompt_len and response_len must be >= 0, got {prompt_len}, {response_len}"
        )
    return torch.arange(prompt_len, prompt_len + max(response_len - 1, 0), dtype=torch.long)


def sample_anchors(
    prompt_len: int,
    seq_len: int,
    num_anchors: int,
    block_size: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Up to `num_anchors` distinct round-start anchors, uniformly without replacement, sorted.

    Every round start has at least its first label (`a + 1 <= seq_len - 1`), so all of
    `[P, seq_len-2]` qualify whatever the block size; `block_size` is validated and kept
    in the signature because the candidate set is defined by "blocks with a label".
    """
    if block_size < 2:
        raise ValueError(
            f"block_size must be >= 2 (anchor + at least one proposal), got {block_size}"
        )
    if num_anchors < 0:
        raise ValueError(f"num_anchors must be >= 0, got {num_anchors}")
    if not 0 <= prompt_len <= seq_len:
        raise ValueError(f"need 0 <= prompt_len <= seq_len, got {prompt_len}, {seq_len}")
    candidates = round_start_anchors(prompt_len, seq_len - prompt_len)
    if candidates.numel() <= num_anchors:
        return candidates
    pick = torch.randperm(candidates.numel(), generator=generator)[:num_anchors]
    return candidates[pick].sort().values


def block_labels(
    input_ids: torch.Tensor,
    anchors: torch.Tensor,
    block_size: int,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels `[..., A, K]` (token at index anchor + k, k = 1..K) and their validity mask.

    `input_ids` is `[T]` with anchors `[A]`, or `[B,T]` with anchors `[B,A]`. The mask is
    False for padded anchors (-1) and for slots at or past the sequence end (`lengths`
    per row for right-padded batches, else T); masked labels are 0.
    """
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    batched = input_ids.dim() == 2
    if not batched:
        input_ids, anchors = input_ids[None], anchors[None]
    if anchors.dim() != 2 or anchors.shape[0] != input_ids.shape[0]:
        raise ValueError(
            f"anchors shape {tuple(anchors.shape)} does not match "
            f"input_ids shape {tuple(input_ids.shape)}"
        )
    B, T = input_ids.shape
    if lengths is None:
        lengths = torch.full((B,), T, dtype=torch.long, device=input_ids.device)
    lengths = lengths.reshape(B, 1, 1).to(input_ids.device)
    k = torch.arange(1, block_size, device=input_ids.device)
    idx = anchors[..., None] + k  # [B,A,K]
    mask = (anchors[..., None] >= 0) & (idx < lengths)
    gathered = torch.gather(input_ids, 1, idx.clamp(0, T - 1).reshape(B, -1)).reshape(idx.shape)
    labels = torch.where(mask, gathered, torch.zeros_like(gathered))
    return (labels, mask) if batched else (labels[0], mask[0])


@dataclass
class BlockBatch:
    """A right-padded batch for a training/scoring forward over many blocks per sequence."""

    input_ids: torch.Tensor  # [B,T] long, padded with pad_id
    attention_mask: torch.Tensor  # [B,T] long, 1 on real tokens
    lengths: torch.Tensor  # [B] long
    anchors: torch.Tensor  # [B,A] long, -1 padding
    labels: torch.Tensor  # [B,A,K] long, 0 where invalid
    label_mask: torch.Tensor  # [B,A,K] bool


def collate_blocks(
    sequences: Sequence[torch.Tensor],
    anchors: Sequence[torch.Tensor],
    block_size: int,
    pad_id: int = 0,
) -> BlockBatch:
    """Right-pad sequences (pad_id) and anchors (-1) and compute block labels and masks."""
    if len(sequences) != len(anchors) or not sequences:
        raise ValueError(
            f"need one anchor tensor per sequence, got {len(sequences)} and {len(anchors)}"
        )
    B = len(sequences)
    T = max(int(s.numel()) for s in sequences)
    A = max((int(a.numel()) for a in anchors), default=0)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    att = torch.zeros((B, T), dtype=torch.long)
    anc = torch.full((B, A), -1, dtype=torch.long)
    for b, (s, a) in enumerate(zip(sequences, anchors, strict=True)):
        if a.numel() and (int(a.min()) < 0 or int(a.max()) >= s.numel()):
            raise ValueError(f"sequence {b}: anchors must lie in [0, {s.numel() - 1}]")
        ids[b, : s.numel()] = s
        att[b, : s.numel()] = 1
        anc[b, : a.numel()] = a
    lengths = att.sum(1)
    labels, mask = block_labels(ids, anc, block_size, lengths)
    return BlockBatch(ids, att, lengths, anc, labels, mask)
