"""The step `blockdraft train` runs, on random rollouts and without files.

Why: the GPU check (`bench/gpu_check.py`, `tests/gpu/`) must time the step a user's run
takes, not a look-alike: `synthetic_run` builds it with the trainer's own builders, for
one process; `loop.train_step` runs it. Random ids serve costs, not quality.
"""

from __future__ import annotations

from typing import Any

import torch

from blockdraft.data.rollouts.shards import Rollout
from blockdraft.training.builders import RolloutData, build_drafter, build_objective, resolve_mode
from blockdraft.training.distributed import DistContext
from blockdraft.training.draft_forward import DraftForward
from blockdraft.training.feature_sources import OnlineTargetFeatures
from blockdraft.training.loop import LoopParts, build_loop_parts


def random_rollouts(
    num: int,
    prompt_len: int,
    response_len: int,
    vocab_size: int,
    seed: int = 0,
    first_id: int = 3,
) -> list[Rollout]:
    """`num` rollouts of uniformly random ids in `[first_id, vocab_size)` (the first
    few ids of the test tokenizers are special tokens)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num):
        prompt = torch.randint(first_id, vocab_size, (prompt_len,), generator=g)
        response = torch.randint(first_id, vocab_size, (response_len,), generator=g)
        out.append(Rollout(f"r{i}", prompt, response, torch.zeros(response_len)))
    return out


def synthetic_run(
    cfg: Any, target: Any, rollouts: list[Rollout], settings: Any, device: torch.device
) -> LoopParts:
    """`LoopParts` of a one-process run of `cfg` on `rollouts` (sampled with `settings`),
    the target already on `device`; pass it to `loop.train_step(parts, step, want_acc)`."""
    data = RolloutData(rollouts, settings, "synthetic rollouts")
    mode = resolve_mode(cfg, data, None)
    objective = build_objective(cfg, mode)
    drafter = build_drafter(cfg, target, data, device)
    return build_loop_parts(
        cfg, DistContext(0, 1, 0, device), target, data,
        drafter=drafter, fwd=DraftForward(drafter), features=OnlineTargetFeatures(target),
        objective=objective, mode=mode,
    )  # fmt: skip
