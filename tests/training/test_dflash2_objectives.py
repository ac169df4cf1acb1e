"""Every objective trains DFlash2's selector teacher-forced and weights its unary logits
the same way: the micro-steps' gradients equal hand-built ones.

D-PACE: weights from the selector's q of the label (0 outside the candidates), applied to
the selector's and the unary cross-entropy. E2E: the gradient of the block objective at
the selector's overlaps, applied to both overlaps. EDR: the exact rounds objective of the
selector's acceptances (the slow autograd recursion, not the TD surrogate), its
derivatives applied to the unary acceptances too.
"""

from __future__ import annotations

import pytest
import torch
from trainkit import (
    every_round_start,
    rounds_batch,
    step_inputs,
    target_output,
    wrapped_forward_class,
)

from blockdraft.data.rollouts.store import Rollout
from blockdraft.drafters.dflash import DrafterConfig
from blockdraft.drafters.dflash2 import DFlash2Drafter
from blockdraft.objectives.dpace import dpace_weights
from blockdraft.objectives.e2e import e2e_from_overlap
from blockdraft.objectives.edr.recursion import rounds_objective
from blockdraft.objectives.registry import make_objective
from blockdraft.training.batching import collate
from blockdraft.training.draft_forward import DraftForward
from blockdraft.training.steps.anchored_blocks import labels_and_prev
from blockdraft.training.steps.block import block_step, sampled_anchors
from blockdraft.training.steps.rounds import rounds_step
from random_targets import make_random_target

BLOCK, TOP_K = 4, 48


class _Greedy:
    temperature, top_p, top_k, greedy = 0.0, 1.0, 0, True


@pytest.fixture(scope="module", params=[None, 0.6], ids=["full-vocab", "draft-vocab"])
def setup(request):
    """A full-vocabulary drafter, and one with a reduced draft vocabulary (60% of the
    target's ids, so that random labels and predecessors often fall outside it)."""
    torch.manual_seed(0)
    target = make_random_target("qwen3", hidden_size=32, num_layers=2, num_heads=2)
    draft = None if request.param is None else int(request.param * target.vocab_size)
    cfg = DrafterConfig.for_target(target, num_layers=1, block_size=BLOCK, arch="dflash2",
                                   selector_rank=4, selector_top_k=TOP_K,
                                   draft_vocab_size=draft)  # fmt: skip
    drafter = DFlash2Drafter(cfg).bind_target(target)
    if draft is not None:
        ids = torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(5))
        drafter.set_draft_vocab(ids[:draft].sort().values)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "conv" in name or "hidden_projection" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif p.dim() == 2 and "codebook" not in name:
                p.mul_(20.0)  # confident unary logits: labels often among the candidates
    gen = torch.Generator().manual_seed(3)
    rows = []
    for i, n in enumerate([9, 6, 3]):
        prompt = torch.randint(3, target.vocab_size, (5,), generator=gen)
        resp = torch.randint(3, target.vocab_size, (n,), generator=gen)
        rows.append(Rollout(f"r{i}", prompt, resp, torch.full((n,), -1.0)))
    return target, drafter, collate(rows, list(range(len(rows))), 0, 4096)


def _grads(drafter, loss):
    drafter.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


def _assert_same(got, want, atol=1e-7, scale_atol=0.0):
    """Element-wise close; `scale_atol` adds an absolute slack relative to each gradient's
    largest entry (float32 rounding of a long sum lands on its small entries too)."""
    assert set(got) == set(want)
    for name in want:
        tol = max(atol, scale_atol * float(want[name].abs().max()))
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=tol, msg=name)


def _pieces(target, drafter, batch, anchors):
    """(mask, q_sel(x), q_u(x)) of every block slot, teacher-forced, by the drafter's own
    public functions, in target space. The mask leaves out labels outside a reduced draft
    vocabulary (no cross-entropy term; q = 0 there)."""
    tout = target.forward(batch.input_ids, attention_mask=batch.attention_mask.long())
    labels, mask, prev = labels_and_prev(batch, anchors, BLOCK)
    hidden = drafter.forward_blocks(tout.features, batch.input_ids, anchors)
    x = labels.clamp_min(0).unsqueeze(-1)
    q_sel = torch.softmax(drafter.compute_logits(hidden, prev), -1).gather(-1, x)[..., 0]
    unary = drafter.to_target_vocab(drafter.unary_logits(hidden))
    q_u = torch.softmax(unary, -1).gather(-1, x)[..., 0]
    ids = drafter.draft_ids
    in_vocab = torch.ones_like(mask) if ids is None else torch.isin(labels, ids)
    if ids is not None:
        assert (mask & ~in_vocab).any()  # the case occurs
    return mask & in_vocab & (anchors >= 0)[..., None], q_sel, q_u


