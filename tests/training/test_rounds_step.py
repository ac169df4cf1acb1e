"""EDR micro-step: the chunked no-grad scoring pass equals the unchunked one, and the
dead last round start never gets a drafter block."""

from __future__ import annotations

import pytest
import torch
from trainkit import (
    every_round_start,
    random_step_batch,
    rounds_batch,
    step_inputs,
    target_output,
    wrapped_forward_class,
)

from blockdraft.data.anchors import round_start_anchors
from blockdraft.objectives import edr
from blockdraft.objectives.registry import make_objective
from blockdraft.training import draft_space
from blockdraft.training.draft_forward import DraftForward
from blockdraft.training.steps import proposal_scores, rounds


class _Settings:
    temperature, top_p, top_k, greedy = 0.8, 1.0, 0, False


@pytest.fixture(scope="module")
def setup():
    return random_step_batch([31, 12, 2, 1])  # long, long, a single (dead) row, no round


@pytest.mark.parametrize("mode", ["sampling", "greedy"])
def test_chunked_scoring_equals_unchunked(setup, mode: str) -> None:
    target, drafter, batch = setup
    fwd = DraftForward(drafter)
    tout = target_output(target, batch)
    anchors = every_round_start(batch)
    full = rounds.score_round_starts(
        rounds_batch(fwd, target.stop_token_ids, tout, batch, _Settings, mode), anchors, 1000
    )
    for chunk in (1, 3, 7):
        parts = rounds.score_round_starts(
            rounds_batch(fwd, target.stop_token_ids, tout, batch, _Settings, mode), anchors, chunk
        )
        for a, b in zip(parts, full, strict=True):
            assert a.shape == b.shape == (*anchors.shape, 3)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="score_chunk"):
        rounds.score_round_starts(
            rounds_batch(fwd, target.stop_token_ids, tout, batch, _Settings, mode), anchors, 0
        )


MODES_AND_SAMPLERS = [
    ("sampling", "uniform"),
    ("sampling", "occupancy"),
    ("greedy", "uniform"),
    ("greedy", "occupancy"),
    ("sampling", "gradient"),
    ("greedy", "gradient"),
]


