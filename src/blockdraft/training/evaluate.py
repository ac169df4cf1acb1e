"""Held-out offline MAL during training: the number users care about, not the loss.

Scored by the exact offline evaluator, so training curves and `blockdraft eval` agree.
Each rank scores every `world_size`-th rollout under the step's autocast (rank 0 alone
would stall the group) and the acceptance tensors are gathered back in rollout order.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from blockdraft.evaluation.offline import offline_stats
from blockdraft.evaluation.scoring import score_rollouts, shared_target_features
from blockdraft.training.distributed import DistContext, all_gather_objects


def shard_indices(num_rollouts: int, rank: int, world_size: int) -> list[int]:
    """The held-out rollouts `rank` scores: every `world_size`-th one, starting at `rank`
    (strided, so ranks get similar total lengths when the set is sorted by length)."""
    return list(range(rank, num_rollouts, world_size))


@torch.no_grad()
def evaluate_mal(
    drafter: nn.Module,
    target: Any,
    rollouts: list,
    settings: Any,
    ctx: DistContext | None = None,
    amp_dtype: torch.dtype | None = None,
    memo: Any = None,
) -> float:
    """Offline MAL of `drafter` on held-out `rollouts` sampled with `settings`; collective
    with a distributed `ctx`. `memo` (a `scoring.FeatureMemo`) keeps the target's features
    across calls, so later evaluations skip the target forward."""
    rank, world = (ctx.rank, ctx.world_size) if ctx is not None else (0, 1)
    mine = shard_indices(len(rollouts), rank, world)
    device = next(drafter.parameters()).device
    autocast = (
        torch.autocast(device.type, dtype=amp_dtype)
        if amp_dtype is not None
        else contextlib.nullcontext()
    )
    was_training = drafter.training
    drafter.eval()
    try:
        shared = shared_target_features(memo) if memo is not None else contextlib.nullcontext()
        with autocast, shared:
            acc = score_rollouts(
                drafter,
                target,
                [rollouts[i] for i in mine],
                settings.temperature,
                settings.top_p,
                settings.top_k,
                use_cache=False,
            )
    finally:
        drafter.train(was_training)
    if ctx is not None and ctx.distributed:
        ordered: list[torch.Tensor | None] = [None] * len(rollouts)
        for indices, tensors in all_gather_objects((mine, acc), ctx):
            for i, t in zip(indices, tensors, strict=True):
                ordered[i] = t
        acc = [t for t in ordered if t is not None]
        assert len(acc) == len(rollouts), "a held-out rollout was scored by no rank"
    return float(offline_stats(acc).mal)
