"""Greedy targets need only q(x): the shortcuts the trainer uses at large vocabularies
must equal the full-distribution computations they replace (values and gradients)."""

from __future__ import annotations

import torch

from blockdraft.objectives import make_objective
from blockdraft.objectives.edr import acceptance_and_cost, greedy_soft_from_logprobs


def test_e2e_overlap_of_greedy_target_equals_full_distributions():
    torch.manual_seed(1)
    n, k, v = 6, 5, 11
    logits = torch.randn(n, k, v, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, v, (n, k))
    mask = torch.rand(n, k) > 0.2
    target = torch.nn.functional.one_hot(labels, v).to(torch.float64)  # greedy: one-hot p
    obj = make_objective("e2e")

    logq = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    full = obj.loss(logq, mask, draft_logits=logits, target_probs=target).loss
    (g_full,) = torch.autograd.grad(full, logits)
    logq = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    short = obj.loss(logq, mask, overlap=logq.exp()).loss
    (g_short,) = torch.autograd.grad(short, logits)
    torch.testing.assert_close(short, full)
    torch.testing.assert_close(g_short, g_full)


def test_greedy_soft_from_logprobs_equals_acceptance_and_cost():
    torch.manual_seed(2)
    logits = torch.randn(4, 3, 9, dtype=torch.float64)
    ids = torch.randint(0, 9, (4, 3))
    ids[0, 1] = 0  # a stop token: cost 0 there
    a_ref, c_ref = acceptance_and_cost(logits, None, ids, mode="greedy_soft", stop_token_ids=[0])
    logq = torch.log_softmax(logits, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    a, c = greedy_soft_from_logprobs(logq, ids, [0])
    torch.testing.assert_close(a, a_ref)
    torch.testing.assert_close(c, c_ref)
    assert c[0, 1] == 0 and a[0, 1] > 0
