"""Sampling E2E/EDR in a reduced draft vocabulary's `DraftSpace` (D + 2 columns) give the
values and gradients of the target-space computation (V columns, -inf outside D): the
kernels' sums split exactly into D's columns and the two mass columns."""

from __future__ import annotations

import pytest
import torch
from trainkit import draft_space_step_setup, random_step_batch, rounds_batch, step_inputs

from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
from blockdraft.objectives.e2e import overlap_with_logits
from blockdraft.objectives.edr import acceptance_and_cost
from blockdraft.objectives.registry import make_objective
from blockdraft.training.draft_forward import DraftForward
from blockdraft.training.draft_space import DraftSpace, TargetRowTable, sampling_targets
from blockdraft.training.steps import rounds
from blockdraft.training.steps.anchored_blocks import label_positions
from blockdraft.training.steps.block import block_step
from blockdraft.training.target_distributions import target_probs_for

VOCAB, STOPS = 40, [1, 2]
DRAFT = torch.tensor([1, 3, 4, 6, 7, 9, 12, 15, 20, 21, 22, 30, 33, 39])  # stop 1 in, 2 out


def _to_target(draft_logits: torch.Tensor) -> torch.Tensor:
    full = draft_logits.new_full((*draft_logits.shape[:-1], VOCAB), float("-inf"))
    return full.index_copy(-1, DRAFT, draft_logits)


def test_acceptance_cost_and_overlap_equal_target_space() -> None:
    g = torch.Generator().manual_seed(0)
    rows = 64
    p = torch.distributions.Dirichlet(torch.full((VOCAB,), 0.3)).sample((rows,))
    p[:8, 2] += 0.5  # rows with much mass on the stop token outside D
    p = p / p.sum(-1, keepdim=True)
    labels = torch.randint(0, VOCAB, (rows,), generator=g)
    labels[:4] = torch.tensor([1, 2, 5, 3])  # stop in D, stop outside, outside, inside
    space = DraftSpace(DRAFT, VOCAB, STOPS)
    z = torch.randn(rows, DRAFT.numel(), generator=g, dtype=torch.float64) * 2
    w = torch.rand(3, rows, generator=g, dtype=torch.float64)

    def run(logits_fn, probs, ids, stops):
        x = z.clone().requires_grad_(True)
        acc, cost = acceptance_and_cost(
            logits_fn(x), probs, ids, mode="sampling", temperature=0.7,
            target_is_probs=True, stop_token_ids=stops,
        )  # fmt: skip
        overlap = overlap_with_logits(probs, logits_fn(x), temperature=0.7)
        (w[0] @ acc + w[1] @ cost + w[2] @ overlap).backward()
        return acc.detach(), cost.detach(), overlap.detach(), x.grad

    ref = run(_to_target, p.double(), labels, STOPS)
    got = run(space.logits, space.probs(p.double()).double(), space.labels(labels),
              space.stop_columns)  # fmt: skip
    assert ref[0][2] == 0 and ref[1][0] == 0  # outside D: A = 0; a stop label: c = 0
    assert (ref[1] > 0.01).sum() > rows // 2  # the check can fail: costs are not all zero
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class _Settings:
    temperature, top_p, top_k, greedy = 0.8, 0.9, 12, False


@pytest.fixture(scope="module")
def setup():
    return draft_space_step_setup()


def _step(setup, objective: str):
    target, drafter, batch = setup
    obj = make_objective(objective, **({"mode": "sampling"} if objective == "edr" else {}))
    drafter.zero_grad(set_to_none=True)
    if objective == "e2e":
        out = block_step(
            step_inputs(target, drafter, obj, _Settings, num_anchors=9), batch, 1, True
        )
    else:
        inputs = step_inputs(target, drafter, obj, _Settings, mode="sampling")
        out = rounds.rounds_step(inputs, batch, 1, True)
    out.numerator.backward()
    grads = [p.grad.clone() for p in drafter.parameters() if p.grad is not None]
    return out.numerator.detach(), grads, out.stats


@pytest.mark.parametrize("objective", ["e2e", "edr"])
def test_step_equals_the_target_space_step(setup, objective, monkeypatch) -> None:
    widths, logits = [], DraftSpace.logits
    monkeypatch.setattr(
        DraftSpace, "logits", lambda s, x: widths.append(x.shape[-1]) or logits(s, x)
    )
    loss, grads, stats = _step(setup, objective)
    assert widths and set(widths) == {setup[1].draft_ids.numel()}  # the draft space was used
    monkeypatch.setattr(DraftSpace, "of", classmethod(lambda cls, *a, **k: None))
    ref_loss, ref_grads, ref_stats = _step(setup, objective)
    assert ref_loss.item() > 0 and grads
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(stats.acc_correct, ref_stats.acc_correct)
    if ref_stats.profile_sum is not None:  # the logged D-PACE profile from log q(label)
        torch.testing.assert_close(stats.profile_sum, ref_stats.profile_sum)


