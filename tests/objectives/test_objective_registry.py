"""make_objective: every name builds, wiring matches the formulas, errors are clear."""

from __future__ import annotations

import dataclasses
import math
import types

import pytest
import torch

from blockdraft.objectives import (
    OBJECTIVE_NAMES,
    LossOutput,
    dpace_weights,
    e2e_loss,
    make_objective,
    objective_params,
    objective_types,
    token_logprobs,
)


def _block_batch(n: int = 6, k: int = 15, v: int = 13, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, k, v, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, v, (n, k), generator=g)
    mask = torch.rand(n, k, generator=g) > 0.2
    mask[0, 10:] = False
    return logits, targets, mask


def _manual_weighted_ce(logq: torch.Tensor, w: torch.Tensor, mask: torch.Tensor) -> float:
    """Python loops over the (detached) values: sum w (-log q) / sum w over real positions."""
    lq, ww = logq.detach().tolist(), w.tolist()
    real = [(i, j) for i in range(len(lq)) for j in range(len(lq[0])) if mask[i, j]]
    return sum(ww[i][j] * -lq[i][j] for i, j in real) / sum(ww[i][j] for i, j in real)


def test_every_name_builds_with_defaults_and_reports_its_flags() -> None:
    assert set(OBJECTIVE_NAMES) == {"uniform", "decay", "dpace", "e2e", "edr"}
    for name in OBJECTIVE_NAMES:
        obj = make_objective(name)
        assert obj.name == name
        assert dataclasses.asdict(obj.params) == objective_params(name)
        assert obj.is_rounds_objective == (name == "edr")
        assert obj.needs_target_distribution == (name in ("e2e", "edr"))  # edr defaults to sampling
    assert make_objective("edr", mode="greedy").needs_target_distribution is False
    assert dataclasses.asdict(make_objective("edr", mode="greedy", max_anchors=64).params) == {
        "max_anchors": 64,
        "anchor_sampler": "gradient",
        "greedy_temperature": 0.5,
    }
    assert make_objective("edr", greedy_temperature=0.25).greedy_temperature == 0.25
    for bad in (0, -1.0, float("inf"), True, "0.5"):
        with pytest.raises(ValueError, match="greedy_temperature"):
            make_objective("edr", greedy_temperature=bad)


def test_uniform_is_masked_mean_nll() -> None:
    logits, targets, mask = _block_batch()
    logq = token_logprobs(logits, targets)
    out = make_objective("uniform").loss(logq, mask)
    assert isinstance(out, LossOutput)
    expected = torch.nn.functional.cross_entropy(logits[mask], targets[mask])  # independent path
    assert abs(float(out.loss.detach()) - float(expected.detach())) < 1e-12
    assert torch.equal(out.weights, mask.double())
    assert out.metrics["nll"] == pytest.approx(float(expected.detach()))
    q = logq.detach().exp().tolist()
    per_block = []
    for b in range(len(q)):
        chain, total = 1.0, 0.0
        for j in range(len(q[b])):
            if mask[b, j]:
                chain *= q[b][j]
                total += chain
        per_block.append(total)
    assert out.metrics["surrogate_accepted"] == pytest.approx(sum(per_block) / len(per_block))
    assert out.metrics["real_proposals"] == int(mask.sum())


@pytest.mark.parametrize(("k", "gamma"), [(15, 7.0), (9, 5.0), (7, 4.0)])
def test_decay_uses_dflash_gamma_for_the_block_size(k: int, gamma: float) -> None:
    logits, targets, mask = _block_batch(k=k)
    logq = token_logprobs(logits, targets)
    out = make_objective("decay").loss(logq, mask)
    profile = torch.tensor([math.exp(-j / gamma) for j in range(k)], dtype=torch.float64)
    torch.testing.assert_close(out.weights, profile.expand(len(mask), k) * mask)
    w = profile.expand(len(mask), k)
    assert abs(float(out.loss.detach()) - _manual_weighted_ce(logq, w, mask)) < 1e-12


def test_decay_gamma_override() -> None:
    logits, targets, mask = _block_batch(k=5)
    out = make_objective("decay", gamma=2).loss(token_logprobs(logits, targets), mask)
    torch.testing.assert_close(
        out.weights[0, :2], torch.tensor([1.0, math.exp(-0.5)], dtype=torch.float64)
    )


