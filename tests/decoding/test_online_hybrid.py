"""The hybrid drafter in the real decoding loop: lossless at T=1 (chi-square against the
exact output distribution; the trimmed drafter too), online rounds == offline expected
rounds at T=0 per prompt, and online tau == offline MAL at T=1 within a 99.9% interval."""

from __future__ import annotations

import pytest
import torch
from test_online import ALPHA, _assert_sampled_tau_agrees_with_offline_mal, _exact_and_empirical

from blockdraft.data.rollouts.store import Rollout
from blockdraft.decoding.loop import ar_generate, decode
from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
from blockdraft.drafters.hybrid import HybridDrafter
from blockdraft.drafters.trimmed import TrimmedDrafter
from blockdraft.evaluation.offline import offline_stats
from blockdraft.evaluation.scoring import score_rollouts
from fake_drafter import FakeTarget, chi2_pvalue, oracle_drafter
from random_targets import confident_random_drafter, make_random_target


@pytest.mark.parametrize("rule", [HybridDrafter, TrimmedDrafter])
def test_confidence_rule_sampling_is_lossless(rule) -> None:
    """hybrid (both sources supply slots) and trim (blocks of 0..3 tokens) at 0.6."""
    target = FakeTarget(vocab=3, seed=2, scale=0.7, stop_token_ids=[0])
    fake = oracle_drafter(target, 3, strength=1.5, noise=1.0, ctx_scale=0.5, seed=4)
    drafter = rule(fake, min_confidence=0.6)
    keys, exact, counts, _, _ = _exact_and_empirical(
        target, drafter, [1, 2, 1, 2], 1200, 4, "standard"
    )
    probs = torch.tensor([exact[k] for k in keys], dtype=torch.float64)
    pval, stat, df = chi2_pvalue(counts, probs)
    assert df >= 6, "too few cells for the test to have power"
    assert pval > ALPHA, (stat, df)


def _confident_setup(draft_vocab: bool = False):
    """A confident random drafter; `draft_vocab`: on a reduced vocabulary of half the
    target's ids (the merge then reads D columns, the target's tokens fall outside)."""
    target, drafter = confident_random_drafter(draft_vocab)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, target.vocab_size, (5,), generator=g).tolist() for _ in range(12)]
    return target, HybridDrafter(drafter, min_confidence=0.5), prompts


def _rollout(i, prompt, response, logprobs=None) -> Rollout:
    lp = torch.zeros(len(response)) if logprobs is None else torch.as_tensor(logprobs)
    return Rollout(str(i), torch.tensor(prompt), torch.as_tensor(response), lp.float())


@pytest.mark.parametrize("draft_vocab", [False, True])
def test_hybrid_greedy_online_rounds_equal_offline_per_prompt(draft_vocab) -> None:
    target, hybrid, prompts = _confident_setup(draft_vocab)
    outs = [ar_generate(target, p, max_new_tokens=20) for p in prompts[:4]]
    online = decode(
        target, hybrid, prompts[:4], temperature=0.0, max_new_tokens=20, measure_ar=False
    )
    assert online.outputs == outs
    rollouts = [_rollout(i, p, o) for i, (p, o) in enumerate(zip(prompts, outs, strict=False))]
    stats = offline_stats(score_rollouts(hybrid, target, rollouts, 0.0, use_cache=False))
    assert stats.per_rollout_rounds.tolist() == [float(n) for n in online.per_prompt_rounds()]


def test_hybrid_of_a_lookup_input_drafter_decodes_as_scored_offline() -> None:
    """The block reads prompt lookup's tokens and the slots fall back to them: online, the
    loop must hand the drafter its lookup too (it raised instead), and at T = 0 each
    prompt's rounds equal the offline evaluator's."""
    torch.manual_seed(0)
    target = make_random_target("qwen3", seed=2)
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)
    cfg = DrafterConfig.for_target(target, num_layers=1, block_size=5, lookup_inputs=True)
    drafter = BlockDrafter(cfg).bind_target(target).eval()
    hybrid = HybridDrafter(drafter, min_confidence=0.5)
    g = torch.Generator().manual_seed(1)
    base = torch.randint(3, target.vocab_size, (4,), generator=g).tolist()
    prompts = [base * 3 + [5 + i] for i in range(4)]  # repeats: lookup has proposals
    outs = [ar_generate(target, p, max_new_tokens=20) for p in prompts]
    online = decode(target, hybrid, prompts, temperature=0.0, max_new_tokens=20, measure_ar=False)
    assert online.outputs == outs
    rollouts = [_rollout(i, p, o) for i, (p, o) in enumerate(zip(prompts, outs, strict=True))]
    stats = offline_stats(score_rollouts(hybrid, target, rollouts, 0.0, use_cache=False))
    assert stats.per_rollout_rounds.tolist() == [float(n) for n in online.per_prompt_rounds()]


@pytest.mark.parametrize("draft_vocab", [False, True])
def test_hybrid_sampling_online_tau_agrees_with_offline_mal(draft_vocab) -> None:
    target, hybrid, prompts = _confident_setup(draft_vocab)
    _assert_sampled_tau_agrees_with_offline_mal(target, hybrid, prompts, 1.2)
