"""Anchors and block labels against brute-force definitions from docs/architecture.md."""

from __future__ import annotations

import pytest
import torch

from blockdraft.data.anchors import (
    block_labels,
    collate_blocks,
    round_start_anchors,
    sample_anchors,
)


def test_round_starts_are_p_plus_n_minus_1():
    # P=5, L=4: rounds start at n=1..3, anchors x_1..x_3 at indices 5, 6, 7
    assert round_start_anchors(5, 4).tolist() == [5, 6, 7]
    assert round_start_anchors(5, 1).numel() == 0
    assert round_start_anchors(0, 0).numel() == 0
    assert round_start_anchors(0, 3).dtype == torch.long


@pytest.mark.parametrize("num_anchors", [0, 1, 3, 7, 100])
def test_sampled_anchors_valid_unique_sorted(num_anchors):
    g = torch.Generator().manual_seed(1)
    for P, T in [(1, 2), (3, 4), (4, 20), (0, 9), (7, 7), (2, 50)]:
        for block_size in (2, 4, 16):
            a = sample_anchors(P, T, num_anchors, block_size, g)
            L = T - P
            assert a.dtype == torch.long
            assert a.numel() == min(num_anchors, max(L - 1, 0))
            assert len(set(a.tolist())) == a.numel()
            assert a.tolist() == sorted(a.tolist())
            if a.numel():
                assert int(a.min()) >= P and int(a.max()) <= P + L - 2
            # every sampled block has at least one supervised label inside the sequence
            assert all(int(x) + 1 <= T - 1 for x in a)


def test_sampled_anchors_uniform_and_reproducible():
    P, T, n = 3, 13, 4  # 9 candidates, each included with probability 4/9
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(T)
    draws = 3000
    for _ in range(draws):
        counts[sample_anchors(P, T, n, 8, g)] += 1
    freq = counts[P : T - 1] / draws
    assert counts[:P].sum() == 0 and counts[T - 1 :].sum() == 0
    assert torch.allclose(freq, torch.full_like(freq, n / 9), atol=0.04), freq
    a1 = sample_anchors(P, T, n, 8, torch.Generator().manual_seed(5))
    a2 = sample_anchors(P, T, n, 8, torch.Generator().manual_seed(5))
    assert a1.tolist() == a2.tolist()


def test_sample_anchors_rejects_bad_arguments():
    with pytest.raises(ValueError, match="block_size"):
        sample_anchors(2, 10, 3, 1)
    with pytest.raises(ValueError, match="prompt_len"):
        sample_anchors(11, 10, 3, 4)
    with pytest.raises(ValueError, match="num_anchors"):
        sample_anchors(2, 10, -1, 4)


def _brute_labels(seq, anchors, block_size, length):
    labels, mask = [], []
    for a in anchors:
        row_l, row_m = [], []
        for k in range(1, block_size):
            ok = a >= 0 and a + k < length
            row_l.append(seq[a + k] if ok else 0)
            row_m.append(ok)
        labels.append(row_l)
        mask.append(row_m)
    return labels, mask


def test_block_labels_match_sequence():
    seq = torch.arange(100, 112)  # T=12, token at index i is 100+i
    anchors = torch.tensor([4, 7, 10, -1])
    labels, mask = block_labels(seq, anchors, block_size=4)
    exp_l, exp_m = _brute_labels(seq.tolist(), anchors.tolist(), 4, 12)
    assert labels.tolist() == exp_l and mask.tolist() == exp_m
    assert labels[0].tolist() == [105, 106, 107]  # slot k -> index anchor + k
    assert mask[2].tolist() == [True, False, False]  # only index 11 left
    assert not mask[3].any()


def test_collate_pads_and_labels_each_sequence():
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, 50, (n,), generator=g) for n in (9, 4, 15)]
    prompt_lens = [3, 2, 6]
    anchors = [
        sample_anchors(p, s.numel(), 5, 6, g) for p, s in zip(prompt_lens, seqs, strict=True)
    ]
    batch = collate_blocks(seqs, anchors, block_size=6, pad_id=1)
    assert batch.input_ids.shape == (3, 15)
    assert batch.lengths.tolist() == [9, 4, 15]
    assert batch.attention_mask.sum(1).tolist() == [9, 4, 15]
    assert (batch.input_ids[1, 4:] == 1).all()
    for b, (s, a) in enumerate(zip(seqs, anchors, strict=True)):
        A = a.numel()
        assert batch.anchors[b, :A].tolist() == a.tolist()
        assert (batch.anchors[b, A:] == -1).all()
        exp_l, exp_m = _brute_labels(s.tolist(), batch.anchors[b].tolist(), 6, s.numel())
        assert batch.labels[b].tolist() == exp_l
        assert batch.label_mask[b].tolist() == exp_m
    with pytest.raises(ValueError, match="sequence 0"):
        collate_blocks([torch.arange(4)], [torch.tensor([4])], block_size=3)
