"""The decoding loop's model calls: the screened argmax head is the fp32 argmax, and the
speculative loop that uses it still reproduces greedy autoregressive decoding.

The screen keeps every token whose fp32 logit could still be the largest under its
rounding-error bound, so it must find the exact argmax even on near-ties that a bf16
product alone gets wrong (checked to actually happen here, so the test can fail).
"""

from __future__ import annotations

import pytest
import torch
from fake_drafter import greedy_decode_case

from blockdraft.evaluation import decode_steps
from blockdraft.evaluation.decode_steps import ScreenedArgmaxHead, TargetRunner
from blockdraft.evaluation.online import decode
from blockdraft.models import packed_linear
from blockdraft.models.testing import make_random_target


def test_screened_argmax_equals_fp32_argmax_on_near_ties() -> None:
    g = torch.Generator().manual_seed(0)
    vocab, hidden, rows = 4096, 256, 64
    weight = torch.randn(vocab, hidden, generator=g) * 0.05
    x = torch.randn(rows, hidden, generator=g) * 4
    exact_best = (x @ weight.T).argmax(-1)
    # near-ties: for every row, a rival token whose logit is within ~1e-4 of the best
    rivals = torch.randint(vocab, (rows,), generator=g)
    for r in range(rows):
        direction = x[r] / x[r].norm() ** 2
        logit_best = float(x[r] @ weight[exact_best[r]])
        gap = (1e-4 if r % 2 else -1e-4) * abs(logit_best)
        weight[rivals[r]] = weight[exact_best[r]] + direction * gap
    head = ScreenedArgmaxHead(weight)
    exact = (x @ weight.T).argmax(-1)
    low = (x.bfloat16() @ weight.bfloat16().T).float().argmax(-1)
    assert (low != exact).any(), "bf16 alone never errs here: the test would prove nothing"
    assert torch.equal(head.argmax(x), exact)


def test_screen_bound_covers_the_bf16_error() -> None:
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(2048, 640, generator=g)
    x = torch.randn(8, 640, generator=g) * 30
    head = ScreenedArgmaxHead(weight)
    for screen in (head.screen(x), torch.nn.functional.linear(x.bfloat16(), head.low)):
        err = (screen.double() - (x.double() @ weight.double().T)).abs()
        bound = head.bounds(x, screen)
        assert (err <= bound).all()
        # the one-pass threshold keeps every token the full per-logit test keeps
        full = screen.float() + bound >= (screen.float() - bound).amax(-1, keepdim=True)
        kept = screen >= head.thresholds(x, screen)[:, None]
        assert (kept | ~full).all()
        assert kept.sum() < 0.01 * kept.numel()  # ... and still screens out almost all


@pytest.mark.parametrize("drafter_kind", ["memo", "ngram"])
def test_greedy_speculative_with_screened_head_equals_ar(monkeypatch, drafter_kind) -> None:
    """Random targets have small heads; lower the size threshold so they use the screen.
    The screen serves builds without packed weights (models/packed_linear.py): off here."""
    monkeypatch.setattr(ScreenedArgmaxHead, "MIN_HEAD", 0)
    monkeypatch.setattr(packed_linear, "packing_supported", lambda: False)
    monkeypatch.setattr(packed_linear, "_PACKED", packed_linear.weakref.WeakKeyDictionary())
    monkeypatch.setattr(decode_steps, "_SCREENS", decode_steps.weakref.WeakKeyDictionary())
    target, prompts, ar, drafter = greedy_decode_case(drafter_kind)
    assert TargetRunner(target).screen is not None
    calls = []
    original = ScreenedArgmaxHead.argmax
    monkeypatch.setattr(
        ScreenedArgmaxHead, "argmax", lambda self, h: calls.append(1) or original(self, h)
    )
    res = decode(target, drafter, prompts, temperature=0.0, max_new_tokens=30, measure_ar=False)
    assert res.outputs == ar
    assert calls, "the screened head was never used"
    assert sum(res.histogram[2:]) > 0


