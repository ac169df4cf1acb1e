"""Sampling E2E/EDR in the drafter's own vocabulary: `[.., D + 2]` instead of `[.., V]`.

Why: a drafter with a reduced vocabulary D has q = 0 outside D, so every vocabulary sum
of the acceptance, the TV cost and E2E's overlap splits into D's columns plus the
target's mass outside D, off and on the stop set. Two extra columns hold those (draft
logit -inf; a label outside D points at one, so A = 0), and the fused kernels run
unchanged on D + 2 columns, equal to target space up to summation order (tested).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from blockdraft.objectives.edr import target_support
from blockdraft.training.target_distributions import stored_rows, target_probs_for

Tensor = torch.Tensor


class DraftSpace:
    """Column layout `[draft vocabulary D; outside D off S; outside D on S]`."""

    def __init__(self, draft_ids: Tensor, vocab_size: int, stop_token_ids: Sequence[int] = ()):
        d = int(draft_ids.numel())
        dev = draft_ids.device
        stops = torch.as_tensor(sorted({int(s) for s in stop_token_ids}), dtype=torch.long)
        stops = stops.to(dev)
        self.draft_ids, self.width = draft_ids, d + 2
        table = torch.full((vocab_size,), d, dtype=torch.long, device=dev)
        table[stops] = d + 1
        table[draft_ids] = torch.arange(d, device=dev)  # a stop inside D keeps its column
        self.table = table  # target id -> column
        outside = torch.ones(vocab_size, dtype=torch.bool, device=dev)
        outside[draft_ids] = False
        on_stop = torch.zeros(vocab_size, dtype=torch.bool, device=dev)
        on_stop[stops] = True
        # [V, 2]: p @ masses = (p(outside D, off S), p(outside D, on S)) in one product
        self.masses = torch.stack([outside & ~on_stop, outside & on_stop], dim=1).float()
        self.stop_columns = sorted(set(table[stops].tolist()))

    @classmethod
    def of(cls, drafter: nn.Module, stop_token_ids: Sequence[int] = ()) -> DraftSpace | None:
        """The drafter's space, or None if it scores the whole target vocabulary."""
        draft_ids = getattr(drafter, "draft_ids", None)
        if draft_ids is None:
            return None
        return cls(draft_ids, int(drafter.config.vocab_size), stop_token_ids)

    @staticmethod
    def drafter_logits(
        drafter: nn.Module, space: DraftSpace | None, hidden: Tensor, prev: Tensor
    ) -> Tensor:
        """The drafter's logits in `space` (target space when None): what the sampling
        objectives compare with the target in."""
        if space is None:
            return drafter.compute_logits(hidden, prev)
        return space.logits(drafter.compute_draft_logits(hidden, prev))

    def logits(self, draft_logits: Tensor) -> Tensor:
        """`[.., D]` draft-vocabulary logits -> `[.., D + 2]` (-inf in the two mass columns)."""
        pad = draft_logits.new_full((*draft_logits.shape[:-1], 2), float("-inf"))
        return torch.cat([draft_logits, pad], dim=-1)

    def labels(self, target_ids: Tensor) -> Tensor:
        """Target ids (>= 0) -> columns."""
        return self.table.to(target_ids.device)[target_ids]

    def probs(self, p: Tensor) -> Tensor:
        """Target-space probabilities `[.., V]` -> `[.., D + 2]` float32 (the masses in
        float32 even under autocast, which would run the product in bf16)."""
        p = p.float()
        inside = p.index_select(-1, self.draft_ids.to(p.device))
        with torch.autocast(p.device.type, enabled=False):
            masses = p @ self.masses.to(p.device)
        return torch.cat([inside, masses], dim=-1)


