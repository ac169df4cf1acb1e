"""Sampled E2E and EDR micro-steps give the same loss and gradients whatever the row
chunk (`objectives.row_chunks`): two vocabulary rows per chunk against one chunk."""

from __future__ import annotations

import pytest
import torch
from trainkit import random_step_batch, step_inputs

import blockdraft.objectives.cross_entropy as ce
from blockdraft.objectives.registry import make_objective
from blockdraft.training.steps import rounds
from blockdraft.training.steps.block import block_step


class _Settings:
    temperature, top_p, top_k, greedy = 0.8, 0.95, 0, False


@pytest.fixture(scope="module")
def setup():
    return random_step_batch([14, 9])


def _run(step, drafter) -> tuple[torch.Tensor, list[torch.Tensor]]:
    drafter.zero_grad(set_to_none=True)
    out = step()
    out.numerator.backward()
    return out.numerator.detach(), [
        p.grad.clone() for p in drafter.parameters() if p.grad is not None
    ]


@pytest.mark.parametrize("objective", ["e2e", "edr"])
def test_sampled_step_is_the_same_with_any_row_chunk(setup, objective, monkeypatch) -> None:
    target, drafter, batch = setup
    obj = make_objective(objective, **({"mode": "sampling"} if objective == "edr" else {}))

    def step():
        if objective == "e2e":
            inputs = step_inputs(target, drafter, obj, _Settings, num_anchors=6)
            return block_step(inputs, batch, step=1, want_acc=False)
        inputs = step_inputs(target, drafter, obj, _Settings, mode="sampling")
        return rounds.rounds_step(inputs, batch, step=1, want_acc=False)

    results = []
    for elements in (2 * target.vocab_size, 1 << 40):  # two rows per chunk, one chunk
        monkeypatch.setattr(ce, "DEFAULT_CHUNK_ELEMENTS", elements)
        results.append(_run(step, drafter))
    (loss, grads), (ref_loss, ref_grads) = results
    assert ref_loss.item() > 0 and grads
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)
