"""The trimmed drafter (its confident prefix only) in the real decoding loop: lossless at
T = 1 (chi-square against the exact output distribution), online rounds == offline expected
rounds at T = 0 per prompt, online tau == offline MAL at T = 1 within a 99.9% interval, and
the cut proposes fewer tokens than K (else these tests would not test a cut)."""

from __future__ import annotations

import math

import pytest
import torch
from test_online import ALPHA, _exact_and_empirical

from blockdraft.data.rollouts.sampler import SamplingSettings, generate_batch
from blockdraft.data.rollouts.store import Rollout
from blockdraft.decoding.loop import ar_generate, decode
from blockdraft.decoding.proposers import Sampling, proposer_for
from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
from blockdraft.drafters.trimmed import TrimmedDrafter
from blockdraft.evaluation.offline import mal_ci, offline_stats
from blockdraft.evaluation.scoring import score_rollouts
from fake_drafter import FakeTarget, MemoDrafter, chi2_pvalue, greedy_decode_case, oracle_drafter
from random_targets import make_random_target


def test_trimmed_sampling_is_lossless() -> None:
    target = FakeTarget(vocab=3, seed=2, scale=0.7, stop_token_ids=[0])
    fake = oracle_drafter(target, 3, strength=1.5, noise=1.0, ctx_scale=0.5, seed=4)
    trimmed = TrimmedDrafter(fake, min_confidence=0.6)  # blocks of 0..3 tokens
    keys, exact, counts, _, rounds = _exact_and_empirical(
        target, trimmed, [1, 2, 1, 2], 1200, 4, "standard"
    )
    probs = torch.tensor([exact[k] for k in keys], dtype=torch.float64)
    pval, stat, df = chi2_pvalue(counts, probs)
    assert df >= 6, "too few cells for the test to have power"
    assert pval > ALPHA, (stat, df)


def _setup(draft_vocab: bool = False, lookup_inputs: bool = False):
    """A fairly confident random drafter (some slots above 0.5, some below); `draft_vocab`:
    on a reduced vocabulary of half the target's ids."""
    torch.manual_seed(0)
    target = make_random_target("qwen3", seed=2)
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)
    size = target.vocab_size // 2 if draft_vocab else None
    cfg = DrafterConfig.for_target(
        target, num_layers=1, block_size=5, draft_vocab_size=size, lookup_inputs=lookup_inputs
    )
    drafter = BlockDrafter(cfg).bind_target(target).eval()
    if draft_vocab:
        drafter.set_draft_vocab(torch.arange(0, target.vocab_size, 2)[:size])
    with torch.no_grad():
        drafter.fc.weight.mul_(20.0)
    g = torch.Generator().manual_seed(1)
    base = torch.randint(3, target.vocab_size, (4,), generator=g).tolist()
    prompts = [base * 2 + [5 + i] for i in range(12)]  # repeats: lookup has proposals
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
    settings = SamplingSettings(temperature=1.0, max_new_tokens=20, seed=3)
    gen = generate_batch(target, prompts, [str(i) for i in range(len(prompts))], settings)
    rollouts = [
        _rollout(i, p, r.response_ids, r.logprobs)
        for i, (p, r) in enumerate(zip(prompts, gen, strict=True))
    ]
    acc = score_rollouts(trimmed, target, rollouts, 1.0, use_cache=False)
    mal, (lo, hi) = mal_ci(acc, n_boot=1000)
    online = decode(
        target, trimmed, prompts, temperature=1.0, max_new_tokens=20, seed=5, measure_ar=False
    )
    se_off, se_on = (hi - lo) / 3.92, (online.tau_ci95[1] - online.tau_ci95[0]) / 3.92
    assert mal > 1.05 and online.tau > 1.05
    assert abs(online.tau - mal) < 3.29 * math.hypot(se_off, se_on), (online.tau, mal)
