"""The decoding loop's model calls: the screened argmax head is the fp32 argmax, and the
speculative loop that uses it still reproduces greedy autoregressive decoding.

The screen keeps every token whose fp32 logit could still be the largest under its
rounding-error bound, so it must find the exact argmax even on near-ties that a bf16
product alone gets wrong (checked to actually happen here, so the test can fail).
"""

from __future__ import annotations

import weakref

import pytest
import torch

from blockdraft.decoding import proposers
from blockdraft.decoding.cpu import argmax_screen, packed_linear
from blockdraft.decoding.cpu.argmax_screen import ScreenedArgmaxHead
from blockdraft.decoding.cpu.lean_target import LeanTarget
from blockdraft.decoding.cpu.packed_linear import int8_products_exact
from blockdraft.decoding.loop import decode
from blockdraft.decoding.steps import TargetRunner
from blockdraft.targets.testing import make_random_target
from fake_drafter import greedy_decode_case


def _near_tie_case(seed: int, outliers: bool):  # type: ignore[no-untyped-def]
    """A head and rows where, for every row, a rival token's logit is within ~1e-4 of the
    best; with `outliers` a few hidden dimensions are ~20x the rest (as in Gemma's final
    hidden states, which is what makes one-pass int8 activations useless)."""
    g = torch.Generator().manual_seed(seed)
    vocab, hidden, rows = 4096, 256, 64
    weight = torch.randn(vocab, hidden, generator=g) * 0.05
    x = torch.randn(rows, hidden, generator=g) * 4
    if outliers:
        x[:, :3] *= 20
    exact_best = (x @ weight.T).argmax(-1)
    rivals = torch.randint(vocab, (rows,), generator=g)
    for r in range(rows):
        direction = x[r] / x[r].norm() ** 2
        logit_best = float(x[r] @ weight[exact_best[r]])
        gap = (1e-4 if r % 2 else -1e-4) * abs(logit_best)
        weight[rivals[r]] = weight[exact_best[r]] + direction * gap
    return weight, x


@pytest.mark.parametrize("kind", ["int8", "int8-refined", "bf16"])
@pytest.mark.parametrize("outliers", [False, True])
def test_screened_argmax_equals_fp32_argmax_on_near_ties(monkeypatch, kind, outliers) -> None:
    """`int8-refined`: every row also takes the int8 screen's second stage."""
    if kind.startswith("int8") and not int8_products_exact():
        pytest.skip("no exact int8 products on this CPU")
    weight, x = _near_tie_case(0, outliers)
    head = ScreenedArgmaxHead(weight, kind=kind.split("-")[0])
    if kind == "int8-refined":
        monkeypatch.setattr(head, "EXACT_LIMIT", 0)
        calls = []
        original = head.screen.refine
        monkeypatch.setattr(head.screen, "refine", lambda h: calls.append(1) or original(h))
    exact = (x @ weight.T).argmax(-1)
    y = head.products(x).y
    assert (y.float().argmax(-1) != exact).any(), "the screen alone never errs: proves nothing"
    assert torch.equal(head.argmax(x), exact)
    if kind == "int8-refined":
        assert calls


@pytest.mark.parametrize("kind", ["int8", "int8-refined", "bf16"])
def test_screen_bound_covers_the_screen_error(kind) -> None:
    """The bound covers |screen - exact logit| (float64) for every token, on rows with an
    outlier dimension and heavy-tailed weight rows; it is not slack by construction
    (dropping the dominant term of an int8 stage breaks it), and the one-pass threshold
    keeps every token the full per-logit test keeps while still screening out almost all
    (the first int8 stage only after `refine`, which tightens it tenfold)."""
    if kind.startswith("int8") and not int8_products_exact():
        pytest.skip("no exact int8 products on this CPU")
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(2048, 640, generator=g)
    weight[:, 7] *= 6  # heavy-tailed rows, as in Gemma's head
    x = torch.randn(8, 640, generator=g) * 30
    x[:, 5] *= 15
    head = ScreenedArgmaxHead(weight, kind=kind.split("-")[0])
    screened = head.screen.refine(x) if kind == "int8-refined" else head.products(x)
    y = screened.y
    err = (y.double() - (x.double() @ weight.double().T)).abs()
    bound = screened.bounds()
    assert (err <= bound).all()
    full = y.float() + bound >= (y.float() - bound).amax(-1, keepdim=True)
    kept = y >= head.thresholds(screened)[:, None]
    assert (kept | ~full).all()
    if kind != "int8":  # the first int8 stage is loose on these rows: that is what refine is for
        assert kept.sum() < 0.01 * kept.numel()
    else:
        assert (head.screen.refine(x).bounds() < 0.1 * bound).all()
    if kind.startswith("int8"):  # the dominant term of each stage is needed
        term = 1 if kind == "int8" else 0  # weight error, resp. activation residual
        screened.coef[term] = torch.zeros_like(screened.coef[term])
        assert not (err <= screened.bounds()).all()


