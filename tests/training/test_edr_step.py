"""EDR micro-step: the chunked no-grad scoring pass equals the unchunked one, and the
dead last round start never gets a drafter block."""

from __future__ import annotations

import pytest
import torch
from trainkit import random_step_batch

from blockdraft.data.anchors import round_start_anchors
from blockdraft.objectives.registry import make_objective
from blockdraft.training import edr_step
from blockdraft.training.draft_forward import DraftForward
from blockdraft.training.objective_step import pad_anchor_lists


class _Settings:
    temperature, top_p, top_k, greedy = 0.8, 1.0, 0, False


@pytest.fixture(scope="module")
def setup():
    return random_step_batch([31, 12, 2, 1])  # long, long, a single (dead) row, no round


@pytest.mark.parametrize("mode", ["sampling", "greedy"])
def test_chunked_scoring_equals_unchunked(setup, mode: str) -> None:
    target, drafter, batch = setup
    fwd = DraftForward(drafter)
    tout = target.forward(
        batch.input_ids, attention_mask=batch.attention_mask.long(), with_logits=True
    )
    starts = [
        round_start_anchors(int(p), int(n))
        for p, n in zip(batch.prompt_lens, batch.response_lens, strict=True)
    ]
    anchors = pad_anchor_lists(starts)
    full = edr_step.score_round_starts(fwd, target, tout, batch, anchors, _Settings, mode, 1000)
    for chunk in (1, 3, 7):
        parts = edr_step.score_round_starts(
            fwd, target, tout, batch, anchors, _Settings, mode, chunk
        )
        for a, b in zip(parts, full, strict=True):
            assert a.shape == b.shape == (*anchors.shape, 3)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="score_chunk"):
        edr_step.score_round_starts(fwd, target, tout, batch, anchors, _Settings, mode, 0)


@pytest.mark.parametrize("mode", ["sampling", "greedy"])
def test_micro_step_is_the_same_with_any_chunk(setup, mode: str, monkeypatch) -> None:
    target, drafter, batch = setup
    fwd = DraftForward(drafter)
    objective = make_objective("edr", mode=mode, max_anchors=6)  # rollouts 0, 1 sampled
    seen: list[torch.Tensor] = []
    original = edr_step._acceptance

    def spy(fwd_, target_, tout_, batch_, anchors, *args, **kwargs):
        seen.append(anchors.clone())
        return original(fwd_, target_, tout_, batch_, anchors, *args, **kwargs)

    monkeypatch.setattr(edr_step, "_acceptance", spy)
    results = []
    for chunk in (None, 4, 1000):
        seen.clear()
        drafter.zero_grad(set_to_none=True)
        out = edr_step.edr_micro_step(
            fwd, drafter, target, objective, batch, seed=0, step=1, settings=_Settings,
            mode=mode, want_acc=False, alpha=0.5, variant="full", score_chunk=chunk,
        )  # fmt: skip
        out.numerator.backward()
        grads = [p.grad.clone() for p in drafter.parameters() if p.grad is not None]
        results.append((out.numerator.detach(), grads, [a.clone() for a in seen]))
    ref_loss, ref_grads, _ = results[-1]
    assert len(results[1][2]) == 8 + 1  # 29 usable starts of rollout 0 in chunks of 4 + grad
    for loss, grads, passes in results:
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for g, r in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)
        # the last round start of each rollout (row L-1) never gets a block
        grad_pass = passes[-1]
        for i, n in enumerate(int(x) for x in batch.response_lens):
            if n >= 3:
                last = int(batch.prompt_lens[i]) + n - 2  # sequence index of x_{L-1}
                assert last not in grad_pass[i].tolist()
                assert int(grad_pass[i].max()) >= 0
    assert ref_loss.item() > 0


@pytest.mark.parametrize("mode", ["sampling", "greedy"])
def test_scoring_of_wrapped_forward_equals_unwrapped(setup, mode: str) -> None:
    """The scoring pass calls an unwrapped DraftForward's drafter directly (no T = 1 log
    q(label)); a wrapped forward (here a subclass, as DDP/FSDP are not DraftForward) goes
    through `forward`: same acceptance and cost, and the target probabilities computed
    once per distinct position equal `target_probs_for`'s per-slot rows."""
    from blockdraft.training.objective_step import label_positions, target_probs_for

    target, drafter, batch = setup

    class Wrapped(DraftForward):
        pass

    tout = target.forward(
        batch.input_ids, attention_mask=batch.attention_mask.long(), with_logits=True
    )
    anchors = pad_anchor_lists(
        [
            round_start_anchors(int(p), int(n))
            for p, n in zip(batch.prompt_lens, batch.response_lens, strict=True)
        ]
    )
    direct = edr_step.score_round_starts(
        DraftForward(drafter), target, tout, batch, anchors, _Settings, mode, 5
    )
    wrapped = edr_step.score_round_starts(
        Wrapped(drafter), target, tout, batch, anchors, _Settings, mode, 5
    )
    for a, b in zip(direct, wrapped, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    positions = label_positions(anchors, 3, batch.input_ids.shape[1])
    torch.testing.assert_close(
        edr_step._target_probs(tout.logits, positions, _Settings),
        target_probs_for(tout.logits, positions, _Settings),
        rtol=0,
        atol=0,
    )


def test_micro_step_of_wrapped_forward_equals_unwrapped(setup) -> None:
    """Sampling mode: an unwrapped DraftForward is run step by step (no autograd graph
    for the statistics' log q(label)); a wrapped one through `forward`. Same loss,
    gradients and statistics."""
    target, drafter, batch = setup

    class Wrapped(DraftForward):
        pass

    objective = make_objective("edr", mode="sampling", max_anchors=6)
    results = []
    for fwd in (DraftForward(drafter), Wrapped(drafter)):
        drafter.zero_grad(set_to_none=True)
        out = edr_step.edr_micro_step(
            fwd, drafter, target, objective, batch, seed=0, step=1, settings=_Settings,
            mode="sampling", want_acc=True, alpha=0.5, variant="full",
        )  # fmt: skip
        out.numerator.backward()
        grads = [p.grad.clone() for p in drafter.parameters() if p.grad is not None]
        results.append((out, grads))
    (a, ga), (b, gb) = results
    torch.testing.assert_close(a.numerator.detach(), b.numerator.detach(), rtol=0, atol=0)
    assert len(ga) == len(gb) > 0
    for x, y in zip(ga, gb, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    torch.testing.assert_close(a.stats.packed(), b.stats.packed(), rtol=0, atol=0)