def test_scoring_pass_and_moments_equal_target_space(setup, monkeypatch) -> None:
    target, drafter, batch = setup
    tout = target.forward(
        batch.input_ids, attention_mask=batch.attention_mask.long(), with_logits=True
    )
    anchors = torch.stack([torch.arange(5, 15), torch.arange(5, 15)])
    anchors[1, 8:] = -1

    def score():
        rb = rounds_batch(
            DraftForward(drafter), target.stop_token_ids, tout, batch, _Settings, "sampling"
        )
        return rounds.score_round_starts(rb, anchors, 4, moments=True)

    got = score()
    monkeypatch.setattr(DraftSpace, "of", classmethod(lambda cls, *a, **k: None))
    ref = score()
    assert ref[2].abs().sum() > 0
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_sampling_targets_reduce_each_position(setup) -> None:
    """Built once per distinct position in chunks, then laid out: each block slot's row is
    the reduction of `target_probs_for`'s row for it."""
    target, drafter, batch = setup
    tout = target.forward(
        batch.input_ids, attention_mask=batch.attention_mask.long(), with_logits=True
    )
    anchors = torch.stack([torch.arange(5, 12), torch.arange(6, 13)])
    positions = label_positions(anchors, 3, batch.input_ids.shape[1])
    space = DraftSpace.of(drafter, target.stop_token_ids)
    got = sampling_targets(tout, positions, _Settings, space, 3)
    ref = space.probs(target_probs_for(tout.logits, positions, _Settings))
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-7)
    torch.testing.assert_close(got.sum(-1), torch.ones(got.shape[:-1]), rtol=0, atol=1e-5)


def test_target_row_table_gives_each_subset_its_rows(setup) -> None:
    """A table built once for every round start's label positions hands any subset of
    them (and a subset of the sequences) the rows `sampling_targets` builds for it."""
    target, drafter, batch = setup
    tout = target.forward(
        batch.input_ids, attention_mask=batch.attention_mask.long(), with_logits=True
    )
    seq_len = batch.input_ids.shape[1]
    every = torch.stack([torch.arange(5, 14), torch.arange(6, 15)])
    space = DraftSpace.of(drafter, target.stop_token_ids)
    table = TargetRowTable.build(
        tout, label_positions(every, 3, seq_len), seq_len, _Settings, space, 3
    )
    # each distinct position once: 9 round starts + 2 more label positions per sequence
    assert table.rows.shape == (2 * 11, space.width)
    subset = torch.stack([torch.tensor([5, 9, 13]), torch.tensor([14, 6, 10])])
    positions = label_positions(subset, 3, seq_len)
    want = sampling_targets(tout, positions, _Settings, space, 3)
    torch.testing.assert_close(table.rows[table.index(positions)], want, rtol=0, atol=0)
    second = table.sequences([1])
    got = second.rows[second.index(positions[1:])]
    torch.testing.assert_close(got, want[1:], rtol=0, atol=0)
    assert not torch.equal(want[0], want[1])


@pytest.mark.parametrize("objective", ["e2e", "edr"])
def test_step_reading_response_logits_only_equals_full_logits(objective, monkeypatch) -> None:
    """The sampling steps ask the target for the logits of the positions after the
    shortest prompt only (`response_logits_to_keep`); prompts of different lengths in one
    batch, so rows start at different offsets: same loss and gradients as full logits."""
    from blockdraft.data.rollouts.store import Rollout
    from blockdraft.training.batching import collate
    from blockdraft.training.steps import anchored_blocks

    target, _, _ = random_step_batch([3])
    torch.manual_seed(0)
    drafter = BlockDrafter(DrafterConfig.for_target(target, num_layers=1, block_size=4))
    drafter.bind_target(target)
    gen = torch.Generator().manual_seed(5)
    rows = [
        Rollout(f"r{i}", torch.randint(3, target.vocab_size, (p,), generator=gen),
                torch.randint(3, target.vocab_size, (n,), generator=gen), torch.full((n,), -1.0))
        for i, (p, n) in enumerate([(9, 12), (4, 15), (6, 7)])
    ]  # fmt: skip
    batch = collate(rows, [0, 1, 2], 0, 4096)
    seq_len = batch.input_ids.shape[1]
    assert anchored_blocks.response_logits_to_keep(batch) == seq_len - 3
    setup = (target, drafter, batch)
    loss, grads, _ = _step(setup, objective)
    full = lambda b: b.input_ids.shape[1]  # noqa: E731
    monkeypatch.setattr(anchored_blocks, "response_logits_to_keep", full)
    ref_loss, ref_grads, _ = _step(setup, objective)
    assert ref_loss.item() > 0
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)


def test_masses_stay_float32_under_autocast() -> None:
    """CUDA training runs under bf16 autocast: the two mass columns must not go through a
    bf16 product (8-bit mantissa: a mass of 0.3 would be off by ~1e-3)."""
    p = torch.softmax(torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2)), -1)
    space = DraftSpace(DRAFT, VOCAB, STOPS)
    ref = space.probs(p)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = space.probs(p)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-7)
