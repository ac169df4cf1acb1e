"""The lookup-aware proposer's parts, without vLLM: per-request lookups grown step by step,
the verified text read from vLLM's batch before bookkeeping, hybrid's merge and trim's
cut, each against blockdraft's own implementation."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
from blockdraft.drafters.hybrid import HybridDrafter
from blockdraft.drafters.ngram import NgramDrafter
from blockdraft.drafters.trimmed import TrimmedDrafter
from blockdraft.engines.vllm_lookup import (
    RequestLookups,
    draft_argmax_in_target_ids,
    merge_hybrid,
    trim_drafts,
    trimmed_lengths,
    verified_texts,
)


@pytest.mark.parametrize("match", ["first", "latest"])
def test_request_lookups_equal_a_fresh_lookup_at_every_step(match):
    rule = NgramDrafter(5, match=match)
    gen = torch.Generator().manual_seed(0)
    texts = {r: torch.randint(0, 6, (4,), generator=gen).tolist() for r in ("a", "b")}
    lookups = RequestLookups(rule.config)
    proposed = 0
    for step in range(30):
        for r in texts:  # a round accepts 1..3 tokens
            texts[r] += torch.randint(0, 6, (1 + step % 3,), generator=gen).tolist()
        ids = list(texts) if step % 7 else ["b"]  # "a" leaves the batch now and then
        got = lookups.propose(ids, [texts[r] for r in ids])
        assert got == [rule.propose(texts[r]) for r in ids]
        proposed += sum(bool(g) for g in got)
    assert proposed > 20  # the lookups found matches: not vacuous


def test_verified_texts_append_only_the_valid_sampled_tokens():
    tokens = np.zeros((3, 16), dtype=np.int32)
    tokens[0, :4], tokens[1, :3], tokens[2, :5] = [5, 6, 7, 8], [1, 2, 3], [9, 9, 9, 9, 4]
    batch = SimpleNamespace(
        num_reqs=3, vocab_size=50, token_ids_cpu=tokens, num_tokens_no_spec=np.array([4, 3, 5])
    )
    sampled = torch.tensor([[11, 12, -1, -1], [13, -1, -1, -1], [99, 98, -1, -1]])
    texts = verified_texts(batch, sampled, discarded=np.array([False, False, True]))
    # request 2 is a partial prefill: it sampled nothing, its last token is the anchor
    assert texts == [[5, 6, 7, 8, 11, 12], [1, 2, 3, 13], [9, 9, 9, 9, 4]]
    # after bookkeeping (a list of lists) the stored tokens are the text
    assert verified_texts(batch, [[11], [13], []])[1] == [1, 2, 3]


def test_merge_hybrid_equals_hybrid_drafters_choice(random_target):
    K = 5
    config = DrafterConfig.for_target(random_target, num_layers=1, block_size=K + 1)
    drafter = BlockDrafter(config).bind_target(random_target).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            p.mul_(8.0)  # a spread of confidences around the threshold
    hybrid = HybridDrafter(drafter, NgramDrafter(K), min_confidence=0.2)
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, K, config.hidden_size, generator=gen) * 3
    looked_up = [[7, 8, 9, 10, 11], [3, 4], []]
    with torch.no_grad():
        logits = drafter.compute_draft_logits(hidden)  # [3, K, V]
        expected = torch.stack(
            [hybrid.block_from_hidden(hidden[b], looked_up[b], 0.0)[0] for b in range(3)]
        )
    tokens = logits.argmax(-1).reshape(-1)
    merged, _ = merge_hybrid(tokens, logits.reshape(3 * K, -1), looked_up, 0.2)
    assert merged.view(3, K).tolist() == expected.tolist()
    took = merged.view(3, K) != tokens.view(3, K)
    assert took.any() and not took.all()  # both branches of the choice are exercised
    # sampled rows of the slots that take lookup become one-hot on the looked-up token
    probs = torch.softmax(logits.reshape(3 * K, -1), -1)
    _, merged_probs = merge_hybrid(tokens, logits.reshape(3 * K, -1), looked_up, 0.2, probs)
    rows = took.reshape(-1)
    assert torch.equal(merged_probs[rows].argmax(-1), merged[rows])
    assert torch.equal(merged_probs[rows].sum(-1), torch.ones(int(rows.sum())))
    assert torch.equal(merged_probs[~rows], probs[~rows])


def test_trim_cuts_each_request_where_the_trimmed_drafter_does():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6 * 4, 50, generator=gen) * torch.linspace(0.5, 6, 24)[:, None]
    trimmed = TrimmedDrafter(SimpleNamespace(config=None, num_proposals=4), 0.3)
    lengths = trimmed_lengths(logits, 6, 0.3)
    assert lengths == trimmed.kept(logits.view(6, 4, 50)).sum(-1).tolist()
    assert 0 < sum(lengths) < 24  # some cut, some kept
    drafts = torch.arange(24).view(6, 4)
    assert trim_drafts(drafts, lengths) == [
        list(range(4 * i, 4 * i + n)) for i, n in enumerate(lengths)
    ]
    with pytest.raises(RuntimeError, match="drafted for 6 requests"):
        trim_drafts(drafts, lengths[:5])


def test_draft_argmax_maps_to_the_target_id_vllms_spread_logits_pick():
    # vLLM's compute_logits writes draft id i at target id i + d2t[i], -inf elsewhere
    gen = torch.Generator().manual_seed(2)
    target_vocab, draft_vocab = 40, 12
    targets = torch.randperm(target_vocab, generator=gen)[:draft_vocab].sort().values
    d2t = targets - torch.arange(draft_vocab)
    logits = torch.randn(9, draft_vocab, generator=gen)
    spread = torch.full((9, target_vocab), float("-inf"))
    spread[:, targets] = logits
    got = draft_argmax_in_target_ids(logits, d2t)
    assert torch.equal(got, spread.argmax(-1))
    assert not torch.equal(got, logits.argmax(-1))  # the mapping moved some ids
    assert torch.equal(draft_argmax_in_target_ids(logits, None), logits.argmax(-1))
