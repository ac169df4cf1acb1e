"""DFlash2: convolutions, selector, sliding/causal layers; training forward == inference."""

from __future__ import annotations

import pytest
import torch

from blockdraft.decoding.proposers import GreedyDraftHead, draft_block
from blockdraft.drafters.block_attention import BlockAttention, block_attention_mask
from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
from blockdraft.drafters.dflash2 import DFlash2Drafter, grouped_dynamic_conv
from random_targets import make_random_target

BLOCK = 5  # K = 4


@pytest.fixture(scope="module")
def target():
    return make_random_target("qwen3", num_layers=6)


def randomize(drafter: DFlash2Drafter, seed: int = 0) -> DFlash2Drafter:
    """Non-trivial convolutions and selector (fresh ones are the identity / no-op)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in drafter.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.copy_(torch.randn(conv.base_kernel.shape, generator=g) * 0.7)
                w = conv.kernel_projection.weight
                w.copy_(torch.randn(w.shape, generator=g) * 0.3)
        w = drafter.candidate_selector.hidden_projection.weight
        w.copy_(torch.randn(w.shape, generator=g) * 0.5)
    return drafter


def make_dflash2(target, layer_types=None, window=None, is_causal=None, top_k=6, layers=2):
    cfg = DrafterConfig.for_target(
        target, num_layers=layers, block_size=BLOCK, arch="dflash2",
        selector_rank=8, selector_top_k=top_k, conv_group_size=16,
    )  # fmt: skip
    cfg = DrafterConfig.from_dict(
        {**cfg.to_dict(), "layer_types": layer_types, "sliding_window": window,
         "is_causal": is_causal}
    )  # fmt: skip
    torch.manual_seed(1)
    return randomize(DFlash2Drafter(cfg).bind_target(target)).eval()


def _batch(target, B=2, T=14):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, target.vocab_size, (B, T), generator=g)
    return ids, target.forward(ids).features


def test_conv_equals_a_direct_sum():
    g = torch.Generator().manual_seed(0)
    b, blocks, kb, h, taps, groups = 2, 3, 4, 8, 3, 2
    x = torch.randn(b, blocks * kb, h, generator=g, requires_grad=True)
    dyn = torch.randn(b, blocks * kb, taps, groups, generator=g, requires_grad=True)
    base = torch.randn(taps, h, generator=g, requires_grad=True)
    out = grouped_dynamic_conv(x, dyn, base, kb)
    ref = torch.zeros_like(x)
    for i in range(b):
        for t in range(blocks * kb):
            for o in range(taps):
                if t % kb - o < 0:  # before the block's first row
                    continue
                for ch in range(h):
                    coef = base[o, ch] + dyn[i, t, o, ch // (h // groups)]
                    ref[i, t, ch] += coef * x[i, t - o, ch]
    torch.testing.assert_close(out, ref)
    w = torch.randn(out.shape, generator=g)  # and the gradients of every input
    grads = torch.autograd.grad((out * w).sum(), (x, dyn, base))
    for got, want in zip(grads, torch.autograd.grad((ref * w).sum(), (x, dyn, base)), strict=True):
        torch.testing.assert_close(got, want)


def test_fresh_dflash2_backbone_is_dflash(target):
    cfg = DrafterConfig.for_target(target, num_layers=2, block_size=BLOCK, arch="dflash2",
                                   selector_rank=8, selector_top_k=6)  # fmt: skip
    torch.manual_seed(0)
    d2 = DFlash2Drafter(cfg).bind_target(target).eval()
    base_cfg = {**cfg.to_dict(), "arch": "dflash", "conv_kernel_size": 0, "selector_rank": 0,
                "selector_top_k": 0}  # fmt: skip
    d1 = BlockDrafter(DrafterConfig.from_dict(base_cfg)).bind_target(target).eval()
    result = d1.load_state_dict(d2.state_dict(), strict=False)
    assert all("conv" in k or "candidate_selector" in k for k in result.unexpected_keys)
    ids, feats = _batch(target)
    anchors = torch.tensor([[0, 5, 9], [13, 1, 7]])
    with torch.no_grad():
        h2, h1 = d2.forward_blocks(feats, ids, anchors), d1.forward_blocks(feats, ids, anchors)
        torch.testing.assert_close(h2, h1)
        # a fresh selector keeps the unary argmax
        prev = ids[:, :3, None].expand(2, 3, BLOCK - 1)
        assert torch.equal(d2.compute_logits(h2, prev).argmax(-1), d1.compute_logits(h1).argmax(-1))


LAYER_KINDS = [
    dict(),
    dict(layer_types=["sliding_attention", "full_attention"], window=3),
    dict(layer_types=["sliding_attention"] * 2, window=4, is_causal=False),
    dict(is_causal=True),
]


@pytest.mark.parametrize("kind", LAYER_KINDS, ids=["full", "sliding-causal", "sliding", "causal"])
def test_training_forward_equals_per_block_inference(target, kind):
    drafter = make_dflash2(target, **kind)
    ids, feats = _batch(target)
    anchors = torch.tensor([[0, 5, 9, 2, -1], [13, 1, 7, 7, 4]])
    K = BLOCK - 1
    idx = (anchors.clamp(min=0)[..., None] + torch.arange(K)).clamp(max=ids.shape[1] - 1)
    prev = torch.stack([ids[b][idx[b]] for b in range(2)])
    for attention in ("dense", "tiled"):
        with torch.no_grad():
            hidden = drafter.forward_blocks(feats, ids, anchors, attention=attention)
            logits = drafter.compute_logits(hidden, prev)
        for b in range(2):
            for j in range(5):
                a = int(anchors[b, j])
                if a < 0:
                    continue
                state = drafter.new_state()
                drafter.extend_context(state, feats[b : b + 1, :a], 0)
                one = drafter.draft_hidden(state, int(ids[b, a]), a)
                torch.testing.assert_close(hidden[b, j], one, rtol=1e-5, atol=2e-5)
                ref = drafter.compute_logits(one, prev[b, j])
                assert torch.equal(logits[b, j].isfinite(), ref.isfinite())
                torch.testing.assert_close(logits[b, j][ref.isfinite()], ref[ref.isfinite()],
                                           rtol=1e-4, atol=1e-4)  # fmt: skip


def test_selector_scores_by_hand(target):
    drafter = make_dflash2(target)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, BLOCK - 1, target.hidden_size, generator=g)
    prev = torch.randint(0, target.vocab_size, (3, BLOCK - 1), generator=g)
    with torch.no_grad():
        logits = drafter.compute_logits(hidden, prev)
        unary = hidden @ target.lm_head.weight.T
        sel = drafter.candidate_selector
        for i in range(3):
            for k in range(BLOCK - 1):
                cand = unary[i, k].topk(6).indices
                finite = logits[i, k].isfinite().nonzero().flatten()
                assert set(finite.tolist()) == set(cand.tolist())
                w = sel.hidden_projection.weight @ hidden[i, k]
                for c in cand.tolist():
                    want = (
                        unary[i, k, c]
                        + (
                            sel.predecessor_codebook[prev[i, k]] * w * sel.successor_codebook[c]
                        ).sum()
                    )
                    torch.testing.assert_close(logits[i, k, c], want, rtol=1e-5, atol=1e-5)


def test_reduced_vocabulary_selector_by_hand(target):
    """Draft vocabulary D: candidates are the top-k of D's unary logits, the predecessor
    row is the draft id of the previous token or row D outside D, the rest is -inf."""
    base = make_dflash2(target).config.to_dict()
    drafter = DFlash2Drafter(DrafterConfig.from_dict({**base, "draft_vocab_size": 40}))
    drafter = randomize(drafter.bind_target(target)).eval()
    ids = torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(2))[:40]
    drafter.set_draft_vocab(ids.sort().values)
    sel = drafter.candidate_selector
    assert sel.predecessor_codebook.shape[0] == 41 and sel.successor_codebook.shape[0] == 40
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(3, BLOCK - 1, target.hidden_size, generator=g)
    prev = torch.randint(0, target.vocab_size, (3, BLOCK - 1), generator=g)
    prev[0, 0] = int(drafter.draft_ids[7])  # one predecessor surely inside D
    draft_ids = drafter.draft_ids.tolist()
    with torch.no_grad():
        logits = drafter.compute_logits(hidden, prev)
        unary = hidden @ target.lm_head.weight[drafter.draft_ids].T  # [.., 40]
        for i in range(3):
            for k in range(BLOCK - 1):
                cand = unary[i, k].topk(6).indices
                finite = logits[i, k].isfinite().nonzero().flatten()
                assert set(finite.tolist()) == {draft_ids[c] for c in cand.tolist()}
                p = int(prev[i, k])
                row = draft_ids.index(p) if p in draft_ids else 40
                w = sel.hidden_projection.weight @ hidden[i, k]
                for c in cand.tolist():
                    pair = (sel.predecessor_codebook[row] * w * sel.successor_codebook[c]).sum()
                    torch.testing.assert_close(
                        logits[i, k, draft_ids[c]], unary[i, k, c] + pair, rtol=1e-5, atol=1e-5
                    )
    assert (~torch.isin(prev, drafter.draft_ids)).any()  # the shared row is exercised


def test_sliding_and_causal_masks_by_rule():
    anchors = torch.tensor([[3, 0, -1, 5]])
    T, Kb, W = 6, 3, 3
    for causal in (False, True):
        for window in (None, W):
            mask = block_attention_mask(anchors, T, Kb, causal, window)[0, 0]
            for j, a in enumerate(anchors[0].tolist()):
                for k in range(Kb):
                    q = j * Kb + k
                    for i in range(T):
                        want = 0 <= i < a and (window is None or a + k - i < window)
                        assert bool(mask[q, i]) == want
                    for jj in range(anchors.shape[1]):
                        for kk in range(Kb):
                            want = jj == j and (not causal or kk <= k)
                            if window is not None:
                                want = want and abs(k - kk) < window
                            assert bool(mask[q, T + jj * Kb + kk]) == want


@pytest.mark.parametrize("causal,window", [(True, None), (False, 2), (True, 3)])
def test_attention_impls_agree_with_masks(causal, window):
    g = torch.Generator().manual_seed(0)
    B, A, Kb, T, H, d = 2, 5, 3, 9, 4, 8
    anchors = torch.tensor([[0, 2, 4, 8, -1], [1, 1, 6, 3, 5]])
    q = torch.randn(B, H, A * Kb, d, generator=g)
    bk, bv = torch.randn(B, 2, A * Kb, d, generator=g), torch.randn(B, 2, A * Kb, d, generator=g)
    ck, cv = torch.randn(B, 2, T, d, generator=g), torch.randn(B, 2, T, d, generator=g)
    outs = {
        impl: BlockAttention(
            anchors, T, Kb, impl, causal=causal, window=window, tile_queries=2 * Kb
        ).attend(q, bk, bv, ck, cv)  # fmt: skip
        for impl in ("dense", "tiled", "flex")
    }
    torch.testing.assert_close(outs["tiled"], outs["dense"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs["flex"], outs["dense"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_decoding_draws_from_the_teacher_forced_selector(target, temperature):
    drafter = make_dflash2(target, layer_types=["sliding_attention"] * 2, window=6)
    assert not GreedyDraftHead.applies(drafter)
    ids, feats = _batch(target, B=1)
    state = drafter.new_state()
    drafter.extend_context(state, feats[:, :9], 0)
    anchor = int(ids[0, 9])
    for seed in range(3):
        tokens, q = draft_block(drafter, state, anchor, 9, temperature, 1.0, 0,
                                torch.Generator().manual_seed(seed))  # fmt: skip
        prev = torch.cat([torch.tensor([anchor]), tokens[:-1]])
        logits = drafter.compute_logits(drafter.draft_hidden(state, anchor, 9), prev)
        if temperature == 0:
            assert q is None and torch.equal(tokens, logits.argmax(-1))
            continue
        torch.testing.assert_close(q, torch.softmax(logits / temperature, -1))
        assert int((q > 0).sum(-1).max()) <= 6  # only candidates can be drawn


@pytest.mark.parametrize("ties", [False, True])
def test_greedy_columns_are_the_slot_by_slot_argmax(target, ties):
    """Decoding's one-table walk at T = 0 picks what argmax over `selector_logits` picks
    slot by slot from the token chosen before, ties included (the lowest column wins:
    integer head products and no selector term make many)."""
    import copy

    drafter = make_dflash2(target)
    if ties:
        drafter = copy.deepcopy(drafter)
        with torch.no_grad():
            drafter.candidate_selector.hidden_projection.weight.zero_()
    assert drafter.config.output_multiplier == 1.0 and not drafter.config.final_logit_softcapping
    ids, feats = _batch(target, B=1)
    state = drafter.new_state()
    drafter.extend_context(state, feats[:, :9], 0)
    hidden = drafter.draft_hidden(state, int(ids[0, 9]), 9)
    g = torch.Generator().manual_seed(3)
    for trial in range(6):
        anchor = int(ids[0, trial])
        products = torch.randn(hidden.shape[0], target.vocab_size, generator=g)
        if ties:
            products = products.mul(1.5).round()
        want, prev = [], anchor
        for t in range(hidden.shape[0]):
            scores = drafter.selector_logits(
                hidden[t : t + 1], torch.tensor([prev]), products[t : t + 1]
            )
            prev = int(scores[0].argmax())
            want.append(prev)
        assert drafter.greedy_columns(hidden, anchor, products).tolist() == want
        own = drafter.draft_hidden(state, anchor, 9)  # the block this anchor drafts
        tokens, _ = draft_block(drafter, state, anchor, 9, 0.0, 1.0, 0, None)
        assert drafter.greedy_columns(own, anchor).tolist() == tokens.tolist()


def test_config_validation(target):
    good = DrafterConfig.for_target(target, block_size=BLOCK, arch="dflash2", selector_rank=4,
                                    selector_top_k=4).to_dict()  # fmt: skip
    for bad, msg in [
        ({"conv_group_size": 7}, "divide"),
        ({"selector_top_k": 0}, "selector"),
        ({"conv_kernel_size": 0}, "conv_kernel_size"),
        ({"layer_types": ["sliding_attention"], "sliding_window": 0}, "sliding_window"),
        ({"layer_types": ["full_attention"] * 3}, "entries"),
        ({"draft_vocab_size": 3}, r"selector_top_k in \[1, 3\]"),  # top-k 4 > 3 columns
    ]:
        with pytest.raises(ValueError, match=msg):
            DrafterConfig.from_dict({**good, **bad})
