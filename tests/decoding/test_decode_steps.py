"""The decoding loop's model calls: the speculative loop that uses the screened argmax head
(tests/kernels/test_argmax_screen.py) still reproduces greedy autoregressive decoding.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from blockdraft.decoding import proposers
from blockdraft.decoding.cpu.lean_target import LeanTarget
from blockdraft.decoding.loop import decode
from blockdraft.decoding.target_runner import TargetRunner
from blockdraft.kernels import argmax_screen, packed_linear
from blockdraft.kernels.argmax_screen import ScreenedArgmaxHead
from blockdraft.kernels.packed_linear import int8_products_exact
from fake_drafter import greedy_decode_case
from random_targets import make_random_target


@pytest.mark.parametrize("kind", ["int8", "bf16"])
@pytest.mark.parametrize("drafter_kind", ["memo", "ngram"])
def test_greedy_speculative_with_screened_head_equals_ar(monkeypatch, drafter_kind, kind) -> None:
    """Random targets have small heads; lower the size threshold so they use the screen.
    The bf16 screen serves builds without packed weights (kernels/packed_linear.py): off
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


@pytest.mark.parametrize("drafter_kind", ["ngram", "dflash"])
def test_sampled_top_k_verification_through_the_screen_equals_the_full_head(
    monkeypatch, drafter_kind
) -> None:
    """At T > 0 under a top-k cutoff the verified rows come from the screened head
    (`top_k_logits`: -inf where a token cannot pass the cutoff) and the round works on the
    columns in use only; the same seeds then give the same outputs as the full head, with
    one-hot proposals (prompt lookup) and with a drafter's q."""
    from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
    from blockdraft.drafters.ngram import NgramDrafter

    monkeypatch.setattr(LeanTarget, "supports", staticmethod(lambda model: False))
    target = make_random_target("llama", seed=1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, target.vocab_size, (6,), generator=g).tolist() for _ in range(4)]
    if drafter_kind == "ngram":
        drafter = NgramDrafter(num_proposals=4, match="first")
    else:
        torch.manual_seed(0)
        cfg = DrafterConfig.for_target(target, num_layers=1, block_size=5)
        drafter = BlockDrafter(cfg).bind_target(target).eval()
    calls = []
    original = ScreenedArgmaxHead.top_k_logits
    monkeypatch.setattr(
        ScreenedArgmaxHead,
        "top_k_logits",
        lambda self, h, k: calls.append(k) or original(self, h, k),
    )

    def run(screen: bool):  # type: ignore[no-untyped-def]
        monkeypatch.setattr(ScreenedArgmaxHead, "MIN_HEAD", 0 if screen else 1 << 62)
        monkeypatch.setattr(argmax_screen, "_HEADS", argmax_screen.weakref.WeakKeyDictionary())
        monkeypatch.setattr(packed_linear, "_PACKED", packed_linear.weakref.WeakKeyDictionary())
        return decode(
            target, drafter, prompts, temperature=0.8, top_p=0.9, top_k=5, max_new_tokens=30,
            seed=3, measure_ar=False,
        )  # fmt: skip

    full = run(screen=False)
    assert not calls
    screened = run(screen=True)
    assert calls and set(calls) == {5}
    assert screened.outputs == full.outputs
    assert sum(full.histogram[1:]) > 0  # some proposals were accepted


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
