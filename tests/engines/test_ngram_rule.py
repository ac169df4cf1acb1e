"""blockdraft's prompt lookup is vLLM's `ngram` method, proposal for proposal.

The reference is vLLM's own proposer function (an independent implementation: KMP over
the reversed text), called on random texts over small vocabularies, where suffixes recur
often and ties between occurrences decide the proposal.
"""

import random

import numpy as np
import pytest
from enginekit import needs_vllm

from blockdraft.drafters.ngram import NgramDrafter


def vllm_ngram_function():
    from vllm.v1.spec_decode import ngram_proposer

    fn = ngram_proposer._find_longest_matched_ngram_and_propose_tokens
    return getattr(fn, "py_func", fn)  # the numba-compiled function's Python source


@needs_vllm
@pytest.mark.parametrize("k,max_n,min_n", [(7, 3, 1), (5, 2, 2), (3, 4, 2)])
def test_default_rule_is_vllms(k: int, max_n: int, min_n: int) -> None:
    vllm_propose = vllm_ngram_function()
    ours = NgramDrafter(k, max_n, min_n)
    latest = NgramDrafter(k, max_n, min_n, match="latest")
    rng = random.Random(0)
    latest_differs = 0
    for _ in range(1500):
        seq = [rng.randrange(rng.randint(2, 6)) for _ in range(rng.randint(1, 60))]
        want = vllm_propose(np.array(seq, dtype=np.int32), min_n, max_n, 10**6, k).tolist()
        assert ours.propose(seq) == want, seq
        latest_differs += latest.propose(seq) != want
    assert latest_differs > 100  # the comparison can tell the two rules apart
