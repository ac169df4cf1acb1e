"""Verification rules: exact enumeration of one round, Monte Carlo of the samplers.

One round is lossless iff "emit the round's tokens, then continue from the target" gives
exactly the target's joint distribution over the next K+1 tokens. We enumerate every
draft (V^K of them) with its probability under q, the verifier's stopping distribution
and the residual, and compare with the target's joint in float64 to 1e-12. Then the
actual sampling verifiers are checked against the exact per-draft outcome distribution
with a chi-square test at significance 1e-4.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from blockdraft.decoding.verify import (
    block_residual,
    block_stop_probs,
    block_weights,
    standard_accept_probs,
    verify_block,
    verify_greedy,
    verify_standard,
)
from fake_drafter import chi2_pvalue

V, K = 3, 3
ALPHA = 1e-4  # chi-square significance


def _dist(g: torch.Generator, sharp: float) -> torch.Tensor:
    return torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * sharp, -1)


class Instance:
    """Target p(.|prefix) and drafter q(.|prefix) for every prefix inside one round."""

    def __init__(self, seed: int, sharp_p: float = 1.5, sharp_q: float = 1.5, zeros: bool = False):
        g = torch.Generator().manual_seed(seed)
        self.p, self.q = {}, {}
        for n in range(K + 1):
            for pre in itertools.product(range(V), repeat=n):
                p = _dist(g, sharp_p)
                q = _dist(g, sharp_q)
                if zeros:  # disjoint-ish supports exercise the edge cases
                    p[int(torch.randint(V, (1,), generator=g))] = 0
                    q[int(torch.randint(V, (1,), generator=g))] = 0
                    p, q = p / p.sum(), q / q.sum()
                self.p[pre], self.q[pre] = p, q

    def rows(self, draft: tuple[int, ...]):
        p = torch.stack([self.p[draft[:i]] for i in range(K + 1)])
        q = torch.stack([self.q[draft[:i]] for i in range(K)])
        return torch.tensor(draft), q, p

    def draft_prob(self, draft) -> float:
        out = 1.0
        for i, y in enumerate(draft):
            out *= float(self.q[draft[:i]][y])
        return out

    def target_joint(self, seq) -> float:
        out = 1.0
        for i, y in enumerate(seq):
            out *= float(self.p[seq[:i]][y])
        return out


def outcome_dist(inst: Instance, draft, rule: str, accept_fn=standard_accept_probs):
    """Exact P(accepted = m, extra token = y | draft) for one rule -> {(m, y): prob}."""
    props, q, p = inst.rows(draft)
    out: dict[tuple[int, int], float] = {}
    if rule == "standard":
        a = accept_fn(props, q, p)
        stop = [float(torch.prod(a[:m]) * (1 - a[m])) for m in range(K)] + [float(torch.prod(a))]
        resid = []
        for m in range(K):
            r = (p[m] - q[m]).clamp_min(0)
            resid.append(r / r.sum() if r.sum() > 0 else p[m])
    else:
        h = torch.cat([torch.ones(1, dtype=p.dtype), block_stop_probs(props, q, p)])  # h_0 = 1
        stop = [float(h[m] * torch.prod(1 - h[m + 1 :])) for m in range(K + 1)]
        w = block_weights(props, q, p)
        resid = []
        for m in range(K):
            r = block_residual(w[m], p[m], q[m])
            resid.append(r / r.sum() if r.sum() > 0 else torch.full_like(r, float("nan")))
    resid.append(p[K])
    for m in range(K + 1):
        if stop[m] <= 0:
            continue
        for y in range(V):
            out[(m, y)] = out.get((m, y), 0.0) + stop[m] * float(resid[m][y])
    return out


def emitted_then_target(inst: Instance, rule: str, accept_fn=standard_accept_probs):
    """Distribution of (round output, continued by target sampling) over K+1 tokens."""
    joint: dict[tuple[int, ...], float] = {}
    for draft in itertools.product(range(V), repeat=K):
        pd = inst.draft_prob(draft)
        if pd == 0:
            continue
        for (m, y), pr in outcome_dist(inst, draft, rule, accept_fn).items():
            emitted = draft[:m] + (y,)
            for rest in itertools.product(range(V), repeat=K + 1 - len(emitted)):
                seq = emitted + rest
                cont = (
                    inst.target_joint(seq) / inst.target_joint(emitted)
                    if inst.target_joint(emitted) > 0
                    else 0.0
                )
                joint[seq] = joint.get(seq, 0.0) + pd * pr * cont
    return joint


@pytest.mark.parametrize("rule", ["standard", "block"])
@pytest.mark.parametrize("seed,zeros", [(0, False), (1, False), (2, True), (3, True)])
def test_one_round_is_exactly_lossless(rule: str, seed: int, zeros: bool) -> None:
    inst = Instance(seed, zeros=zeros)
    joint = emitted_then_target(inst, rule)
    for seq in itertools.product(range(V), repeat=K + 1):
        assert joint.get(seq, 0.0) == pytest.approx(inst.target_joint(seq), abs=1e-12), seq
    assert sum(joint.values()) == pytest.approx(1.0, abs=1e-12)


def test_a_broken_rule_is_caught() -> None:
    """Sanity of the harness: accepting with prob min(1, p/q)**0.5 is not lossless."""
    inst = Instance(0)
    joint = emitted_then_target(inst, "standard", lambda *a: standard_accept_probs(*a) ** 0.5)
    seqs = itertools.product(range(V), repeat=K + 1)
    assert max(abs(joint.get(s, 0.0) - inst.target_joint(s)) for s in seqs) > 1e-3


def _expected_accepted(inst: Instance, rule: str) -> float:
    total = 0.0
    for draft in itertools.product(range(V), repeat=K):
        pd = inst.draft_prob(draft)
        total += pd * sum(m * pr for (m, _), pr in outcome_dist(inst, draft, rule).items())
    return total


def test_block_verification_never_accepts_less_on_average() -> None:
    """Exact expectations over drafts: E[block] >= E[standard] on every instance, and
    strictly greater on some (otherwise the test could not tell the rules apart)."""
    gains = []
    for seed in range(12):
        inst = Instance(100 + seed, sharp_p=2.0, sharp_q=2.0, zeros=seed % 3 == 0)
        std, blk = _expected_accepted(inst, "standard"), _expected_accepted(inst, "block")
        assert blk >= std - 1e-12, (seed, std, blk)
        gains.append(blk - std)
    assert max(gains) > 1e-3


@pytest.mark.parametrize("rule", ["standard", "block"])
def test_samplers_match_exact_outcome_distribution(rule: str) -> None:
    """The sampling verifiers draw (accepted, token) from the enumerated distribution."""
    inst = Instance(7, sharp_p=1.0, sharp_q=1.0)
    g = torch.Generator().manual_seed(11)
    fn = verify_standard if rule == "standard" else verify_block
    for draft in [(0, 1, 2), (2, 2, 0)]:
        props, q, p = inst.rows(draft)
        exact = outcome_dist(inst, draft, rule)
        cells = [(m, y) for m in range(K + 1) for y in range(V)]
        probs = torch.tensor([exact.get(c, 0.0) for c in cells])
        counts = torch.zeros(len(cells))
        n = 3000
        for _ in range(n):
            v = fn(props, q, p, g)
            counts[cells.index((v.accepted, v.token))] += 1
        pval, stat, df = chi2_pvalue(counts, probs)
        assert pval > ALPHA, (draft, stat, df)


def test_greedy_rule() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 9.0], [1.0, 2.0, 0.0]])
    assert verify_greedy(torch.tensor([1, 0, 2]), logits).__dict__ == {"accepted": 3, "token": 1}
    assert verify_greedy(torch.tensor([1, 1, 2]), logits).__dict__ == {"accepted": 1, "token": 0}
    assert verify_greedy(torch.tensor([2, 0, 2]), logits).__dict__ == {"accepted": 0, "token": 1}


def test_shape_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="K\\+1"):
        verify_greedy(torch.tensor([1, 2]), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="draft distributions"):
        verify_standard(torch.tensor([1, 2]), torch.zeros(3, 3), torch.zeros(3, 3))
