"""A DFlash2 drafter fitted for a few dozen steps to a random target's greedy text.

Why: tests that compare decoding loops or offline and online rounds need proposals that
get accepted (a random drafter's never are, so every round would agree trivially). The
loss is DFlash2's own teacher-forced one, written out: cross-entropy of the unary logits
on each block slot's label, plus cross-entropy of the selector's scores over the top-k
candidates where the label is among them (its predecessor being the token before it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from blockdraft.drafters.dflash2 import DFlash2Drafter


def fit_dflash2(
    drafter: DFlash2Drafter,
    target,
    seqs: list[torch.Tensor],
    column: torch.Tensor | None = None,
    steps: int = 40,
    first_anchor: int = 5,
) -> DFlash2Drafter:
    """Adam steps on every block of `seqs` (equal-length prompt + greedy response id
    tensors) from `first_anchor` on; `column` maps target ids to drafter columns (-1:
    outside a reduced draft vocabulary; default: the identity). Returns it in eval mode."""
    block = drafter.config.block_size
    ids = torch.stack(seqs)
    column = torch.arange(target.vocab_size) if column is None else column
    feats = target.forward(ids).features
    anchors = torch.arange(first_anchor, ids.shape[1] - block).expand(ids.shape[0], -1)
    idx = anchors[..., None] + torch.arange(1, block)
    labels = column[torch.stack([ids[b][idx[b]] for b in range(ids.shape[0])])]
    prev = torch.stack([ids[b][idx[b] - 1] for b in range(ids.shape[0])])
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    for _ in range(steps):
        hidden = drafter.forward_blocks(feats, ids, anchors)
        unary = drafter.unary_logits(hidden)
        loss = F.cross_entropy(unary.flatten(0, 2), labels.flatten(), ignore_index=-1)
        cand, scores = drafter.select(hidden, prev, unary)
        inside = (cand == labels[..., None]).any(-1)
        if inside.any():
            col = (cand == labels[..., None]).float().argmax(-1)
            loss = loss + F.cross_entropy(scores[inside], col[inside])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()
