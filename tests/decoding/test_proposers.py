"""The proposer protocol (one adapter per drafter kind, chosen in one place) and the one
switch that turns the CPU speed paths off without changing a single output."""

from __future__ import annotations

import weakref

import pytest
import torch

from blockdraft.decoding import proposers
from blockdraft.decoding.loop import decode
from blockdraft.decoding.proposers import (
    BlockProposer,
    GreedyDraftHead,
    HybridProposer,
    LookupProposer,
    Sampling,
    proposer_for,
)
from blockdraft.decoding.target_runner import TargetRunner
from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
from blockdraft.drafters.hybrid import HybridDrafter
from blockdraft.drafters.ngram import NgramDrafter
from blockdraft.kernels import ENV, cpu_kernels_apply
from blockdraft.kernels.argmax_screen import ScreenedArgmaxHead
from fake_drafter import greedy_decode_case
from random_targets import make_random_target

GREEDY = Sampling(0.0, 1.0, 0, None)


def _drafter(target):
    cfg = DrafterConfig.for_target(target, num_layers=1, block_size=5)
    return BlockDrafter(cfg).bind_target(target).eval()


def test_each_drafter_kind_gets_its_adapter(random_target) -> None:
    drafter = _drafter(random_target)
    ngram = NgramDrafter(num_proposals=4)
    assert type(proposer_for(ngram, GREEDY)) is LookupProposer
    assert type(proposer_for(drafter, GREEDY)) is BlockProposer
    assert type(proposer_for(HybridDrafter(drafter, ngram), GREEDY)) is HybridProposer
    assert not proposer_for(ngram, GREEDY).uses_features
    assert proposer_for(drafter, GREEDY).uses_features
    with pytest.raises(TypeError, match="is not a drafter"):
        proposer_for(object(), GREEDY)


def test_lookup_proposer_proposes_what_prompt_lookup_does() -> None:
    ngram = NgramDrafter(num_proposals=3)
    text = [5, 6, 7, 8, 9, 5, 6]
    proposal = LookupProposer(ngram).propose(text, text[-1], len(text) - 1)
    assert proposal.tokens.tolist() == list(ngram.propose(text))[:3] == [7, 8, 9]
    assert proposal.q is None


def test_the_switch_reads_the_device_and_the_environment(monkeypatch) -> None:
    assert cpu_kernels_apply("cpu")
    assert not cpu_kernels_apply("meta")  # any non-CPU device
    monkeypatch.setenv(ENV, "0")
    assert not cpu_kernels_apply("cpu")


def test_switching_cpu_kernels_off_changes_no_output(monkeypatch) -> None:
    """With the screen and packed heads forced on, then the switch off: same greedy
    outputs as plain decoding, and with the switch off none of the CPU paths is built."""
    monkeypatch.setattr(ScreenedArgmaxHead, "MIN_HEAD", 0)
    target, prompts, ar, memo = greedy_decode_case("memo")
    on = decode(target, memo, prompts, temperature=0.0, max_new_tokens=30, measure_ar=False)
    monkeypatch.setenv(ENV, "0")
    assert TargetRunner(target).screen is None
    monkeypatch.setattr(proposers, "_HEADS", weakref.WeakKeyDictionary())
    drafter = _drafter(make_random_target("qwen3"))
    head = GreedyDraftHead.of(drafter)
    assert head.packed is None and head.screen is None
    off = decode(target, memo, prompts, temperature=0.0, max_new_tokens=30, measure_ar=False)
    assert on.outputs == off.outputs == ar
    assert on.histogram == off.histogram


def test_greedy_head_off_the_switch_picks_the_same_tokens(monkeypatch, random_target) -> None:
    drafter = _drafter(random_target)
    state = drafter.new_state()
    g = torch.Generator().manual_seed(0)
    drafter.extend_context(state, torch.randn(1, 9, random_target.feature_size, generator=g), 0)
    with torch.inference_mode():
        hidden = drafter.draft_hidden(state, 3, 9)
        want = drafter.draft_logits(state, 3, 9).argmax(-1)
        monkeypatch.setattr(proposers, "_HEADS", weakref.WeakKeyDictionary())
        fast = GreedyDraftHead.of(drafter).pick(hidden)
        monkeypatch.setenv(ENV, "0")
        monkeypatch.setattr(proposers, "_HEADS", weakref.WeakKeyDictionary())
        plain = GreedyDraftHead.of(drafter).pick(hidden)
    assert fast.tolist() == plain.tolist() == want.tolist()
