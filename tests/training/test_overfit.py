"""The trainer must be able to memorise a handful of sequences: ~100% teacher-forced
accuracy at *every* slot. If features, anchors and labels were misaligned by even one
position (context leaking the answer, or labels shifted), the drafter could not reach it
on unpredictable text; a drafter that stalls on real data then has another cause."""

from __future__ import annotations

import pytest
import torch
from trainkit import make_config, prompts_for

from blockdraft.data.rollouts import SamplingSettings, generate_rollouts
from blockdraft.data.rollouts.store import RolloutSet
from blockdraft.evaluation.scoring import score_rollouts
from blockdraft.training import train
from random_targets import make_random_target


@pytest.mark.slow
def test_drafter_memorises_a_few_sequences_at_every_slot(tmp_path):
    torch.manual_seed(0)
    target = make_random_target("qwen3", hidden_size=64, num_layers=4, seed=3)
    # T = 1 from an unsharpened random target: close to random tokens, nothing to guess
    settings = SamplingSettings(temperature=1.0, max_new_tokens=16, seed=5)
    generate_rollouts(target, prompts_for("o", 4), tmp_path / "r", settings, progress=False)
    cfg = make_config(
        tmp_path / "run",
        {"sampled": tmp_path / "r"},
        "sampled",
        num_anchors=16,
        data={"eval_split": 0.0},
        drafter={"num_layers": 1, "block_size": 4},
        objective={"name": "uniform"},
        optim={"lr": 3e-3, "batch_size": 4, "max_steps": 250, "warmup_steps": 10},
    )
    final = train(cfg, target=target)
    from blockdraft.serialization.checkpoint import load_drafter

    drafter = load_drafter(final, target).eval()
    rollouts = list(RolloutSet.open(tmp_path / "r"))
    acc = score_rollouts(drafter, target, rollouts, temperature=0.0, use_cache=False)
    per_slot = []
    for h in range(3):  # rows n with n + h + 1 <= L are real proposals
        vals = torch.cat([a[: a.shape[0] - h, h] for a in acc])
        per_slot.append(float(vals.mean()))
    assert min(per_slot) >= 0.97, f"teacher-forced slot accuracy {per_slot}"