@pytest.mark.parametrize(("mode", "sampler"), MODES_AND_SAMPLERS)
def test_micro_step_is_the_same_with_any_chunk(setup, mode: str, sampler: str, monkeypatch) -> None:
    target, drafter, batch = setup
    fwd = DraftForward(drafter)
    # rollouts 0 and 1 are sampled (29 and 10 usable round starts > 6)
    objective = make_objective("edr", mode=mode, max_anchors=6, anchor_sampler=sampler)
    seen: list[torch.Tensor] = []
    original = rounds._acceptance

    def spy(rb, anchors, *args, **kwargs):
        seen.append(anchors.clone())
        return original(rb, anchors, *args, **kwargs)

    monkeypatch.setattr(rounds, "_acceptance", spy)
    results = []
    for chunk in (None, 4, 1000):
        seen.clear()
        drafter.zero_grad(set_to_none=True)
        out = rounds.rounds_step(
            step_inputs(
                target, drafter, objective, _Settings, fwd=fwd, seed=0, mode=mode, score_chunk=chunk
            ),
            batch,
            step=1,
            want_acc=False,
        )
        out.numerator.backward()
        grads = [p.grad.clone() for p in drafter.parameters() if p.grad is not None]
        results.append((out.numerator.detach(), grads, [a.clone() for a in seen]))
    ref_loss, ref_grads, _ = results[-1]
    # scoring passes of 4 round starts per rollout, then the gradient pass: occupancy scores
    # all 29 usable starts of rollout 0, uniform only the 23 the gradient pass leaves out
    assert len(results[1][2]) == (6 if sampler == "uniform" else 8) + 1
    # by default sampling mode scores in one pass (`default_score_chunk`), not split at
    # max_anchors: each pass re-projects the context (docs/training.md); greedy mode keeps
    # passes of max_anchors (6): 23 or 29 scored round starts
    scored = 23 if sampler == "uniform" else 29
    assert len(results[0][2]) == (1 if mode == "sampling" else -(-scored // 6)) + 1
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
    # uniform: every usable start is drafted exactly once (scored or with gradient); the
    # scoring passes hold the sampled rollouts 0 and 1 only, in batch order
    for i, (p, n) in enumerate(zip(batch.prompt_lens, batch.response_lens, strict=True)):
        usable = round_start_anchors(int(p), int(n))[:-1].tolist()
        parts = [part[i] for part in results[0][2] if i < part.shape[0]]
        drafted = sorted(a for part in parts for a in part.tolist() if a >= 0)
        if sampler == "uniform" or len(usable) <= 6:
            assert drafted == usable
        else:
            assert len(drafted) == len(usable) + 6 and set(drafted) == set(usable)


def test_default_score_chunk_fills_the_target_rows_budget() -> None:
    """Small vocabularies: one pass of up to DEFAULT_SCORE_CHUNK round starts; a large
    vocabulary: as many as keep the pass's target rows within the cross-entropy's chunk
    budget; never below max_anchors."""
    from blockdraft.objectives.cross_entropy import DEFAULT_CHUNK_ELEMENTS

    full = rounds.DEFAULT_SCORE_CHUNK
    assert rounds.default_score_chunk(16, 8, 4096) == full  # tiny: 8 x 512 x 4096 fits
    gemma_space = 8192 + 2
    chunk = rounds.default_score_chunk(16, 8, gemma_space)
    assert 16 < chunk < full
    assert 8 * chunk * gemma_space <= DEFAULT_CHUNK_ELEMENTS < 8 * (chunk + 1) * gemma_space
    assert rounds.default_score_chunk(16, 8, 262144) == 16  # full Gemma vocabulary
    assert rounds.default_score_chunk(600, 1, 4096) == 600


@pytest.mark.parametrize("mode", ["sampling", "greedy"])
def test_scoring_of_wrapped_forward_equals_unwrapped(setup, mode: str) -> None:
    """The scoring pass calls an unwrapped DraftForward's drafter directly (no T = 1 log
    q(label)); a wrapped forward (here a subclass, as DDP/FSDP are not DraftForward) goes
    through `forward`: same acceptance and cost, and the target probabilities computed
    once per distinct position equal `target_probs_for`'s per-slot rows."""
    from blockdraft.training.draft_space import sampling_targets
    from blockdraft.training.steps.anchored_blocks import label_positions
    from blockdraft.training.target_distributions import target_probs_for

    target, drafter, batch = setup

    Wrapped = wrapped_forward_class()

    tout = target_output(target, batch)
    anchors = every_round_start(batch)
    direct = rounds.score_round_starts(
        rounds_batch(DraftForward(drafter), target.stop_token_ids, tout, batch, _Settings, mode),
        anchors,
        5,
    )
    wrapped = rounds.score_round_starts(
        rounds_batch(Wrapped(drafter), target.stop_token_ids, tout, batch, _Settings, mode),
        anchors,
        5,
    )
    for a, b in zip(direct, wrapped, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    positions = label_positions(anchors, 3, batch.input_ids.shape[1])
    torch.testing.assert_close(
        sampling_targets(tout, positions, _Settings, None, 7),
        target_probs_for(tout.logits, positions, _Settings),
        rtol=0,
        atol=0,
    )


class _TopK:
    temperature, top_p, top_k, greedy = 0.7, 1.0, 5, False


@pytest.mark.parametrize("space", [False, True], ids=["target-vocab", "draft-space"])
def test_scoring_against_a_top_k_target_reads_its_support(setup, space: bool) -> None:
    """Against a top-k target the unwrapped scoring pass reads the target's k columns and
    two log-sum-exps per row (`support_scores`); a wrapped forward compares whole rows:
    the same A, c and gradient moments, in target space and in a reduced draft space (stop
    tokens inside and outside it, labels outside it)."""
    from trainkit import draft_space_step_setup

    target, drafter, batch = draft_space_step_setup() if space else setup
    tout = target_output(target, batch)
    anchors = every_round_start(batch)
    stops = target.stop_token_ids
    for moments in (True, False):  # the `gradient` sampler's pass, and the others'
        outs = [
            rounds.score_round_starts(
                rounds_batch(fwd, stops, tout, batch, _TopK, "sampling"),
                anchors,
                64,
                moments=moments,
            )
            for fwd in (DraftForward(drafter), wrapped_forward_class()(drafter))
        ]
        assert len(outs[0]) == (3 if moments else 2)
        for got, want in zip(*outs, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    acc, _, moments = rounds.score_round_starts(
        rounds_batch(DraftForward(drafter), stops, tout, batch, _TopK, "sampling"),
        anchors,
        64,
        moments=True,
    )
    valid = (anchors >= 0)[..., None].expand_as(acc)
    assert (acc[valid] > 0).any() and (moments[..., 1][valid] > 0).any()


@pytest.mark.parametrize(
    ("chunk_rows", "top_k"), [(None, False), (5, False), (None, True), (5, True)]
)
def test_micro_step_of_wrapped_forward_equals_unwrapped(
    setup, chunk_rows, top_k, monkeypatch
) -> None:
    """Sampling mode: an unwrapped DraftForward is run step by step (no autograd graph
    for the statistics' log q(label)), its head in row chunks that each take their target
    rows from the distinct positions' table; a wrapped one through `forward`, with the
    targets copied into place. Same loss, gradients and statistics (bit for bit in one
    piece; with 5-row chunks, checkpointed, up to the products' rounding). Against a top-k
    target the unwrapped passes score on the target's support (`support_scores`, with
    autograd in the gradient pass), the wrapped one on whole rows: equal up to rounding."""
    target, drafter, batch = setup
    if chunk_rows is not None:
        for module in (rounds, proposal_scores):
            monkeypatch.setattr(module, "default_chunk_rows", lambda vocab: chunk_rows)
    exact = chunk_rows is None and not top_k
    tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-7}
    settings = _TopK if top_k else _Settings
    if top_k:  # the support is what the unwrapped step reads (a test that can fail)
        calls = []
        original = edr.support_scores
        monkeypatch.setattr(
            edr, "support_scores", lambda *a, **k: calls.append(1) or original(*a, **k)
        )

    Wrapped = wrapped_forward_class()

    objective = make_objective("edr", mode="sampling", max_anchors=6)
    results = []
    for fwd in (DraftForward(drafter), Wrapped(drafter)):
        drafter.zero_grad(set_to_none=True)
        # the same scoring passes for both (by default the unwrapped one scores in one pass,
        # whose products round differently: test_wrapped_forward_scores_in_passes_of_...)
        out = rounds.rounds_step(
            step_inputs(
                target,
                drafter,
                objective,
                settings,
                fwd=fwd,
                seed=0,
                mode="sampling",
                score_chunk=6,
            ),
            batch,
            step=1,
            want_acc=True,
        )
        out.numerator.backward()
        grads = [p.grad.clone() for p in drafter.parameters() if p.grad is not None]
        results.append((out, grads))
    if top_k:
        assert len(calls) >= 2  # the scoring passes and the gradient pass
    (a, ga), (b, gb) = results
    torch.testing.assert_close(a.numerator.detach(), b.numerator.detach(), **tol)
    assert len(ga) == len(gb) > 0
    for x, y in zip(ga, gb, strict=True):
        torch.testing.assert_close(x, y, **tol)
    torch.testing.assert_close(a.stats.packed(), b.stats.packed(), **tol)


def test_wrapped_forward_scores_in_passes_of_max_anchors(setup, monkeypatch) -> None:
    """DDP/FSDP's forward returns a pass's whole logits (no `head_rows` cap), so a wrapped
    forward keeps scoring passes of `max_anchors` where an unwrapped one scores in one;
    the unwrapped step builds the target's rows once, for every round start, and both its
    passes read them (`TargetRowTable`), where the wrapped one builds them per pass. (Same
    values: test_micro_step_of_wrapped_forward_equals_unwrapped.)"""
    target, drafter, batch = setup

    Wrapped = wrapped_forward_class()

    passes: list[int] = []
    rows_built: list[tuple[int, ...]] = []
    original = rounds._acceptance
    original_rows = rounds.sampling_target_rows

    def spy(*args, **kwargs):
        passes.append(1)
        return original(*args, **kwargs)

    def rows_spy(tout, positions, *args, **kwargs):
        rows_built.append(tuple(positions.shape))
        return original_rows(tout, positions, *args, **kwargs)

    monkeypatch.setattr(rounds, "_acceptance", spy)
    monkeypatch.setattr(rounds, "sampling_target_rows", rows_spy)
    monkeypatch.setattr(draft_space, "sampling_target_rows", rows_spy)
    objective = make_objective("edr", mode="sampling", max_anchors=6)
    counts, built = [], []
    for fwd in (DraftForward(drafter), Wrapped(drafter)):
        passes.clear()
        rows_built.clear()
        rounds.rounds_step(
            step_inputs(target, drafter, objective, _Settings, fwd=fwd, seed=0, mode="sampling"),
            batch,
            step=1,
            want_acc=False,
        )
        counts.append(len(passes))
        built.append(list(rows_built))
    # 29 usable round starts in the longest rollout: 1 scoring pass or ceil(29 / 6), + 1
    assert counts == [2, 5 + 1]
    # unwrapped: one table of every usable round start (29 in rollout 0, 4 rollouts)
    assert built[0] == [(4, 29, drafter.config.block_size - 1)]
    # wrapped: per pass, the scoring passes over the two long rollouts, then the gradient's
    assert len(built[1]) == 6 and built[1][0][0] == 2 and built[1][-1][:2] == (4, 6)


def _step_gradient(fwd, drafter, target, objective, batch, seed: int, mode: str):
    """(numerator, flattened gradient) of one EDR micro-step."""
    drafter.zero_grad(set_to_none=True)
    out = rounds.rounds_step(
        step_inputs(target, drafter, objective, _Settings, fwd=fwd, seed=seed, mode=mode),
        batch,
        step=0,
        want_acc=False,
    )
    out.numerator.backward()
    grad = torch.cat([p.grad.flatten() for p in drafter.parameters() if p.grad is not None])
    return out.numerator.detach().double(), grad.double()


@pytest.mark.parametrize(
    ("mode", "sampler"),
    [
        ("sampling", "uniform"),
        ("sampling", "occupancy"),
        ("sampling", "gradient"),
        ("greedy", "gradient"),
    ],
)
def test_sampled_micro_step_is_unbiased(setup, mode: str, sampler: str) -> None:
    """Monte Carlo over the step's sampling seed: the mean loss and gradient of the
    sub-sampled step (max_anchors 6 of 29 and 10 usable round starts) equal the step that
    drafts every round start with gradient. Checked on the loss and on 4 fixed random
    projections of the gradient, each within 4.5 standard errors of the mean over 300
    draws (a false alarm per statistic ~7e-6); the same check with the inclusion weights
    set to 1 fails (the test can fail)."""
    target, drafter, batch = setup
    fwd = DraftForward(drafter)
    loss_full, grad_full = _step_gradient(
        fwd, drafter, target, make_objective("edr", mode=mode, max_anchors=512), batch, 0, mode
    )
    directions = torch.randn(4, grad_full.numel(), generator=torch.Generator().manual_seed(5))
    directions = directions.double()
    objective = make_objective("edr", mode=mode, max_anchors=6, anchor_sampler=sampler)
    draws = torch.stack(
        [
            torch.cat([loss.view(1), directions @ grad])
            for loss, grad in (
                _step_gradient(fwd, drafter, target, objective, batch, seed, mode)
                for seed in range(300)
            )
        ]
    )
    exact = torch.cat([loss_full.view(1), directions @ grad_full])
    mean, se = draws.mean(0), draws.std(0) / draws.shape[0] ** 0.5
    z = (mean - exact) / se
    assert bool((z.abs() < 4.5).all()), f"{sampler}: z-scores {z.tolist()}"
    # power: the same test with the inclusion weights replaced by 1 (no Horvitz-Thompson
    # correction) rejects
    with pytest.MonkeyPatch.context() as patch:
        unweighted = lambda idx, w, n: torch.zeros(n).index_fill(0, idx, 1.0)  # noqa: E731
        patch.setattr(edr, "dense_row_weights", unweighted)  # the uniform draw's
        patch.setattr(edr.round_starts, "dense_row_weights", unweighted)  # the PPS draws
        biased = torch.stack(
            [
                torch.cat([loss.view(1), directions @ grad])
                for loss, grad in (
                    _step_gradient(fwd, drafter, target, objective, batch, seed, mode)
                    for seed in range(100)
                )
            ]
        )
    z_biased = (biased.mean(0) - exact) / (biased.std(0) / biased.shape[0] ** 0.5)
    assert bool((z_biased.abs() > 4.5).any()), f"{sampler}: biased z-scores {z_biased.tolist()}"


@pytest.mark.parametrize("beta", [1.0, 0.3])
def test_greedy_step_with_tempered_relaxation_equals_autograd_of_the_recursion(setup, beta):
    """`objective.greedy_temperature`: the greedy micro-step's loss is sum_i J_i with
    A = softmax(z / beta)(x), computed here independently from the drafter's logits, and
    its gradient is autograd through the exact (reference) recursion."""
    from blockdraft.objectives.edr import acceptance_and_cost, rounds_objective
    from blockdraft.training.steps.anchored_blocks import labels_and_prev

    target, drafter, batch = setup
    fwd = DraftForward(drafter)
    objective = make_objective("edr", mode="greedy", max_anchors=512, greedy_temperature=beta)
    drafter.zero_grad(set_to_none=True)
    out = rounds.rounds_step(
        step_inputs(target, drafter, objective, _Settings, fwd=fwd, seed=0, mode="greedy"),
        batch,
        step=1,
        want_acc=False,
    )
    out.numerator.backward()
    got = [p.grad.clone() for p in drafter.parameters() if p.grad is not None]

    drafter.zero_grad(set_to_none=True)
    tout = target.forward(batch.input_ids, attention_mask=batch.attention_mask.long())
    total = torch.zeros((), dtype=torch.float64)
    for i, (p, n) in enumerate(zip(batch.prompt_lens, batch.response_lens, strict=True)):
        starts = round_start_anchors(int(p), int(n))
        if starts.numel() == 0:
            continue
        sub = batch.rows(slice(i, i + 1))
        labels, _, prev = labels_and_prev(sub, starts[None], drafter.config.block_size)
        hidden = drafter.forward_blocks(tout.features[i : i + 1], sub.input_ids, starts[None])
        logits = drafter.compute_logits(hidden, prev)[0].double()
        acc, cost = acceptance_and_cost(
            logits, None, labels[0].clamp_min(0), mode="greedy_soft", temperature=beta,
            stop_token_ids=target.stop_token_ids,
        )  # fmt: skip
        total = total + rounds_objective(acc, cost)
    total.backward()
    want = [p.grad.clone() for p in drafter.parameters() if p.grad is not None]
    torch.testing.assert_close(out.numerator.double(), total.detach(), rtol=1e-5, atol=1e-6)
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), r.double(), rtol=1e-4, atol=1e-7)


def test_scores_and_moments_are_those_of_the_cost_edr_uses() -> None:
    """The `gradient` sampler's moments come with the cost as EDR uses it, zeroed at a stop
    label (`acceptance_and_cost`): there c does not depend on the logits, so its moments are
    0; elsewhere they equal autograd's of that same cost, float64."""
    from blockdraft.objectives.edr import acceptance_and_cost, sampling_scores_and_moments
    from blockdraft.sampling import SamplingSettings

    gen = torch.Generator().manual_seed(2)
    shape, vocab, stops = (2, 5), 11, [0, 3]
    logits = torch.randn(*shape, vocab, generator=gen, dtype=torch.float64)
    probs = torch.softmax(torch.randn(*shape, vocab, generator=gen, dtype=torch.float64), -1)
    ids = torch.multinomial(probs.reshape(-1, vocab), 1, generator=gen).view(shape)
    ids[0, :2] = torch.tensor(stops)  # two stop labels
    settings = SamplingSettings(temperature=0.8)
    acc, cost, got = sampling_scores_and_moments(
        logits, probs, ids, temperature=settings.temperature, stop_token_ids=stops
    )
    x = logits.clone().requires_grad_(True)
    ref_acc, ref_cost = acceptance_and_cost(
        x, probs, ids, temperature=0.8, target_is_probs=True, stop_token_ids=stops, fused=False
    )
    torch.testing.assert_close(acc, ref_acc.detach())
    torch.testing.assert_close(cost, ref_cost.detach())
    # proposals have independent logit rows: the gradient of a sum is every row's own
    (ga,) = torch.autograd.grad(ref_acc.sum(), x, retain_graph=True)
    (gc,) = torch.autograd.grad(ref_cost.sum(), x)
    want = torch.stack([(ga**2).sum(-1), (gc**2).sum(-1), (ga * gc).sum(-1)], dim=-1)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    assert bool((want[0, :2, 1:] == 0).all()) and bool((want[1, :, 1] > 0).all())
