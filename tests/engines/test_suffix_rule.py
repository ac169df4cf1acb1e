"""blockdraft's `suffix` is vLLM's `method: suffix`, proposal for proposal.

The reference is Arctic Inference's `SuffixDecodingCache` (the C++ suffix tree vLLM's
`SuffixDecodingProposer` calls), driven as vLLM drives it: start a request with its
prompt, add each verified token, speculate on the last `depth` tokens; with the global
cache on, earlier requests' responses stay in it. Random texts over small vocabularies
make suffixes recur and child counts tie, where Arctic's sibling order decides.
"""

from __future__ import annotations

import random

import pytest

import blockdraft.drafters.suffix as suffix_module
from blockdraft.drafters.suffix import SuffixDrafter


def arctic_rounds(
    rollouts: list[tuple[list[int], list[int]]], d: SuffixDrafter
) -> list[list[list[int]]]:
    """Each rollout's proposals per round from `SuffixDecodingCache`: start the request with
    its prompt, add each verified token, speculate on the last `depth` tokens."""
    np = pytest.importorskip("numpy")
    cache_module = pytest.importorskip("arctic_inference.suffix_decoding")
    c = d.config
    cache = cache_module.SuffixDecodingCache(
        max_tree_depth=c.max_depth, max_cached_requests=-1 if c.global_tree else 0
    )
    out = []
    for i, (prompt, response) in enumerate(rollouts):
        cache.start_request(i, np.array(prompt, dtype=np.int32))
        rows = []
        for n in range(1, len(response) + 1):
            cache.add_active_response(i, np.array([response[n - 1]], dtype=np.int32))
            text = prompt + response[:n]
            draft = cache.speculate(
                i,
                np.array(text[-c.max_depth :], dtype=np.int32),
                max_spec_tokens=c.num_proposals,
                max_spec_factor=c.max_spec_factor,
                min_token_prob=c.min_token_prob,
            )
            if n < len(response):  # the last step's draft is never verified
                rows.append(list(draft.token_ids))
        cache.stop_request(i)
        out.append(rows)
    return out


def random_rollouts(rng: random.Random) -> list[tuple[list[int], list[int]]]:
    vocab = rng.randint(2, 6)  # small vocabularies: suffixes recur, counts tie
    return [
        (
            [rng.randrange(vocab) for _ in range(rng.randint(1, 30))],
            [rng.randrange(vocab) for _ in range(rng.randint(1, 40))],
        )
        for _ in range(rng.randint(1, 4))
    ]


def mismatches(rng: random.Random, trials: int) -> tuple[int, int]:
    """(rounds whose proposal differs from Arctic's, rounds compared) on random sets."""
    bad = total = 0
    for _ in range(trials):
        d = SuffixDrafter(
            rng.choice([1, 3, 7, 24]), rng.choice([2, 4, 8, 24]), rng.choice([0.5, 1.0, 2.0]),
            rng.choice([0.0, 0.1, 0.3, 0.5]), rng.random() < 0.5,
        )  # fmt: skip
        rollouts = random_rollouts(rng)
        want = arctic_rounds(rollouts, d)
        got = d.proposals_of_rollouts(rollouts)
        for rows, props in zip(want, got, strict=True):
            for n, row in enumerate(rows):
                total += 1
                bad += [t for t in props[n].tolist() if t >= 0] != row
    return bad, total


def test_proposals_are_arctic_inferences_proposal_for_proposal() -> None:
    pytest.importorskip("arctic_inference.suffix_decoding")
    bad, total = mismatches(random.Random(0), 400)
    assert total > 10_000
    assert bad == 0


def test_the_comparison_tells_a_plain_tie_order_apart(monkeypatch) -> None:
    """Children with equal counts in first-seen order (a stable sort) is not Arctic's order:
    the comparison above must catch it, so the sibling moves are what it checks."""
    pytest.importorskip("arctic_inference.suffix_decoding")

    def stable_sort(order: list, node: object) -> None:
        node.count += 1
        order.sort(key=lambda n: -n.count)

    monkeypatch.setattr(suffix_module, "_increment", stable_sort)
    bad, _ = mismatches(random.Random(0), 400)
    assert bad > 50
