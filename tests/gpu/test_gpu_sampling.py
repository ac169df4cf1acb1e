"""Sampled speculative decoding stays lossless with its tensors on the device.

The verifiers (standard and block verification) run on the device with the decode
loop's generators (seeded on the CPU per prompt, as `decoding/loop.py` does) and
with a generator on the device itself; each draws (accepted, token) from the exact
per-draft outcome distribution that tests/decoding/test_verify.py enumerates
(`Instance`, `outcome_dist`), checked by a chi-square test at significance 1e-4. That
enumeration is exactly lossless (test_verify.py checks it against the target's joint in
float64); here the rules' arithmetic on the device in float32 must equal it to 1e-6.
"""

from __future__ import annotations

import pytest
import torch
from test_verify import ALPHA, Instance, K, V, outcome_dist

from blockdraft.decoding.verify import (
    block_stop_probs,
    block_weights,
    standard_accept_probs,
    verify_block,
    verify_standard,
)
from fake_drafter import chi2_pvalue

DRAWS = 3000


def test_rules_arithmetic_on_device_equals_float64(device):
    for seed, zeros in [(0, False), (2, True)]:
        inst = Instance(seed, zeros=zeros)
        for draft in [(0, 1, 2), (2, 2, 0), (1, 1, 1)]:
            exact = inst.rows(draft)
            here = [
                t.to(device, torch.float32) if t.is_floating_point() else t.to(device)
                for t in exact
            ]
            for fn in (standard_accept_probs, block_weights, block_stop_probs):
                got, ref = fn(*here), fn(*exact)
                torch.testing.assert_close(got.cpu().double(), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rule", ["standard", "block"])
@pytest.mark.parametrize("generator_on", ["cpu", "device"])
def test_verifiers_on_device_match_exact_outcome_distribution(device, rule, generator_on):
    inst = Instance(7, sharp_p=1.0, sharp_q=1.0)
    g = torch.Generator(device if generator_on == "device" else "cpu").manual_seed(11)
    fn = verify_standard if rule == "standard" else verify_block
    for draft in [(0, 1, 2), (2, 2, 0)]:
        props, q, p = (t.to(device) for t in inst.rows(draft))
        exact = outcome_dist(inst, draft, rule)
        cells = [(m, y) for m in range(K + 1) for y in range(V)]
        probs = torch.tensor([exact.get(c, 0.0) for c in cells])
        counts = torch.zeros(len(cells))
        for _ in range(DRAWS):
            v = fn(props, q, p, g)
            counts[cells.index((v.accepted, v.token))] += 1
        pval, stat, df = chi2_pvalue(counts, probs)
        assert pval > ALPHA, (draft, stat, df)


def test_the_check_rejects_a_biased_verifier(device):
    """Sanity on the device: always accepting the draft is not lossless and is caught."""
    inst = Instance(7, sharp_p=1.0, sharp_q=1.0)
    g = torch.Generator().manual_seed(11)
    draft = (0, 1, 2)
    props, q, p = (t.to(device) for t in inst.rows(draft))
    exact = outcome_dist(inst, draft, "standard")
    cells = [(m, y) for m in range(K + 1) for y in range(V)]
    counts = torch.zeros(len(cells))
    for _ in range(DRAWS):
        v = verify_standard(props, q.clone().copy_(p[:K]), p, g)  # q := p: accepts too often
        counts[cells.index((v.accepted, v.token))] += 1
    pval, _, _ = chi2_pvalue(counts, torch.tensor([exact.get(c, 0.0) for c in cells]))
    assert pval < ALPHA