@pytest.mark.parametrize("screened", [False, True])
def test_greedy_draft_head_equals_full_vocab_argmax(monkeypatch, screened) -> None:
    """Argmax in the drafter's reduced vocabulary, mapped to target ids, is the argmax of
    `draft_logits` (full target vocabulary, -inf outside the draft vocabulary)."""
    from blockdraft.evaluation.decode_steps import GreedyDraftHead
    from blockdraft.models.drafter import BlockDrafter, DrafterConfig

    if screened:  # the screen serves builds without packed weights
        monkeypatch.setattr(ScreenedArgmaxHead, "MIN_HEAD", 0)
        monkeypatch.setattr(packed_linear, "packing_supported", lambda: False)
    monkeypatch.setattr(decode_steps, "_SCREENS", decode_steps.weakref.WeakKeyDictionary())
    target = make_random_target("qwen3")
    torch.manual_seed(0)
    cfg = DrafterConfig.for_target(target, num_layers=1, block_size=6, draft_vocab_size=100)
    drafter = BlockDrafter(cfg).bind_target(target).eval()
    g = torch.Generator().manual_seed(3)
    drafter.set_draft_vocab(torch.randperm(target.vocab_size, generator=g)[:100].sort().values)
    head = GreedyDraftHead.of(drafter)
    assert (head.screen is not None) == screened
    assert GreedyDraftHead.of(drafter) is head  # cached across prompts
    state = drafter.new_state()
    feats = torch.randn(1, 12, target.feature_size, generator=g)
    drafter.extend_context(state, feats, 0)
    with torch.inference_mode():
        for anchor in (5, 17, 40):
            expected = drafter.draft_logits(state, anchor, 12).argmax(-1)
            got = head.pick(drafter.draft_hidden(state, anchor, 12))
            assert torch.equal(got, expected)
    assert set(got.tolist()) <= set(drafter.draft_ids.tolist())


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 0.8)])
def test_sampled_draft_block_in_draft_vocab_equals_target_space(top_k, top_p) -> None:
    """At T > 0 a reduced-vocabulary drafter samples from its K x V_draft logits; q placed
    in target space equals `processed_probs` of the target-space logits, and the same
    generator draws the same tokens (inverse CDF over the same nonzero entries in order)."""
    from blockdraft.models.drafter import BlockDrafter, DrafterConfig
    from blockdraft.sampling import processed_probs, sample

    target = make_random_target("qwen3", seed=6)
    torch.manual_seed(0)
    cfg = DrafterConfig.for_target(target, num_layers=1, block_size=6, draft_vocab_size=50)
    drafter = BlockDrafter(cfg).bind_target(target).eval()
    g = torch.Generator().manual_seed(3)
    drafter.set_draft_vocab(torch.randperm(target.vocab_size, generator=g)[:50].sort().values)
    state = drafter.new_state()
    drafter.extend_context(state, torch.randn(1, 9, target.feature_size, generator=g), 0)
    with torch.inference_mode():
        for seed in range(5):
            tokens, q = decode_steps.draft_block(
                drafter, state, 11, 9, 0.9, top_p, top_k, torch.Generator().manual_seed(seed)
            )
            full = processed_probs(drafter.draft_logits(state, 11, 9), 0.9, top_p, top_k)
            torch.testing.assert_close(q, full, rtol=1e-5, atol=1e-7)
            assert torch.equal(tokens, sample(full, torch.Generator().manual_seed(seed)))
            assert bool(torch.isin(tokens, drafter.draft_ids).all())


def test_packed_target_keeps_only_a_packed_screen(monkeypatch) -> None:
    """With packed target weights the runner keeps the bf16 screen only when oneDNN packed
    it; an unpacked screen gives way to the packed fp32 head."""
    monkeypatch.setattr(ScreenedArgmaxHead, "MIN_HEAD", 0)
    target = make_random_target("llama", seed=1)
    for packed_low in (None, torch.zeros(1)):
        monkeypatch.setattr(decode_steps, "_SCREENS", decode_steps.weakref.WeakKeyDictionary())
        run = TargetRunner(target)
        run.screen.packed_low = packed_low
        run.use_packed_weights()
        assert (run.screen is not None) == (packed_low is not None)
