"""The n-gram (prompt lookup) drafter in the real decoding loop.

- Greedy: the output equals autoregressive greedy decoding, the proposals are exactly
  `NgramDrafter.propose` of the text so far (the loop's incremental index is checked
  against the from-scratch rule), and the online tau equals the offline MAL of the
  greedy rollouts (`scoring.score_rollouts`) exactly, prompt by prompt.
- Sampling: one-hot verification (`verify_onehot`) makes the same decisions as
  `verify_standard` with an explicit one-hot q, and the decoder's output distribution
  equals the target's exactly (enumerated sequences of a tiny Markov target, chi-square
  at significance 1e-4; the harness is shown to reject a lossy variant).
"""

from __future__ import annotations

import pytest
import torch

from blockdraft.data.rollouts.store import Rollout
from blockdraft.decoding.loop import ar_generate, decode, speculative_generate
from blockdraft.decoding.proposers import NgramIndex
from blockdraft.decoding.verify import verify_onehot, verify_standard
from blockdraft.drafters.ngram import NgramDrafter
from blockdraft.evaluation.offline import offline_stats
from blockdraft.evaluation.scoring import score_rollouts
from fake_drafter import FakeTarget, chi2_pvalue
from random_targets import make_random_target

ALPHA = 1e-4


def _repetitive_prompts(target, n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a short random phrase: prompt lookup finds matches in them."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        phrase = torch.randint(3, target.vocab_size, (5,), generator=g).tolist()
        noise = torch.randint(3, target.vocab_size, (3,), generator=g).tolist()
        out.append(phrase + noise + phrase + noise[:1] + phrase[:2])
    return out


def test_incremental_index_proposes_what_propose_does() -> None:
    g = torch.Generator().manual_seed(0)
    for cfg in [dict(), dict(num_proposals=3, max_ngram=2), dict(match="first")]:
        drafter = NgramDrafter(**cfg)
        seq = torch.randint(0, 4, (60,), generator=g).tolist()  # small alphabet: many matches
        index = NgramIndex(drafter)
        for end in range(1, len(seq) + 1, 3):  # grows by several tokens at a time, as rounds do
            assert index.propose(seq[:end]) == drafter.propose(seq[:end]), (cfg, end)


def test_greedy_ngram_equals_ar_and_online_tau_equals_offline_mal() -> None:
    target = make_random_target("llama", seed=1)  # repeats itself, not only one token
    # HF's rule (first occurrence): in a run of one repeated token the latest occurrence
    # leaves a single token to propose, the first leaves K, so every length occurs
    drafter = NgramDrafter(num_proposals=4, max_ngram=3, match="first")
    prompts = _repetitive_prompts(target, 6)
    res = decode(target, drafter, prompts, temperature=0.0, max_new_tokens=40)
    ar = [ar_generate(target, p, max_new_tokens=40) for p in prompts]
    assert res.outputs == res.ar_outputs == ar
    # rounds with no proposal, partial and full acceptance all occur
    assert res.histogram[1] > 0 and res.histogram[-1] > 0, res.histogram
    assert 1.2 < res.tau < 5.0
    rollouts = [
        Rollout(str(i), torch.tensor(p), torch.tensor(o), torch.zeros(len(o)))
        for i, (p, o) in enumerate(zip(prompts, ar, strict=True))
    ]
    stats = offline_stats(score_rollouts(drafter, target, rollouts, 0.0, use_cache=False))
    assert stats.per_rollout_rounds.tolist() == [float(n) for n in res.per_prompt_rounds()]
    assert stats.mal == pytest.approx(res.tau, abs=1e-12)
    # and the loop's accounting: each round accepted exactly the proposal's agreeing prefix
    for p, out, acc in zip(prompts, res.outputs, res.rounds_accepted, strict=True):
        n, seq = 1, p + out
        for m in acc:
            y, start = drafter.propose(seq[: len(p) + n]), len(p) + n
            got = seq[start : start + m + 1]  # accepted proposals + correction/bonus
            assert got[:m] == y[: len(got[:m])]  # (the last round may be cut at 40 tokens)
            if m < len(y) and len(got) == m + 1:
                assert got[m] != y[m]  # the round stopped at a disagreement
            n += m + 1


def test_greedy_ngram_without_matches_emits_one_token_per_round() -> None:
    target = make_random_target("llama", seed=1)
    drafter = NgramDrafter(num_proposals=4, max_ngram=2, min_ngram=2)
    res = decode(target, drafter, [[5, 6, 7]], max_new_tokens=3, measure_ar=False)
    assert res.rounds_accepted == [[0, 0]] and res.tau == 1.0


def test_verify_onehot_matches_verify_standard_draw_for_draw() -> None:
    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        k, v = trial % 4, 2 + trial % 5
        p = torch.softmax(torch.randn(k + 1, v, generator=g, dtype=torch.float64) * 2, -1)
        if trial % 7 == 0:
            p[0] = torch.nn.functional.one_hot(torch.tensor(1), v).double()  # p(y) = 1 case
        y = torch.randint(v, (k,), generator=g)
        q = torch.nn.functional.one_hot(y, v).double()
        s1 = int(torch.randint(1 << 30, (1,), generator=g))
        a = verify_onehot(y, p, torch.Generator().manual_seed(s1))
        b = verify_standard(y, q, p, torch.Generator().manual_seed(s1))
        assert a == b, (trial, a, b)


def _sequence_counts(target, drafter, prompt, n, max_new, temperature, verifier, seed=7):
    exact = target.sequence_probs(prompt, max_new, temperature)
    keys = sorted(exact)
    counts = torch.zeros(len(keys))
    g = torch.Generator().manual_seed(seed)
    accepted = 0
    for _ in range(n):
        tr = speculative_generate(
            target,
            drafter,
            prompt,
            temperature=temperature,
            max_new_tokens=max_new,
            generator=g,
            verifier=verifier,
        )
        counts[keys.index(tuple(tr.tokens))] += 1
        accepted += sum(tr.accepted)
    probs = torch.tensor([exact[k] for k in keys], dtype=torch.float64)
    return counts, probs, accepted


@pytest.mark.parametrize("verifier", ["standard", "block"])
def test_sampling_ngram_output_distribution_equals_target(verifier: str) -> None:
    """Vocabulary 3, a repetitive prompt: most rounds propose, many proposals are
    accepted and many rejected, and whole 5-token outputs are distributed exactly as
    the target's (chi-square over every possible output)."""
    target = FakeTarget(vocab=3, seed=5, scale=1.2, stop_token_ids=[0])
    drafter = NgramDrafter(num_proposals=3, max_ngram=2)
    counts, probs, accepted = _sequence_counts(
        target, drafter, [1, 2, 1, 2, 1], 1500, 5, 1.0, verifier
    )
    assert probs.sum().item() == pytest.approx(1.0, abs=1e-9)
    pval, stat, df = chi2_pvalue(counts, probs)
    assert df >= 6, "too few cells for the test to have power"
    assert accepted > 500, "proposals were rarely accepted: the test would prove little"
    assert pval > ALPHA, (stat, df)


def test_chi_square_harness_rejects_accepting_proposals_blindly(monkeypatch) -> None:
    """Sanity: accepting every n-gram proposal (no verification) is detected."""
    import blockdraft.decoding.loop as online
    from blockdraft.decoding.verify import Verdict
    from blockdraft.sampling import sample

    def accept_all(y, p, generator=None):
        return Verdict(y.shape[0], int(sample(p[y.shape[0]], generator)))

    monkeypatch.setattr(online, "verify_onehot", accept_all)
    target = FakeTarget(vocab=3, seed=5, scale=1.2, stop_token_ids=[0])
    counts, probs, _ = _sequence_counts(
        target,
        NgramDrafter(num_proposals=3, max_ngram=2),
        [1, 2, 1, 2, 1],
        1500,
        5,
        1.0,
        "standard",
    )
    pval, _, _ = chi2_pvalue(counts, probs)
    assert pval < ALPHA