def test_int8_probe_rejects_a_saturating_kernel(monkeypatch) -> None:
    """A kernel that sums u8 x s8 in saturating int16 pairs (pre-VNNI CPUs) or applies the
    zero point in fp32 fails the probe, and the head then screens in bf16."""
    real = packed_linear.onednn_int8_linear

    def saturating(x, packed, scales):  # type: ignore[no-untyped-def]
        out = real(x, packed, scales)
        pairs = x.float().amax() * 127 * 2  # vpmaddubsw: raw u8 x s8, two at a time
        return out if pairs <= 32767 else out.clamp(-(2**15), 2**15)

    def fp32_zero_point(x, packed, scales):  # type: ignore[no-untyped-def]
        out = real(x, packed, scales)
        return (out / scales).round().add(1.0) * scales  # off by one integer

    for fake in (saturating, fp32_zero_point):
        monkeypatch.setattr(packed_linear, "onednn_int8_linear", fake)
        packed_linear.int8_products_exact.cache_clear()
        try:
            assert not packed_linear.int8_products_exact()
            assert not argmax_screen.int8_products_exact()
        finally:
            packed_linear.int8_products_exact.cache_clear()
    monkeypatch.setattr(argmax_screen, "int8_products_exact", lambda: False)
    head = ScreenedArgmaxHead(torch.randn(64, 32))
    assert isinstance(head.screen, argmax_screen.Bf16Screen)
    with pytest.raises(RuntimeError, match="int8 products"):
        ScreenedArgmaxHead(torch.randn(64, 32), kind="int8")


@pytest.mark.parametrize("kind", ["int8", "bf16"])
@pytest.mark.parametrize("drafter_kind", ["memo", "ngram"])
def test_greedy_speculative_with_screened_head_equals_ar(monkeypatch, drafter_kind, kind) -> None:
    """Random targets have small heads; lower the size threshold so they use the screen.
    The bf16 screen serves builds without packed weights (decoding/cpu/packed_linear.py): off
    here; the int8 screen is used with or without them."""
    if kind == "int8" and not int8_products_exact():
        pytest.skip("no exact int8 products on this CPU")
    monkeypatch.setattr(ScreenedArgmaxHead, "MIN_HEAD", 0)
    # the HF forward's head: a random target is small enough for the lean forward
    monkeypatch.setattr(LeanTarget, "supports", staticmethod(lambda model: False))
    if kind == "bf16":
        monkeypatch.setattr(argmax_screen.Int8Screen, "build", classmethod(lambda cls, w, n: None))
        monkeypatch.setattr(packed_linear, "packing_supported", lambda: False)
    monkeypatch.setattr(packed_linear, "_PACKED", packed_linear.weakref.WeakKeyDictionary())
    monkeypatch.setattr(argmax_screen, "_HEADS", argmax_screen.weakref.WeakKeyDictionary())
    target, prompts, ar, drafter = greedy_decode_case(drafter_kind)
    screen = TargetRunner(target).screen
    assert screen is not None and type(screen.screen).__name__.lower().startswith(kind)
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
    from blockdraft.decoding.proposers import GreedyDraftHead
    from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig

    if screened:  # the screen serves builds without packed weights
        monkeypatch.setattr(ScreenedArgmaxHead, "MIN_HEAD", 0)
        monkeypatch.setattr(packed_linear, "packing_supported", lambda: False)
    monkeypatch.setattr(proposers, "_HEADS", weakref.WeakKeyDictionary())
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
    from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
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
            tokens, q = proposers.draft_block(
                drafter, state, 11, 9, 0.9, top_p, top_k, torch.Generator().manual_seed(seed)
            )
            full = processed_probs(drafter.draft_logits(state, 11, 9), 0.9, top_p, top_k)
            torch.testing.assert_close(q, full, rtol=1e-5, atol=1e-7)
            assert torch.equal(tokens, sample(full, torch.Generator().manual_seed(seed)))
            assert bool(torch.isin(tokens, drafter.draft_ids).all())


def test_packed_target_keeps_only_a_fast_screen(monkeypatch) -> None:
    """With packed target weights the runner keeps the screen only when it is fast (int8,
    or a bf16 screen oneDNN packed); an unpacked bf16 screen gives way to the packed fp32
    head."""
    monkeypatch.setattr(ScreenedArgmaxHead, "MIN_HEAD", 0)
    monkeypatch.setattr(argmax_screen.Int8Screen, "build", classmethod(lambda cls, w, n: None))
    target = make_random_target("llama", seed=1)
    for packed_low in (None, torch.zeros(1)):
        monkeypatch.setattr(argmax_screen, "_HEADS", argmax_screen.weakref.WeakKeyDictionary())
        run = TargetRunner(target, lean=False)  # the HF forward's head
        run.screen.screen.packed_low = packed_low
        run.use_packed_weights()
        assert (run.screen is not None) == (packed_low is not None)
    if int8_products_exact():
        monkeypatch.undo()
        monkeypatch.setattr(ScreenedArgmaxHead, "MIN_HEAD", 0)
        monkeypatch.setattr(argmax_screen, "_HEADS", argmax_screen.weakref.WeakKeyDictionary())
        run = TargetRunner(target, lean=False)
        run.use_packed_weights()
        assert isinstance(run.screen.screen, argmax_screen.Int8Screen)
