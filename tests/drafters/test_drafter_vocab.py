"""Reduced draft vocabulary: selection, d2t layout, logits in target space."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
from blockdraft.drafters.draft_vocab import (
    d2t_offsets,
    draft_ids_from_d2t,
    most_frequent_tokens,
    target_to_draft,
)
from blockdraft.drafters.semi_ar import SemiARDrafter


def test_most_frequent_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 50, (n,), generator=g) for n in (30, 70, 5)]
    seqs.append([7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7])
    counts = Counter(int(t) for s in seqs for t in (s.tolist() if torch.is_tensor(s) else s))
    ranked = sorted(range(60), key=lambda t: (-counts.get(t, 0), t))
    got = most_frequent_tokens(seqs, 12, 60, always_include=[59])
    assert got.tolist() == sorted(ranked[:11] + [59])
    assert 7 in got.tolist()
    assert most_frequent_tokens([[1, 1]], 4, 10).tolist() == [0, 1, 2, 3]  # fills up by id
    with pytest.raises(ValueError, match="outside the target vocab"):
        most_frequent_tokens([[10]], 2, 10)


def test_d2t_is_vllm_offset_layout():
    ids = torch.tensor([2, 5, 6, 40])
    d2t = d2t_offsets(ids)
    assert d2t.tolist() == [2, 4, 4, 37]  # vLLM: target = arange(N) + d2t
    assert torch.equal(draft_ids_from_d2t(d2t), ids)
    table = target_to_draft(ids, 50)
    assert table[40] == 3 and table[3] == -1 and (table >= 0).sum() == 4


@pytest.mark.parametrize("arch", ["dflash", "semi_ar"])
def test_reduced_vocab_logits_are_the_full_ones_restricted(random_target, arch):
    t = random_target
    draft_ids = torch.tensor(
        sorted(set(torch.randint(0, t.vocab_size, (40,)).tolist()) | {t.mask_token_id})
    )
    full_cfg = DrafterConfig.for_target(t, block_size=4, arch=arch, markov_rank=4)
    red_cfg = DrafterConfig.from_dict({**full_cfg.to_dict(), "draft_vocab_size": len(draft_ids)})
    cls = SemiARDrafter if arch == "semi_ar" else BlockDrafter
    full, red = cls(full_cfg).bind_target(t), cls(red_cfg).bind_target(t)
    state = {k: v for k, v in full.state_dict().items() if not k.startswith("markov_head.w2")}
    red.load_state_dict(state, strict=False)
    red.set_draft_vocab(draft_ids)
    if arch == "semi_ar":
        with torch.no_grad():
            full.markov_head.w2.normal_()
            red.markov_head.w2.copy_(full.markov_head.w2[:, draft_ids])
    assert torch.equal(red.draft_ids, draft_ids)
    assert torch.equal(red.head_weight, t.lm_head.weight[draft_ids])
    hidden = torch.randn(2, 3, t.hidden_size)
    prev = torch.randint(0, t.vocab_size, (2, 3))
    lf, lr = full.compute_logits(hidden, prev), red.compute_logits(hidden, prev)
    assert lr.shape == lf.shape
    torch.testing.assert_close(lr[..., draft_ids], lf[..., draft_ids])
    outside = torch.ones(t.vocab_size, dtype=torch.bool)
    outside[draft_ids] = False
    assert torch.isinf(lr[..., outside]).all() and (lr[..., outside] < 0).all()
    q = torch.softmax(lr, -1)
    assert q[..., outside].sum() == 0


def test_head_rows_follow_the_vocabulary_and_the_head(random_target):
    """`head_weight` keeps its gathered rows between calls (a slot-by-slot drafter asks every
    round), yet never serves stale ones: a new draft vocabulary or an in-place change of
    the target's head gives the new rows, and a trainable head still gets gradients."""
    t = random_target
    cfg = DrafterConfig.for_target(t, block_size=4)
    d = BlockDrafter(DrafterConfig.from_dict({**cfg.to_dict(), "draft_vocab_size": 6})).bind_target(
        t
    )
    head = t.lm_head.weight

    def vocab(offset: int) -> torch.Tensor:  # 5 ids apart from the mask token, and the mask
        ids = [i for i in range(offset, 60, 4) if i != t.mask_token_id][:5]
        return torch.tensor(sorted(ids + [t.mask_token_id]))

    d.set_draft_vocab(vocab(0))
    with torch.inference_mode():  # first asked for in a scoring pass, then by training
        first = d.head_weight
    hidden = torch.randn(3, head.shape[1], requires_grad=True)
    (hidden @ d.head_weight.T).sum().backward()  # saved for backward: not an inference tensor
    assert torch.equal(hidden.grad, d.head_weight.sum(0).expand(3, -1))
    assert d.head_weight is first  # kept
    assert torch.equal(first, head[d.draft_ids])
    d.set_draft_vocab(vocab(1))
    assert torch.equal(d.head_weight, head[d.draft_ids])
    with torch.no_grad():
        head.mul_(2.0)
    try:
        assert torch.equal(d.head_weight, head[d.draft_ids])
        head.requires_grad_(True)
        d.head_weight.sum().backward()
        assert head.grad is not None and head.grad[d.draft_ids].eq(1).all()
        assert head.grad.sum() == d.head_weight.numel()
    finally:
        head.requires_grad_(False)
        head.grad = None
        with torch.no_grad():
            head.div_(2.0)