@pytest.mark.parametrize(
    ("name", "variant"),
    [(None, "full"), ("cumulative", "cumulative"), ("continuation", "continuation")],
)
def test_dpace_variants_use_their_weights_and_alpha(name: str | None, variant: str) -> None:
    logits, targets, mask = _block_batch(seed=1)
    logq = token_logprobs(logits, targets)
    given = {"variant": name} if name else {}  # None: the default variant
    out = make_objective("dpace", alpha=0.3, **given).loss(logq, mask)
    w = dpace_weights(logq.detach().exp(), alpha=0.3, variant=variant, mask=mask)
    torch.testing.assert_close(out.weights, w)
    assert abs(float(out.loss.detach()) - _manual_weighted_ce(logq, w, mask)) < 1e-12
    others = {"full", "cumulative", "continuation"} - {variant}
    for other in others:  # the variants really differ, so a wrong mapping would fail
        assert not torch.allclose(out.weights, dpace_weights(logq.detach().exp(), 0.3, other, mask))
    (grad,) = torch.autograd.grad(out.loss, logits)
    assert torch.isfinite(grad).all()


def test_e2e_objective_needs_distributions_and_matches_e2e_loss() -> None:
    logits, targets, mask = _block_batch(n=4, k=5, v=7)
    logq = token_logprobs(logits, targets)
    p = torch.softmax(torch.randn(4, 5, 7, dtype=torch.float64), -1)
    obj = make_objective("e2e", chunk_rows=3)
    with pytest.raises(ValueError, match="draft_logits and target_probs"):
        obj.loss(logq, mask)
    out = obj.loss(logq, mask, draft_logits=logits, target_probs=p)
    torch.testing.assert_close(out.loss, e2e_loss(logits, p, mask))
    assert out.weights is None and 0 < out.metrics["mean_overlap"] <= 1


def test_edr_rounds_loss_normalises_by_emitted_tokens_and_scatters_weights(monkeypatch) -> None:
    """Wiring test with a stand-in edr module (the real one is tested by its owner):
    a fake batched surrogate `sum_rows w_row * sum_h (2A + c)` makes the expected value
    computable by hand, including the padding rows (weight 0) and rollouts without weights."""

    def fake_pad(tensors):
        rows = max(t.shape[0] for t in tensors)
        out = torch.stack(
            [torch.cat([t, t.new_zeros(rows - t.shape[0], t.shape[1])]) for t in tensors]
        )
        return out, torch.tensor([t.shape[0] + 1 for t in tensors])

    def fake_surrogate(acc, cost, *, lengths, reduction, row_weights=None):
        assert reduction == "sum"
        rows = torch.arange(acc.shape[1]).view(1, -1) < (lengths.view(-1, 1) - 1)
        w = rows.to(acc.dtype) if row_weights is None else row_weights
        assert torch.all(w[~rows] == 0)
        return (w * (2 * acc + cost).sum(-1)).sum()

    fake = types.ModuleType("blockdraft.objectives.edr")
    fake.pad_rollouts, fake.edr_surrogate = fake_pad, fake_surrogate
    monkeypatch.setattr(objective_types, "edr", fake)

    acc = [torch.rand(9, 4, requires_grad=True), torch.rand(3, 4, requires_grad=True)]
    cost = [1 - a.detach() for a in acc]
    obj = make_objective("edr", mode="greedy")
    out = obj.rounds_loss(acc, cost)
    per_row = [(a.detach() * 2 + c).sum(-1) for a, c in zip(acc, cost, strict=True)]
    expected = float(sum(r.sum() for r in per_row)) / (9 + 3)
    assert float(out.loss.detach()) == pytest.approx(expected)
    assert out.metrics["tokens"] == 12
    out.loss.backward()
    torch.testing.assert_close(acc[1].grad, torch.full((3, 4), 2.0 / 12))

    w0 = torch.rand(9) * 3
    out_w = obj.rounds_loss(acc, cost, inclusion_weights=[w0, None])
    expected_w = (float((w0 * per_row[0]).sum()) + float(per_row[1].sum())) / 12
    assert float(out_w.loss.detach()) == pytest.approx(expected_w)
    with pytest.raises(ValueError, match="inclusion weights must have shape"):
        obj.rounds_loss(acc, cost, inclusion_weights=[torch.ones(8), None])


