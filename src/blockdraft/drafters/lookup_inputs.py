"""Prompt lookup's proposals as the drafter's block inputs (`drafter.lookup_inputs`).

A DFlash block's K proposal slots carry only MASK, so the drafter must tell from the
target's features alone that the text repeats itself, which prompt lookup finds for free.
With `lookup_inputs` the slots read the looked-up tokens (MASK where lookup has none):
the drafter can copy them where its features agree and override them where not. The
lookup depends only on verified text up to the anchor, so training, offline scoring and
the decoding loop see the same inputs; the rule (`lookup_rule(K)`) is part of the
contract (docs/architecture.md, "drafters").
"""

from __future__ import annotations

import torch

from blockdraft.drafters.ngram import NgramDrafter, NgramTable


def lookup_rule(num_proposals: int) -> NgramDrafter:
    """The lookup a `lookup_inputs` drafter reads (fixed: it is what training saw, so it
    keeps the latest-occurrence rule these drafters were trained with)."""
    return NgramDrafter(num_proposals, match="latest")


def lookup_block_inputs(
    input_ids: torch.Tensor, anchors: torch.Tensor, num_proposals: int
) -> torch.Tensor:
    """`[B, A, K]` long: lookup's proposal for the block at every anchor, -1 where none.

    input_ids `[B, T]` (prompt + response, any right padding is never read), anchors
    `[B, A]` sequence indices of the anchors (-1 = padding). The lookup for an anchor at
    index a uses `input_ids[b, : a + 1]`, the text verified when that round starts."""
    B, A = anchors.shape
    out = torch.full((B, A, num_proposals), -1, dtype=torch.long)
    rule = lookup_rule(num_proposals).config
    ids, anc = input_ids.tolist(), anchors.tolist()
    for b in range(B):
        seq, table = ids[b], NgramTable(rule)
        for j in sorted(range(A), key=lambda i: anc[b][i]):
            a = anc[b][j]
            if a < 0:
                continue
            table.advance(seq, a + 1)
            proposal = table.propose(seq, a + 1)
            if proposal:
                out[b, j, : len(proposal)] = torch.tensor(proposal)
    return out.to(anchors.device)
