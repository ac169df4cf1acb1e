"""Prompt lookup's proposals as the drafter's block inputs (`drafter.lookup_inputs`).

A DFlash block is `[anchor, MASK, ..., MASK]`: the K proposal slots carry no token, so the
drafter must work out from the target's features alone that the text is repeating itself.
Prompt lookup (drafters/ngram.py) finds that for free, and on looping text (a base model's
GSM8K answers) it beats a trained drafter at the late slots. With `lookup_inputs` the
slots read the looked-up tokens instead of MASK (MASK where lookup has nothing), so the
drafter sees both: it can copy the lookup where the features agree and override it
where they do not, and training teaches which.

Exactness: the lookup depends only on the verified text up to and including the anchor,
never on drafted tokens, so the block's inputs are a function of the round's context and
offline scoring, training and the decoding loop see the same inputs. The default lookup
rule (`NgramDrafter(K)`: n-grams of 1..3 tokens, latest match) is part of the contract.
"""

from __future__ import annotations

import torch

from blockdraft.drafters.ngram import NgramDrafter, NgramTable


def lookup_rule(num_proposals: int) -> NgramDrafter:
    """The lookup a `lookup_inputs` drafter reads (fixed: it is what training saw)."""
    return NgramDrafter(num_proposals)


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