def sampling_target_rows(
    tout, positions: Tensor, settings, space: DraftSpace | None, chunk_rows: int,
    stored: tuple[Tensor, Tensor] | None = None, vocab_size: int | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """`(rows [N, W], index [B, A, K])`: the distribution each label was drawn from (W = V
    or `space.width`), once per distinct position of each sequence (consecutive blocks
    share K-1 label positions), and each label's row (`rows[index]`). Built
    `chunk_rows` positions at a time from `tout`'s logits (which may start at
    `logits_start`), or from the rollouts' `stored` distributions (V = `vocab_size`)."""
    logits = tout.logits
    b = positions.shape[0]
    if stored is None:
        vocab_size = logits.shape[-1]
    width = vocab_size if space is None else space.width
    # the label at sequence index i: drawn from the logits at i - 1, stored at i
    shift = 0 if stored is not None else tout.logits_start
    flat = positions.reshape(b, -1) - shift  # (padding: clamped to row 0)
    parts, index, offset = [], torch.empty_like(flat), 0
    for i in range(b):
        uniq, inverse = torch.unique(flat[i], return_inverse=True)
        if stored is not None:
            table = None if space is None else space.table
            rows = stored_rows(stored, i, uniq.clamp_min(0), table, width)
        else:
            rows = torch.empty((uniq.numel(), width), dtype=torch.float32, device=logits.device)
            for lo in range(0, uniq.numel(), chunk_rows):
                at = uniq[lo : lo + chunk_rows].view(1, 1, -1)
                part = target_probs_for(logits[i : i + 1], at, settings)[0, 0]
                rows[lo : lo + chunk_rows] = part if space is None else space.probs(part)
        parts.append(rows)
        index[i] = inverse + offset
        offset += uniq.numel()
    return torch.cat(parts), index.view(positions.shape)


def sampling_targets(
    tout, positions: Tensor, settings, space: DraftSpace | None, chunk_rows: int,
    stored: tuple[Tensor, Tensor] | None = None, vocab_size: int | None = None,
) -> Tensor:  # fmt: skip
    """The target distribution each label was drawn from, `[B, A, K, W]` float32: the rows
    of `sampling_target_rows` copied into place."""
    rows, index = sampling_target_rows(
        tout, positions, settings, space, chunk_rows, stored, vocab_size
    )
    return rows[index]


class TargetRowTable:
    """The target rows of every label position one step reads, built once.

    Why: sampling EDR reads them in the scoring pass and again in the gradient pass (a
    subset); built per pass, their top-k and softmax ran twice. `rows [N, W]` as
    `sampling_target_rows` builds them; `lookup [B, L]`: a sequence index's row (row 0
    where no label sits: padding, which the objectives mask)."""

    def __init__(self, rows: Tensor, lookup: Tensor):
        self.rows, self.lookup = rows, lookup
        self._support: dict[int, Tensor | None] = {}

    @classmethod
    def build(
        cls, tout, positions: Tensor, seq_len: int, settings, space: DraftSpace | None,
        chunk_rows: int, stored: tuple[Tensor, Tensor] | None = None,
        vocab_size: int | None = None,
    ) -> TargetRowTable:  # fmt: skip
        """The table of every position in `positions [B, A, K]` (sequence indices)."""
        rows, index = sampling_target_rows(
            tout, positions, settings, space, chunk_rows, stored, vocab_size
        )
        b = positions.shape[0]
        lookup = torch.zeros((b, seq_len), dtype=torch.long, device=index.device)
        lookup.scatter_(1, positions.reshape(b, -1), index.reshape(b, -1))
        return cls(rows, lookup)

    def index(self, positions: Tensor) -> Tensor:
        """Each position's row, `positions [B, ...]` -> the same shape."""
        b = positions.shape[0]
        return self.lookup.gather(1, positions.reshape(b, -1)).view(positions.shape)

    def sequences(self, which: Sequence[int]) -> TargetRowTable:
        """The table of batch rows `which` (the same rows, fewer lookups)."""
        part = TargetRowTable(self.rows, self.lookup[list(which)])
        part._support = self._support  # the same rows: one support for both
        return part

    def support(self, most: int) -> Tensor | None:
        """`target_support(rows, most)`, found once for every pass that reads the rows."""
        if most not in self._support:
            self._support[most] = target_support(self.rows, most)
        return self._support[most]