def test_dpace_weights_both_terms_by_the_selector(setup):
    target, drafter, batch = setup
    obj = make_objective("dpace", alpha=0.5)
    inputs = step_inputs(target, drafter, obj, _Greedy, num_anchors=4)
    out = block_step(inputs, batch, step=2, want_acc=False)
    got = _grads(drafter, out.numerator / out.denominator)
    anchors = sampled_anchors(batch, 4, BLOCK, 0, 2)
    mask, q_sel, q_u = _pieces(target, drafter, batch, anchors)
    inside = q_sel > 0
    assert inside[mask].any() and (~inside[mask]).any()  # both cases occur
    w = dpace_weights(torch.where(mask, q_sel, 0.0).detach(), alpha=0.5, mask=mask)
    ce = -torch.where(inside, q_sel.clamp_min(1e-30).log(), 0.0) - q_u.clamp_min(1e-30).log()
    want = _grads(drafter, (w * torch.where(mask, ce, 0.0)).sum() / w.sum())
    # the target's top layer (1 of 2) feeds its raw output, unnormalised: gradients up to
    # ~4, whose float32 sums round their smallest entries by ~1e-7 of the largest
    _assert_same(got, want, scale_atol=1e-6)


def test_e2e_applies_the_selector_gradient_to_both_overlaps(setup):
    target, drafter, batch = setup
    obj = make_objective("e2e", greedy_temperature=1.0)  # the reference below is at beta = 1
    inputs = step_inputs(target, drafter, obj, _Greedy, num_anchors=4)
    out = block_step(inputs, batch, step=3, want_acc=False)
    got = _grads(drafter, out.numerator / out.denominator)
    anchors = sampled_anchors(batch, 4, BLOCK, 0, 3)
    mask, q_sel, q_u = _pieces(target, drafter, batch, anchors)
    valid = anchors >= 0
    point = q_sel.detach()[valid].requires_grad_()
    (grad,) = torch.autograd.grad(e2e_from_overlap(point, mask[valid]), point)
    want = _grads(drafter, (grad * (q_sel[valid] + q_u[valid])).sum())
    _assert_same(got, want)


def test_edr_exact_rounds_gradient_for_selector_and_unary(setup):
    target, drafter, batch = setup
    obj = make_objective(
        "edr", mode="greedy", max_anchors=64, anchor_sampler="uniform", greedy_temperature=1.0
    )
    out = rounds_step(step_inputs(target, drafter, obj, _Greedy), batch, step=1, want_acc=False)
    got = _grads(drafter, out.numerator)
    anchors = every_round_start(batch)
    _, q_sel, q_u = _pieces(target, drafter, batch, anchors)
    stops = torch.tensor(target.stop_token_ids)
    labels, _, _ = labels_and_prev(batch, anchors, BLOCK)
    total = 0.0
    for i in range(anchors.shape[0]):
        rows = int((anchors[i] >= 0).sum())
        stop = torch.isin(labels[i, :rows], stops)
        a_sel, a_u = q_sel[i, :rows], q_u[i, :rows]
        c_sel, c_u = (torch.where(stop, 0.0, 1 - a) for a in (a_sel, a_u))
        pa, pc = a_sel.detach().requires_grad_(), c_sel.detach().requires_grad_()
        ga, gc = torch.autograd.grad(rounds_objective(pa, pc), (pa, pc))
        total = total + rounds_objective(a_sel, c_sel) + (ga * a_u + gc * c_u).sum()
    want = _grads(drafter, total)
    # float32 rounding of a longer recursion: up to 4e-6 of a gradient's scale with AVX2
    # kernels (AVX-512 rounds closer); a wrong term would differ by its whole size
    _assert_same(got, want, atol=5e-7, scale_atol=1e-5)


class _Sampling:
    temperature, top_p, top_k, greedy = 0.8, 1.0, 0, False


class _SamplingTopK:
    temperature, top_p, top_k, greedy = 0.8, 1.0, 6, False


