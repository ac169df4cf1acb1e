"""The trimmed drafter (its confident prefix only) in the real decoding loop (lossless at
T = 1: test_online_hybrid.py): online rounds == offline expected rounds at T = 0 per
prompt, online tau == offline MAL at T = 1 within a 99.9% interval, and the cut proposes
fewer tokens than K (else these tests would not test a cut)."""

from __future__ import annotations

import pytest
import torch
from test_online import _assert_sampled_tau_agrees_with_offline_mal

from blockdraft.data.rollouts.store import Rollout
from blockdraft.decoding.loop import ar_generate, decode
from blockdraft.decoding.proposers import Sampling, proposer_for
from blockdraft.drafters.trimmed import TrimmedDrafter
from blockdraft.evaluation.offline import offline_stats
from blockdraft.evaluation.scoring import score_rollouts
from fake_drafter import MemoDrafter, greedy_decode_case
from random_targets import confident_random_drafter


def _setup(draft_vocab: bool = False, lookup_inputs: bool = False):
    """A fairly confident random drafter (some slots above 0.5, some below) and prompts
    that repeat (lookup has proposals); `draft_vocab`: on half the target's ids."""
    target, drafter = confident_random_drafter(draft_vocab, lookup_inputs)
    g = torch.Generator().manual_seed(1)
    base = torch.randint(3, target.vocab_size, (4,), generator=g).tolist()
    prompts = [base * 2 + [5 + i] for i in range(12)]
    return target, TrimmedDrafter(drafter, min_confidence=0.5), prompts


def _rollout(i, prompt, response, logprobs=None) -> Rollout:
    lp = torch.zeros(len(response)) if logprobs is None else torch.as_tensor(logprobs)
    return Rollout(str(i), torch.tensor(prompt), torch.as_tensor(response), lp.float())


def _proposed_lengths(target, trimmed, prompt) -> set[int]:
    """How many tokens the trimmed drafter proposes at every position of one prompt."""
    proposer = proposer_for(trimmed, Sampling(0.0, 1.0, 0, None))
    feats = target.forward(torch.tensor([prompt]), logits_to_keep=1).features
    proposer.start(feats[:, :-1])
    return {len(proposer.propose(prompt, prompt[-1], len(prompt) - 1).tokens)}


def _greedy_case(kind: str):
    """(target, trimmed drafter, prompts, greedy outputs) with blocks the cut shortens and
    slots it removes that would have been accepted: a memorising fake drafter (right 70%
    of the time, its confidence varying), or a random lookup-input BlockDrafter (the
    loop's lean round and packed head; `-dv`: on a reduced draft vocabulary)."""
    if kind == "memo":
        target, prompts, outs, _ = greedy_decode_case("memo")
        seqs = [p + o for p, o in zip(prompts, outs, strict=True)]
        memo = MemoDrafter(target, seqs, [len(p) for p in prompts], 4, strength=7.0, seed=3)
        return target, TrimmedDrafter(memo, 0.5), prompts, outs
    target, trimmed, prompts = _setup(draft_vocab=kind == "lookup-dv", lookup_inputs=True)
    outs = [ar_generate(target, p, max_new_tokens=20) for p in prompts[:4]]
    conf = 0.4 if kind == "lookup-dv" else 0.24  # where each cuts some accepted slots
    return target, TrimmedDrafter(trimmed.drafter, conf), prompts[:4], outs


@pytest.mark.parametrize("kind", ["memo", "lookup", "lookup-dv"])
def test_trimmed_greedy_online_rounds_equal_offline_per_prompt(kind) -> None:
    target, trimmed, prompts, outs = _greedy_case(kind)
    n = max(len(o) for o in outs)
    online = decode(target, trimmed, prompts, temperature=0.0, max_new_tokens=n, measure_ar=False)
    assert online.outputs == outs
    rollouts = [_rollout(i, p, o) for i, (p, o) in enumerate(zip(prompts, outs, strict=True))]
    acc = score_rollouts(trimmed, target, rollouts, 0.0, use_cache=False)
    stats = offline_stats(acc)
    assert stats.per_rollout_rounds.tolist() == [float(n) for n in online.per_prompt_rounds()]
    untrimmed = score_rollouts(trimmed.drafter, target, rollouts, 0.0, use_cache=False)
    # the cut bites: it removes slots the untrimmed drafter would have had accepted
    assert stats.mal > 1.05 and offline_stats(untrimmed).mal > stats.mal


def test_trimmed_blocks_are_shorter_than_k() -> None:
    target, trimmed, prompts = _setup()
    lengths = set().union(*(_proposed_lengths(target, trimmed, p) for p in prompts))
    assert min(lengths) < trimmed.num_proposals, lengths


@pytest.mark.parametrize("draft_vocab", [False, True])
def test_trimmed_sampling_online_tau_agrees_with_offline_mal(draft_vocab) -> None:
    target, trimmed, prompts = _setup(draft_vocab, lookup_inputs=True)
    trimmed = TrimmedDrafter(trimmed.drafter, 0.4 if draft_vocab else 0.24)
    _assert_sampled_tau_agrees_with_offline_mal(target, trimmed, prompts, 1.05)