def test_edr_rounds_loss_with_the_real_module_if_present() -> None:
    """Batched call == per-rollout calls of the real edr_surrogate, with and without weights."""
    from blockdraft.objectives import edr

    g = torch.Generator().manual_seed(3)
    acc = [torch.rand(rows, 3, generator=g, dtype=torch.float64) for rows in (7, 4, 11)]
    cost = [1 - a for a in acc]
    obj = make_objective("edr", mode="greedy")
    assert obj.edr_mode == "greedy_soft"
    out = obj.rounds_loss(acc, cost)
    per_rollout = [float(edr.edr_surrogate(a, c)) for a, c in zip(acc, cost, strict=True)]
    assert float(out.loss.detach()) == pytest.approx(sum(per_rollout) / 22, rel=1e-9)
    # Without weights the surrogate's value is the exact expected number of rounds.
    exact = sum(float(edr.expected_rounds(a)) for a in acc)
    assert out.metrics["expected_rounds"] == pytest.approx(exact, rel=1e-9)
    assert out.metrics["mal"] == pytest.approx(22 / exact, rel=1e-9)

    weights = [
        torch.rand(7, generator=g, dtype=torch.float64) * 2,
        None,
        torch.rand(11, generator=g, dtype=torch.float64),
    ]
    out_w = obj.rounds_loss(acc, cost, inclusion_weights=weights)
    per_rollout_w = [
        float(
            edr.edr_surrogate(
                a, c, row_weights=torch.ones(a.shape[0], dtype=a.dtype) if w is None else w
            )
        )
        for a, c, w in zip(acc, cost, weights, strict=True)
    ]
    assert float(out_w.loss.detach()) == pytest.approx(sum(per_rollout_w) / 22, rel=1e-9)


def test_edr_helpers_pass_mode_and_max_anchors_through() -> None:
    from blockdraft.objectives import edr

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 3, 6, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 6, (4, 3), generator=g)
    acc, cost = make_objective("edr", mode="greedy").acceptance_and_cost(logits, None, ids)
    # greedy: A = softmax(z / beta)(x), beta = greedy_temperature (default 0.5)
    q = torch.softmax(logits / 0.5, -1).gather(-1, ids[..., None]).squeeze(-1)
    torch.testing.assert_close(acc, q)
    torch.testing.assert_close(cost, 1 - q)
    obj = make_objective("edr", mode="greedy", greedy_temperature=1.0)
    acc1, _ = obj.acceptance_and_cost(logits, None, ids)
    q = torch.softmax(logits, -1).gather(-1, ids[..., None])[..., 0]  # beta = 1: A = q(x)
    torch.testing.assert_close(acc1, q)
    p = torch.softmax(torch.randn(4, 3, 6, generator=g, dtype=torch.float64), -1)
    acc_s, _ = make_objective("edr").acceptance_and_cost(logits, p, ids, target_is_probs=True)
    torch.testing.assert_close(acc_s, (q / p.gather(-1, ids[..., None]).squeeze(-1)).clamp(max=1))
    occupancy = torch.rand(50, generator=g, dtype=torch.float64) + 0.1
    idx, _ = make_objective("edr", max_anchors=8).sample_round_starts(
        occupancy, torch.Generator().manual_seed(0)
    )
    assert len(idx) == 8 and len(set(idx.tolist())) == 8
    assert hasattr(edr, "sample_round_starts")


def test_bad_names_and_params_give_clear_errors() -> None:
    with pytest.raises(ValueError, match=r"unknown objective 'dpcae'.*dpace.*edr"):
        make_objective("dpcae")
    with pytest.raises(
        ValueError, match=r"unknown parameter\(s\) gamma for objective 'dpace'; valid: soft"
    ):
        make_objective("dpace", gamma=3)
    with pytest.raises(ValueError, match="valid: soft_target_weight$"):
        make_objective("uniform", alpha=0.5)
    with pytest.raises(ValueError, match="alpha"):
        make_objective("dpace", alpha=-0.1)
    with pytest.raises(ValueError, match="gamma"):
        make_objective("decay", gamma=0)
    with pytest.raises(ValueError, match="mode"):
        make_objective("edr", mode="beam")
    with pytest.raises(ValueError, match="variant must be one of full"):
        make_objective("dpace", variant="greedy")
    with pytest.raises(ValueError, match="max_anchors"):
        make_objective("edr", max_anchors=0)
    with pytest.raises(ValueError, match="be one of gradient, occupancy, uniform"):
        make_objective("edr", anchor_sampler="pps")
    for mode in ("greedy", "sampling"):
        assert make_objective("edr", mode=mode).anchor_sampler == "gradient"
        assert make_objective("edr", mode=mode, anchor_sampler="occupancy").anchor_sampler == (
            "occupancy"
        )
    with pytest.raises(TypeError, match="rounds_loss"):
        make_objective("edr").loss(torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(TypeError, match="call loss"):
        make_objective("dpace").rounds_loss([torch.zeros(2, 2)], [torch.zeros(2, 2)])
    with pytest.raises(ValueError, match="mask"):
        make_objective("dpace").loss(torch.zeros(2, 3), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        make_objective("uniform").loss(torch.zeros(3), torch.ones(3, dtype=torch.bool))
