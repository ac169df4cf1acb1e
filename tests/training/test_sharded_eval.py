"""Held-out evaluation during training: sharded over ranks and in the training dtype.

Two gloo processes each score every other held-out rollout (an odd count, so the shards
differ in size) and gather the acceptance tensors: the MAL must be the one process's
MAL. Autocast is checked on the CPU, where bf16 autocast runs for real.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from trainkit import learnable_target

from blockdraft.data.rollouts import RolloutSet
from blockdraft.training.evaluate import evaluate_mal, shard_indices

NUM_ROLLOUTS = 7


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _drafter(target):
    from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig

    torch.manual_seed(3)
    cfg = DrafterConfig.for_target(target, num_layers=1, block_size=5)
    return BlockDrafter(cfg).bind_target(target)


def _worker(rank: int, port: int, root: str, mode: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(1)
    from blockdraft.training.distributed import init_distributed, shutdown

    ctx = init_distributed("cpu", "gloo", timeout_minutes=2)
    try:
        target = learnable_target()
        rollouts = list(RolloutSet.open(Path(root) / mode))[:NUM_ROLLOUTS]
        settings = RolloutSet.open(Path(root) / mode).settings
        mal = evaluate_mal(_drafter(target), target, rollouts, settings, ctx=ctx)
    finally:
        shutdown(ctx)
    (Path(root) / f"{mode}-rank{rank}.json").write_text(json.dumps({"mal": mal}))


def test_shards_cover_every_rollout_once() -> None:
    shards = [shard_indices(7, r, 3) for r in range(3)]
    assert sorted(i for s in shards for i in s) == list(range(7))
    assert shards[0] == [0, 3, 6] and shard_indices(2, 2, 3) == []  # a rank may get none


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_two_ranks_give_the_one_process_mal(mode, rollout_dirs, target) -> None:
    root = rollout_dirs[mode].parent
    rs = RolloutSet.open(rollout_dirs[mode])
    single = evaluate_mal(_drafter(target), target, list(rs)[:NUM_ROLLOUTS], rs.settings)
    port = _free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, port, str(root), mode)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0, 0]
    mals = [json.loads((root / f"{mode}-rank{r}.json").read_text())["mal"] for r in range(2)]
    assert mals[0] == mals[1]  # every rank returns the gathered MAL
    assert mals[0] == pytest.approx(single, rel=1e-9)


def test_autocast_scores_in_the_training_dtype(rollout_dirs, target, monkeypatch) -> None:
    import blockdraft.evaluation.scoring as scoring

    rs = RolloutSet.open(rollout_dirs["sampled"])
    rollouts = list(rs)[:4]
    drafter = _drafter(target).train()
    seen: list[tuple] = []
    real = scoring.acceptance_tensor

    def spy(d, t, *args, **kwargs):
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return real(d, t, *args, **kwargs)

    monkeypatch.setattr(scoring, "acceptance_tensor", spy)
    hashed: list[int] = []
    monkeypatch.setattr(scoring, "tensor_state_hash", lambda m: hashed.append(1) or "x")
    fp32 = evaluate_mal(drafter, target, rollouts, rs.settings)
    assert not hashed  # no cache during training: the weights are never hashed
    assert len(seen) == 4 and not any(enabled for enabled, _ in seen)
    seen.clear()
    bf16 = evaluate_mal(drafter, target, rollouts, rs.settings, amp_dtype=torch.bfloat16)
    assert seen == [(True, torch.bfloat16)] * 4
    assert drafter.training  # restored after scoring
    assert bf16 == pytest.approx(fp32, abs=0.05) and bf16 != fp32


def test_memo_reuses_target_features_across_evaluations(rollout_dirs, target, monkeypatch):
    """The trainer's per-run `FeatureMemo`: the second evaluation runs no target forward
    and gives the same MAL (the target is frozen, so its features are too)."""
    from blockdraft.evaluation.scoring import FeatureMemo

    rs = RolloutSet.open(rollout_dirs["sampled"])
    rollouts = list(rs)[:4]
    drafter = _drafter(target)
    calls: list[int] = []
    forward = target.forward
    monkeypatch.setattr(target, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    memo = FeatureMemo()
    first = evaluate_mal(drafter, target, rollouts, rs.settings, memo=memo)
    assert len(calls) == 4
    second = evaluate_mal(drafter, target, rollouts, rs.settings, memo=memo)
    assert len(calls) == 4 and second == first
    assert evaluate_mal(drafter, target, rollouts, rs.settings) == first  # no memo: fresh
    assert len(calls) == 8
