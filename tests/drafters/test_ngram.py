"""The prompt-lookup drafter: the lookup rule by brute force, offline scoring against the
real decoding rule (exact at T=0, Monte Carlo with a 99% CI at T=1), spec parsing."""

from __future__ import annotations

import math
import random

import pytest
import torch

from blockdraft.drafters.ngram import NgramDrafter
from blockdraft.evaluation.offline import offline_stats
from blockdraft.evaluation.scoring import score_rollouts
from blockdraft.serialization.drafter_spec import DrafterSpec


def naive_propose(seq: list[int], k: int, max_n: int, min_n: int, latest: bool) -> list[int]:
    """The rule as stated, by scanning every earlier window (no index)."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(seq):
            continue
        suffix = seq[-n:]
        starts = [i for i in range(len(seq) - n) if seq[i : i + n] == suffix]
        if starts:
            i = max(starts) if latest else min(starts)
            return seq[i + n : i + n + k]
    return []


@pytest.mark.parametrize("match", ["latest", "first"])
@pytest.mark.parametrize("max_n,min_n", [(3, 1), (2, 2), (4, 2)])
def test_propose_matches_brute_force(match: str, max_n: int, min_n: int) -> None:
    rng = random.Random(0)
    d = NgramDrafter(5, max_n, min_n, match=match)
    for _ in range(300):
        seq = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        assert d.propose(seq) == naive_propose(seq, 5, max_n, min_n, match == "latest"), seq


def greedy_rounds(prompt: list[int], response: list[int], d: NgramDrafter) -> int:
    """Rounds of real greedy speculative decoding that reproduces `response` (the greedy
    output): each round proposes from the text so far, accepts the matching prefix, emits
    one more token (correction or bonus). x_1 comes from the prefill (no round)."""
    c = d.config
    out, rounds = 1, 0
    while out < len(response):
        text = prompt + response[:out]
        proposal = naive_propose(
            text, c.num_proposals, c.max_ngram, c.min_ngram, c.match == "latest"
        )
        accepted = 0
        for y in proposal:
            if out + accepted < len(response) and response[out + accepted] == y:
                accepted += 1
            else:
                break
        out = min(len(response), out + accepted + 1)
        rounds += 1
    return rounds


def test_offline_rounds_equal_greedy_decoding_exactly() -> None:
    rng = random.Random(1)
    d = NgramDrafter(4, 3, 1)
    for _ in range(200):
        period = rng.randrange(1, 6)
        base = [rng.randrange(6) for _ in range(period)]
        # loopy text with random edits: long matches and mismatches both occur
        resp = [base[i % period] if rng.random() < 0.85 else rng.randrange(6) for i in range(30)]
        prompt = [rng.randrange(6) for _ in range(rng.randrange(1, 8))]
        acc = d.acceptance_from_tokens(prompt, resp)
        assert acc.shape == (len(resp) - 1, 4)
        stats = offline_stats([acc])
        assert stats.expected_rounds == pytest.approx(greedy_rounds(prompt, resp, d), abs=1e-9)


class _Rollout:
    def __init__(self, prompt: list[int], response: list[int]) -> None:
        self.prompt_ids = torch.tensor(prompt)
        self.response_ids = torch.tensor(response)
        self.logprobs = torch.zeros(len(response))


def test_score_rollouts_uses_token_ids_only() -> None:
    d = NgramDrafter(3)
    rolls = [_Rollout([1, 2, 3], [1, 2, 3, 1, 2]), _Rollout([5], [5, 5, 5, 5])]
    got = score_rollouts(d, target=None, rollouts=rolls, temperature=1.0)
    for r, a in zip(rolls, got, strict=True):
        assert torch.equal(a, d.acceptance_from_tokens(r.prompt_ids, r.response_ids))


# --- T = 1: the realised-token acceptance 1[x = y] is exact in expectation --------------
V, L, K = 3, 10, 3
_W = torch.randn(V + 1, V, generator=torch.Generator().manual_seed(3)) * 1.5


def _p(prev: int) -> list[float]:
    """Toy target p(. | previous token): peaked transitions make repeats (and matches)."""
    return torch.softmax(_W[prev], -1).tolist()


def _draw(probs: list[float], rng: random.Random) -> int:
    u, acc = rng.random(), 0.0
    for v, pv in enumerate(probs):
        acc += pv
        if u < acc:
            return v
    return len(probs) - 1


def _speculative_rounds(prompt: list[int], d: NgramDrafter, rng: random.Random) -> int:
    """Standard speculative sampling with a deterministic proposal: accept y with
    probability p(y); on rejection draw from p without y, renormalised; bonus after all."""
    x = [_draw(_p(prompt[-1]), rng)]  # prefill
    rounds = 0
    while len(x) < L:
        proposal = d.propose(prompt + x)
        rounds += 1
        for y in proposal:
            if len(x) >= L:
                break
            p = _p(x[-1])
            if rng.random() < p[y]:
                x.append(y)
                continue
            rest = [0.0 if v == y else pv / (1 - p[y]) for v, pv in enumerate(p)]
            x.append(_draw(rest, rng))
            break
        else:
            if len(x) < L:
                x.append(_draw(_p(x[-1]), rng))
    return rounds


def test_offline_rounds_match_speculative_sampling_monte_carlo() -> None:
    d, prompt, n = NgramDrafter(K, 2, 1), [0, 1, 2, 0], 4000
    rng = random.Random(7)
    online = [_speculative_rounds(prompt, d, rng) for _ in range(n)]
    accs = []
    for _ in range(n):
        x = [_draw(_p(prompt[-1]), rng)]
        while len(x) < L:
            x.append(_draw(_p(x[-1]), rng))
        accs.append(d.acceptance_from_tokens(prompt, x))
    offline = offline_stats(accs).per_rollout_rounds.tolist()

    def mean_var(v: list[float]) -> tuple[float, float]:
        m = sum(v) / len(v)
        return m, sum((a - m) ** 2 for a in v) / (len(v) - 1)

    (m1, v1), (m2, v2) = mean_var(online), mean_var(offline)
    half = 2.576 * math.sqrt(v1 / n + v2 / n)  # 99% CI of the difference of two means
    assert abs(m1 - m2) < half, (m1, m2, half)
    assert 1.2 < m1 < L - 1  # the proposals are accepted sometimes and not always


def test_default_rule_is_earliest_occurrence_and_named_by_spec() -> None:
    seq = [1, 2, 9, 1, 2, 8, 1, 2]  # the suffix (1, 2) occurs at 0 and at 3
    assert NgramDrafter(2).propose(seq) == [9, 1]  # vLLM's rule: the earliest occurrence
    latest = NgramDrafter(2, match="latest")
    assert latest.propose(seq) == [8, 1]
    assert DrafterSpec.parse(latest.name).ngram().config == latest.config
    assert "match" not in NgramDrafter().name and "match=latest" in latest.name
