"""The suffix-decoding drafter: the rule by brute force where it has no ties, offline
scoring, spec parsing and online decoding. Proposal for proposal against Arctic
Inference's own tree: tests/engines/test_suffix_rule.py."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from blockdraft.data.rollouts.store import Rollout
from blockdraft.decoding.loop import ar_generate, decode
from blockdraft.drafters.suffix import SuffixDrafter, f32
from blockdraft.evaluation.offline import offline_stats
from blockdraft.evaluation.scoring import score_rollouts
from blockdraft.serialization.drafter_spec import DrafterSpec, DrafterSpecError
from random_targets import make_random_target


# --- an independent reference: counts by scanning the texts ------------------------------
def naive_draft(
    texts: list[list[int]], context: list[int], k: int, depth: int, factor: float, prob: float
) -> tuple[list[int], float] | None:
    """The rule on one set of texts, with every count found by scanning: the count of a
    pattern is the number of its occurrences (up to `depth` long) in `texts`. None where a
    followed step has two most frequent continuations (the tie order is Arctic's history)."""
    counts: Counter = Counter()
    for text in texts:
        for i in range(len(text)):
            for n in range(1, min(depth, len(text) - i) + 1):
                counts[tuple(text[i : i + n])] += 1
    best: tuple[list[int], float] = ([], 0.0)
    for m in range(1, len(context)):
        path = tuple(context[-m:])
        if not counts[path]:
            break
        limit = min(k, int(f32(m * f32(factor)) + 1e-6))
        tokens: list[int] = []
        p, score = 1.0, 0.0
        while len(tokens) < limit:
            nxt = {t: counts[(*path, t)] for t in {x for text in texts for x in text}}
            nxt = {t: c for t, c in nxt.items() if c and len(path) < depth}
            if not nxt:
                break
            top = max(nxt.values())
            if list(nxt.values()).count(top) > 1:
                return None
            t = max(nxt, key=nxt.get)
            p = f32(p * f32(top / counts[path]))
            if p < f32(prob):
                break
            tokens.append(t)
            score = f32(score + p)
            path = (*path, t)
        if score >= best[1]:
            best = (tokens, score)
    return best


def test_proposals_match_counts_scanned_from_the_text() -> None:
    rng = random.Random(0)
    checked = nonempty = 0
    for _ in range(300):
        k, depth = rng.choice([3, 7]), rng.choice([3, 6, 24])
        factor, prob = rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 0.1, 0.4])
        d = SuffixDrafter(k, depth, factor, prob)
        seq = [rng.randrange(rng.randint(2, 5)) for _ in range(rng.randint(2, 30))]
        context = seq[-depth:]
        want = naive_draft([seq], context, k, depth, factor, prob)
        if want is None:
            continue
        assert d.propose(seq) == want[0], (seq, k, depth, factor, prob)
        checked += 1
        nonempty += bool(want[0])
    assert checked > 100 and nonempty > 50  # not vacuous


# --- scoring, specs, decoding ------------------------------------------------------------
def random_rollouts(rng: random.Random) -> list[tuple[list[int], list[int]]]:
    vocab = rng.randint(2, 6)
    return [
        (
            [rng.randrange(vocab) for _ in range(rng.randint(1, 30))],
            [rng.randrange(vocab) for _ in range(rng.randint(1, 40))],
        )
        for _ in range(rng.randint(1, 4))
    ]


class Row:
    def __init__(self, prompt: list[int], response: list[int]) -> None:
        self.prompt_ids = torch.tensor(prompt)
        self.response_ids = torch.tensor(response)
        self.logprobs = torch.zeros(len(response))


def test_scoring_accepts_the_proposals_prefix_that_the_rollout_continues() -> None:
    rng = random.Random(1)
    rows = [Row(*r) for r in random_rollouts(rng) for _ in range(2)]
    for global_tree in (False, True):
        d = SuffixDrafter(4, 8, global_tree=global_tree)
        acc = score_rollouts(d, None, rows, temperature=0.0)
        props = d.proposals_of_rollouts([(r.prompt_ids, r.response_ids) for r in rows])
        for a, p, r in zip(acc, props, rows, strict=True):
            x = r.response_ids.tolist()
            for n in range(len(x) - 1):
                accepted = 0
                while accepted < 4 and n + 1 + accepted < len(x):
                    if int(p[n, accepted]) != x[n + 1 + accepted]:
                        break
                    accepted += 1
                assert int(a[n].sum()) == accepted
    # the global tree sees the earlier rollouts: a repeated rollout is proposed in full
    repeated = [Row([9], [1, 2, 3, 4, 5, 6]), Row([8], [1, 2, 3, 4, 5, 6])]
    alone, shared = (
        score_rollouts(SuffixDrafter(4, global_tree=g), None, repeated, 0.0) for g in (0, 1)
    )
    assert offline_stats(shared[1:]).mal > offline_stats(alone[1:]).mal


def test_specs_parse_name_and_reject() -> None:
    d = DrafterSpec.parse("suffix:k=5,global=1").lookup_drafter()
    assert isinstance(d, SuffixDrafter)
    assert (d.num_proposals, d.config.global_tree, d.config.max_depth) == (5, True, 24)
    assert d.name == "suffix:k=5,global=1"
    assert str(DrafterSpec.parse("suffix").with_proposals(15)) == "suffix:k=15"
    assert str(DrafterSpec.parse("suffix:k=3").with_proposals(15)) == "suffix:k=3"
    for bad in ("suffix:x=1", "suffix:global=2", "suffix:k=0", "suffix:prob=2", "suffix:k=a"):
        with pytest.raises(DrafterSpecError, match="bad drafter spec"):
            DrafterSpec.parse(bad)


def test_greedy_decoding_equals_ar_and_online_tau_equals_offline_mal() -> None:
    """`decode` with `suffix` at T = 0 grows one tree with the verified text: its output is
    the target's greedy text and its rounds are the offline evaluator's, prompt by prompt."""
    target = make_random_target("llama", seed=1)
    g = torch.Generator().manual_seed(0)
    prompts = []
    for _ in range(6):
        phrase = torch.randint(3, target.vocab_size, (5,), generator=g).tolist()
        prompts.append(phrase + phrase[:3] + phrase + phrase[:2])
    drafter = SuffixDrafter(4)
    res = decode(target, drafter, prompts, temperature=0.0, max_new_tokens=40)
    ar = [ar_generate(target, p, max_new_tokens=40) for p in prompts]
    assert res.outputs == res.ar_outputs == ar
    assert res.histogram[1] > 0 and res.histogram[-1] > 0, res.histogram  # not vacuous
    rollouts = [
        Rollout(str(i), torch.tensor(p), torch.tensor(o), torch.zeros(len(o)))
        for i, (p, o) in enumerate(zip(prompts, ar, strict=True))
    ]
    stats = offline_stats(score_rollouts(drafter, target, rollouts, 0.0))
    assert stats.per_rollout_rounds.tolist() == [float(n) for n in res.per_prompt_rounds()]
    assert stats.mal == pytest.approx(res.tau, abs=1e-12)
    with pytest.raises(ValueError, match="offline only"):
        decode(target, SuffixDrafter(4, global_tree=True), prompts[:1], max_new_tokens=8)
