"""Soft targets (`objective.soft_target_weight`): each slot's cross-entropy mixes the hard
label with the target's stored top-k distribution. Checked against a target-space brute
force, the objective's formula, and the step: a one-hot "top-k" at the label must give
exactly the hard-label loss (which fails if stored distributions and slots misalign)."""

from __future__ import annotations

import math

import pytest
import torch
from trainkit import make_config, random_step_batch, read_metrics, step_inputs

from blockdraft.data.rollouts import SamplingSettings, generate_rollouts
from blockdraft.data.rollouts.store import Rollout
from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
from blockdraft.objectives.dpace import dpace_weights
from blockdraft.objectives.registry import make_objective
from blockdraft.training.batching import collate
from blockdraft.training.builders import TrainSetupError
from blockdraft.training.config import ConfigError, config_from_dict
from blockdraft.training.draft_forward import soft_target_logq
from blockdraft.training.steps.block import block_step
from blockdraft.training.trainer import train


def _reduced_drafter(target, keep: torch.Tensor) -> BlockDrafter:
    torch.manual_seed(0)
    config = DrafterConfig.for_target(
        target, num_layers=1, block_size=4, draft_vocab_size=keep.numel()
    )
    drafter = BlockDrafter(config).bind_target(target)
    drafter.set_draft_vocab(keep)
    return drafter


def test_soft_logq_equals_a_target_space_brute_force() -> None:
    target, _, _ = random_step_batch([6])
    vocab = target.vocab_size
    keep = torch.arange(3, vocab, 2)
    drafter = _reduced_drafter(target, keep)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 3, 3, drafter.config.hidden_size, generator=g, requires_grad=True)
    ids = torch.randint(0, vocab, (2, 3, 3, 5), generator=g)
    ids[0, 0, 0] = torch.tensor([4, 6, 8, 10, 12])  # none in the draft vocabulary
    lps = torch.log_softmax(torch.randn(2, 3, 3, 5, generator=g), -1)
    fallback = torch.full((2, 3, 3), -7.0)
    got = soft_target_logq(drafter, hidden, ids, lps, fallback, chunk_rows=5)

    h = hidden.detach().clone().requires_grad_(True)
    full = torch.full((2, 3, 3, vocab), float("-inf"))
    full[..., keep] = h @ drafter.head_weight.T  # q is 0 outside the draft vocabulary
    logq = torch.log_softmax(full, -1)
    want = torch.empty(2, 3, 3)
    for idx in torch.cartesian_prod(*[torch.arange(n) for n in (2, 3, 3)]).tolist():
        i, a, k = idx
        inside = [j for j in range(5) if int(ids[i, a, k, j]) in set(keep.tolist())]
        if not inside:
            want[i, a, k] = fallback[i, a, k]
            continue
        p = torch.softmax(lps[i, a, k, inside], -1)
        want[i, a, k] = (p * logq[i, a, k, ids[i, a, k, inside]]).sum()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert float(got[0, 0, 0].detach()) == -7.0
    (g1,) = torch.autograd.grad(got.sum(), hidden)
    (g2,) = torch.autograd.grad(want.sum(), h)
    torch.testing.assert_close(g1, g2, rtol=1e-4, atol=1e-6)


def test_objective_mixes_hard_and_soft_with_the_hard_labels_weights() -> None:
    g = torch.Generator().manual_seed(2)
    logq = torch.log(torch.rand(6, 4, generator=g) * 0.9 + 0.05).requires_grad_(True)
    soft = torch.log(torch.rand(6, 4, generator=g) * 0.9 + 0.05)
    mask = torch.ones(6, 4, dtype=torch.bool)
    mask[5, 2:] = False
    lam = 0.3
    out = make_objective("dpace", soft_target_weight=lam).loss(logq, mask, soft_logq=soft)
    hard = make_objective("dpace").loss(logq, mask)
    w = dpace_weights(logq.detach().exp(), alpha=0.5, variant="full", mask=mask) * mask
    want = (w * -((1 - lam) * logq + lam * soft)).sum() / w.sum()
    torch.testing.assert_close(out.loss, want)
    torch.testing.assert_close(out.weights, hard.weights)  # weights: the hard label's
    with pytest.raises(ValueError, match="soft_logq"):
        make_objective("decay", soft_target_weight=0.5).loss(logq, mask)
    with pytest.raises(ValueError, match="soft_target_weight"):
        make_objective("dpace", soft_target_weight=1.5)


