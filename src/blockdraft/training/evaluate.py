"""Held-out offline MAL during training: the number users care about, not the loss.

The drafter is scored with the shared `blockdraft.evaluation.scoring` (every round start
of every held-out rollout; greedy `1[argmax q = x]`, sampling `min(1, q(x)/p(x))` with q
processed like the decoder does) and the exact offline evaluator turns the acceptance
tensors into the mean accepted length, so training curves and `blockdraft eval` report
the same number for the same drafter and rollouts.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def evaluate_mal(drafter: nn.Module, target, rollouts: list, settings) -> float:
    """Offline MAL of `drafter` on held-out `rollouts` sampled with `settings`."""
    from blockdraft.evaluation.offline import offline_stats
    from blockdraft.evaluation.scoring import score_rollouts

    was_training = drafter.training
    drafter.eval()
    try:
        acc = score_rollouts(
            drafter,
            target,
            rollouts,
            settings.temperature,
            settings.top_p,
            settings.top_k,
            use_cache=False,
        )
        return float(offline_stats(acc).mal)
    finally:
        drafter.train(was_training)