# (top-k with the `gradient` sampler: the float32 roundings below can draw other round
# starts, here 1.5% apart in the loss with or without the support path)
@pytest.mark.parametrize(
    ("sampler", "settings"),
    [("uniform", _Sampling), ("gradient", _Sampling), ("uniform", _SamplingTopK)],
    ids=["uniform", "gradient", "uniform-top-k"],
)
def test_sampling_edr_paths_agree_and_train_the_unary_logits(setup, sampler, settings):
    """The unwrapped step (the selector scored on its candidates, the unary inside
    checkpointed row chunks; against a top-k target on its support, `support_scores`) and
    a wrapped one (through `forward`, `[N, K, V]` logits) give the same loss, gradients and
    logged weight profile."""
    target, drafter, batch = setup

    Wrapped = wrapped_forward_class()

    obj = make_objective("edr", mode="sampling", max_anchors=3, anchor_sampler=sampler)
    results, profiles = [], []
    for fwd in (DraftForward(drafter), Wrapped(drafter)):
        # the same scoring passes for both (by default an unwrapped step scores in one
        # pass, a wrapped one in passes of max_anchors: other rounding, other PPS draws)
        inputs = step_inputs(
            target, drafter, obj, settings, fwd=fwd, mode="sampling", score_chunk=3
        )
        out = rounds_step(inputs, batch, step=1, want_acc=True)
        results.append((out.numerator.detach(), _grads(drafter, out.numerator)))
        profiles.append(out.stats.profile_sum)
    (na, ga), (nb, gb) = results
    # a logged step: the weight profile comes from log q(label) of the selector
    assert profiles[0].sum() > 0
    torch.testing.assert_close(profiles[0], profiles[1], rtol=1e-4, atol=1e-6)
    # the `gradient` sampler's PPS sizes come from moments the unwrapped pass sums over the
    # k candidates and the wrapped one over the vocabulary: float32 roundings of cancelling
    # sums that move the inclusion weights (the moments themselves: the test below)
    if sampler == "uniform":
        torch.testing.assert_close(na, nb)
        # the support path sums the top-k scores in another order: with AVX2 kernels up to
        # 4e-7 of a gradient's scale (AVX-512 rounds closer)
        _assert_same(ga, gb, scale_atol=1e-5)
    else:
        torch.testing.assert_close(na, nb, rtol=2e-3, atol=1e-5)
        _assert_same(ga, gb, scale_atol=2e-3)
    assert all(torch.isfinite(g).all() for g in ga.values())
    assert ga["fc.weight"].abs().sum() > 0
    assert ga["candidate_selector.hidden_projection.weight"].abs().sum() > 0


def test_sampling_e2e_runs_on_dflash2(setup):
    target, drafter, batch = setup
    inputs = step_inputs(target, drafter, make_objective("e2e"), _Sampling, num_anchors=4)
    out = block_step(inputs, batch, step=1, want_acc=False)
    grads = _grads(drafter, out.numerator / out.denominator)
    assert torch.isfinite(out.numerator) and grads["fc.weight"].abs().sum() > 0


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_compact_selector_logq_equals_the_full_logits_one(setup, softcap):
    """Without full logits (cross-entropy, greedy EDR) log q(label) of selector and unary
    come from the candidates' head rows and the chunked head: same values and gradients as
    from `[N, K, V]` logits."""
    target, drafter, batch = setup
    drafter.config.final_logit_softcapping = softcap
    try:
        tout = target.forward(batch.input_ids, attention_mask=batch.attention_mask.long())
        anchors = sampled_anchors(batch, 4, BLOCK, 0, 5)
        labels, _, prev = labels_and_prev(batch, anchors, BLOCK)
        fwd = DraftForward(drafter)
        outs = []
        for full in (False, True):
            _, logq, _, (_, logq_u) = fwd(
                tout.features, batch.input_ids, anchors, labels, prev, full, unary=True
            )
            loss = (logq * torch.arange(logq.numel()).view(logq.shape).sin()).sum() + logq_u.sum()
            outs.append((logq.detach(), logq_u.detach(), _grads(drafter, loss)))
        (a, au, ga), (b, bu, gb) = outs
        assert (a == -30.0).any() and (a > -30.0).any()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(au, bu, rtol=1e-5, atol=1e-5)
        _assert_same(ga, gb, atol=1e-5)  # another summation order (chunked head)
    finally:
        drafter.config.final_logit_softcapping = None


def test_scoring_pass_on_the_candidates_equals_the_dense_one(setup):
    """The unwrapped no-grad scoring pass scores the selector's k candidates only
    (`candidate_scores`); a wrapped forward compares `[N, K, V]` logits (-inf off the
    candidates) with the target rows: the same A, c and gradient moments, with stop tokens
    (one inside a reduced draft vocabulary, one maybe outside) among the labels."""
    from blockdraft.training.steps import rounds

    target, drafter, batch = setup

    Wrapped = wrapped_forward_class()

    tout = target_output(target, batch)
    anchors = every_round_start(batch)
    labels, _, _ = labels_and_prev(batch, anchors, BLOCK)
    stops = [int(labels[0, 0, 1]), int(labels[1, 1, 2])]  # realised labels are stops
    outs = [
        rounds.score_round_starts(
            rounds_batch(fwd, stops, tout, batch, _Sampling, "sampling"), anchors, 64, moments=True
        )
        for fwd in (DraftForward(drafter), Wrapped(drafter))
    ]
    for got, want in zip(*outs, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    acc, cost, moments = outs[0]
    valid = (anchors >= 0)[..., None].expand_as(acc)
    assert (acc[valid] > 0).any() and (acc[valid] == 0).any()  # labels in and off the candidates
    assert (cost[valid] == 0).any() and (moments[..., 1][valid] > 0).any()