def _with_topk(batch, topk_ids: torch.Tensor, topk_lps: torch.Tensor):
    rows = []
    for i in range(batch.input_ids.shape[0]):
        p, n = int(batch.prompt_lens[i]), int(batch.response_lens[i])
        ids = batch.input_ids[i]
        rows.append(Rollout(f"r{i}", ids[:p], ids[p : p + n], torch.zeros(n), topk_ids[i, :n],
                            topk_lps[i, :n]))  # fmt: skip
    return collate(rows, list(range(len(rows))), 0, 4096)


def _step_loss(target, drafter, batch, soft_weight: float) -> torch.Tensor:
    obj = make_objective("dpace", **({"soft_target_weight": soft_weight} if soft_weight else {}))
    inputs = step_inputs(target, drafter, obj, SamplingSettings(0.0), num_anchors=6)
    out = block_step(inputs, batch, step=1, want_acc=False)
    return out.numerator / out.denominator


def test_step_with_a_one_hot_topk_at_the_label_is_the_hard_loss() -> None:
    target, _, batch = random_step_batch([9, 7])
    drafter = _reduced_drafter(target, torch.arange(3, target.vocab_size))
    b, width = batch.input_ids.shape
    g = torch.Generator().manual_seed(4)
    # response token j's stored top-k: the token itself first (log-prob 0), then others
    # at -inf (probability 0), so the soft target is the hard label
    ids = torch.randint(3, target.vocab_size, (b, width, 4), generator=g)
    lps = torch.full((b, width, 4), float("-inf"))
    lps[..., 0] = 0.0
    for i in range(b):
        p, n = int(batch.prompt_lens[i]), int(batch.response_lens[i])
        ids[i, :n, 0] = batch.input_ids[i, p : p + n]
    one_hot = _with_topk(batch, ids, lps)
    assert torch.equal(one_hot.topk_ids[0, int(batch.prompt_lens[0]), 0], batch.input_ids[0, 5])
    hard = _step_loss(target, drafter, batch, 0.0)
    torch.testing.assert_close(_step_loss(target, drafter, one_hot, 1.0), hard)
    # a shifted store (each position given its neighbour's distribution) is another loss
    shifted = _with_topk(batch, ids.roll(1, dims=1), lps)
    assert not torch.allclose(_step_loss(target, drafter, shifted, 1.0), hard)


def test_training_with_soft_targets_runs_and_bad_configs_are_one_key(target, tmp_path) -> None:
    from trainkit import prompts_for

    settings = SamplingSettings(temperature=0.0, max_new_tokens=12, seed=1)
    with_topk = tmp_path / "topk"
    generate_rollouts(target, prompts_for("s", 12), with_topk, settings, batch_size=12,
                      store_topk=8, progress=False)  # fmt: skip
    plain = tmp_path / "plain"
    generate_rollouts(target, prompts_for("s", 12), plain, settings, batch_size=12, progress=False)
    obj = {"name": "dpace", "soft_target_weight": 0.5}
    run = tmp_path / "run"
    assert train(make_config(run, {"greedy": with_topk}, objective=obj), target=target).is_dir()
    losses = [m["loss"] for m in read_metrics(run) if "loss" in m]
    assert losses and all(math.isfinite(x) for x in losses)
    cfg = make_config(tmp_path / "run2", {"greedy": plain}, objective=obj)
    with pytest.raises(TrainSetupError, match="objective.soft_target_weight: .* --store-topk"):
        train(cfg, target=target)
    with pytest.raises(ConfigError, match="objective.soft_target_weight: not a parameter of "):
        config_from_dict({"data": {"train_rollouts": "x"}, "objective": {"name": "e2e",
                          "soft_target_weight": 0.5}})  # fmt: skip
    with pytest.raises(ConfigError, match="objective.soft_target_weight: only for a parallel"):
        config_from_dict({"data": {"train_rollouts": "x"}, "drafter": {"arch": "semi_ar"},
                          "objective": {"name": "dpace", "soft_target_weight": 0.5}})  # fmt: skip
