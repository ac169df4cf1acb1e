"""Sampling E2E/EDR from the rollouts' stored distributions: a rollout written with
`--store-topk K` under a top-k cutoff of at most K holds each token's whole sampling
distribution, so the steps read it there and never ask the target for logits; their loss
and gradients equal the steps that process the target's logits (draft space and target
space). A cutoff above K (or none) keeps the logits."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from trainkit import draft_space_step_setup, step_inputs

from blockdraft.objectives.registry import make_objective
from blockdraft.sampling import SamplingSettings, sampling_logprobs
from blockdraft.training.draft_space import DraftSpace
from blockdraft.training.feature_sources import OnlineTargetFeatures, needs_target_logits
from blockdraft.training.steps import rounds
from blockdraft.training.steps.block import block_step
from blockdraft.training.target_distributions import stored_topk

SETTINGS = SamplingSettings(temperature=0.8, top_p=0.9, top_k=12)


class _Recording(OnlineTargetFeatures):
    """The online target, recording whether each call asked for logits."""

    def __init__(self, target) -> None:  # type: ignore[no-untyped-def]
        super().__init__(target)
        self.asked: list[bool] = []

    def features(self, batch, *, with_logits=False, logits_to_keep=0):  # type: ignore[no-untyped-def]
        self.asked.append(with_logits)
        return super().features(batch, with_logits=with_logits, logits_to_keep=logits_to_keep)


def _with_stored(target, batch, k: int):  # type: ignore[no-untyped-def]
    """The batch with the top-k of each token's sampling distribution stored at its index,
    as `blockdraft rollout --store-topk k` writes it (the logits at i - 1 draw token i)."""
    logits = target.forward(
        batch.input_ids, attention_mask=batch.attention_mask.long(), with_logits=True
    ).logits
    logp = sampling_logprobs(logits.float(), SETTINGS)
    top = torch.topk(logp, k, dim=-1)
    b, t = batch.input_ids.shape
    ids = torch.full((b, t, k), -1, dtype=torch.long)
    lps = torch.full((b, t, k), float("-inf"))
    ids[:, 1:], lps[:, 1:] = top.indices[:, :-1], top.values[:, :-1]
    resp = batch.loss_mask[..., None]  # stored on response tokens only
    ids = torch.where(resp, ids, torch.full_like(ids, -1))
    lps = torch.where(resp, lps, torch.full_like(lps, float("-inf")))
    return dataclasses.replace(batch, topk_ids=ids, topk_logprobs=lps)


@pytest.fixture(scope="module")
def setup():  # type: ignore[no-untyped-def]
    return draft_space_step_setup()


def _step(target, drafter, batch, objective: str):  # type: ignore[no-untyped-def]
    source = _Recording(target)
    obj = make_objective(objective, **({"mode": "sampling"} if objective == "edr" else {}))
    drafter.zero_grad(set_to_none=True)
    if objective == "e2e":
        inputs = step_inputs(target, drafter, obj, SETTINGS, features=source, num_anchors=9)
        out = block_step(inputs, batch, step=1, want_acc=True)
    else:
        inputs = step_inputs(target, drafter, obj, SETTINGS, features=source, mode="sampling")
        out = rounds.rounds_step(inputs, batch, step=1, want_acc=True)
    out.numerator.backward()
    grads = [p.grad.clone() for p in drafter.parameters() if p.grad is not None]
    return out.numerator.detach(), grads, source.asked


@pytest.mark.parametrize("space", ["draft", "target"])
@pytest.mark.parametrize("objective", ["e2e", "edr"])
def test_step_on_stored_distributions_equals_the_logits_step(
    setup, objective, space, monkeypatch
) -> None:
    target, drafter, batch = setup
    if space == "target":
        monkeypatch.setattr(DraftSpace, "of", classmethod(lambda cls, *a, **k: None))
    ref_loss, ref_grads, ref_asked = _step(target, drafter, batch, objective)
    assert any(ref_asked) and ref_loss.item() > 0
    stored = _with_stored(target, batch, SETTINGS.top_k)
    loss, grads, asked = _step(target, drafter, stored, objective)
    assert asked and not any(asked)  # the target ran for features only
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert grads and len(grads) == len(ref_grads)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


def test_a_cutoff_above_the_stored_k_keeps_the_logits(setup) -> None:
    target, drafter, batch = setup
    short = _with_stored(target, batch, SETTINGS.top_k - 1)
    assert stored_topk(short, SETTINGS) is None
    assert stored_topk(short, dataclasses.replace(SETTINGS, top_k=0)) is None  # no cutoff
    assert stored_topk(_with_stored(target, batch, SETTINGS.top_k), SETTINGS) is not None
    _, _, asked = _step(target, drafter, short, "e2e")
    assert asked == [True]


def test_feature_source_choice_follows_the_stored_distributions() -> None:
    edr = make_objective("edr", mode="sampling")
    whole = SimpleNamespace(
        rollouts=[SimpleNamespace(topk_ids=torch.zeros(3, 20))], settings=SETTINGS
    )
    assert not needs_target_logits(edr, "sampling", whole)
    short = SimpleNamespace(
        rollouts=[SimpleNamespace(topk_ids=torch.zeros(3, 8))], settings=SETTINGS
    )
    assert needs_target_logits(edr, "sampling", short)
    none = SimpleNamespace(rollouts=[SimpleNamespace(topk_ids=None)], settings=SETTINGS)
    assert needs_target_logits(edr, "sampling", none)
    assert not needs_target_logits(edr, "greedy", none)
