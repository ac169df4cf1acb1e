"""Greedy E2E at a drafter temperature (`objective.greedy_temperature`): the block step's
overlap is `softmax(z / beta)(x)` (greedy EDR's relaxation), so its loss and gradient
must equal E2E computed independently from the drafter's logits on the same blocks."""

from __future__ import annotations

import pytest
import torch
from trainkit import random_step_batch, step_inputs

from blockdraft.objectives.e2e import e2e_from_overlap
from blockdraft.objectives.registry import make_objective
from blockdraft.training.steps.anchored_blocks import labels_and_prev
from blockdraft.training.steps.block import block_step, sampled_anchors


class _Greedy:
    temperature, top_p, top_k, greedy = 0.0, 1.0, 0, True


@pytest.mark.parametrize("beta", [1.0, 0.4])
def test_greedy_e2e_step_uses_the_tempered_overlap(beta):
    target, drafter, batch = random_step_batch([20, 11, 6])
    obj = make_objective("e2e", greedy_temperature=beta)
    drafter.zero_grad(set_to_none=True)
    inputs = step_inputs(target, drafter, obj, _Greedy, num_anchors=5)
    out = block_step(inputs, batch, step=3, want_acc=False)
    out.numerator.backward()
    got = [p.grad.clone() for p in drafter.parameters() if p.grad is not None]

    drafter.zero_grad(set_to_none=True)
    anchors = sampled_anchors(batch, 5, drafter.config.block_size, 0, 3)
    labels, mask, prev = labels_and_prev(batch, anchors, drafter.config.block_size)
    tout = target.forward(batch.input_ids, attention_mask=batch.attention_mask.long())
    hidden = drafter.forward_blocks(tout.features, batch.input_ids, anchors)
    z = drafter.compute_logits(hidden, prev) / beta
    overlap = torch.log_softmax(z, -1).gather(-1, labels.clamp_min(0)[..., None])[..., 0].exp()
    valid = anchors >= 0
    want = e2e_from_overlap(overlap[valid], mask[valid]) * float(mask[valid].any(-1).sum())
    want.backward()
    ref = [p.grad.clone() for p in drafter.parameters() if p.grad is not None]
    torch.testing.assert_close(out.numerator.float(), want.detach().float(), rtol=1e-5, atol=1e-6)
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-7)
