"""How much gradient variance better PPS sizes could save: each size rule next to the
oracle (sizes = the true per-row gradient norms), on a trained drafter and real rollouts.

Why: PPS with Horvitz-Thompson weights is unbiased for any sizes (positive wherever a row
can contribute), and its variance is smallest when rows are drawn in proportion to the
norm of their gradient. This bench computes every round start's own gradient `g_n`
exactly (one backward per row through `edr_surrogate` with a one-hot row weight) and
prints, per size rule, `sum_n (1/pi_n - 1) ||g_n||^2` (the variance of Poisson sampling
with inclusion probabilities `pi`, a close stand-in for the systematic design the step
uses) relative to occupancy sizes: `gradient` is `gradient_sizes` (the default sampler's
sizes); `oracle` is the floor that no rule computed from the recursion outputs can beat.
research/bench/edr_sampler.py measures the real step variance of the samplers.

    python research/bench/edr_sampler_sizes.py [--demo blockdraft-demo] [--drafter DIR]
        [--rollouts DIR] [--max-anchors 32] [--batch 4] [--mode auto]
"""

from __future__ import annotations

import argparse

import torch
from edr_sampler import _Settings, common_arguments, load_inputs

from blockdraft.data.anchors import round_start_anchors
from blockdraft.objectives.edr import (
    edr_surrogate,
    gradient_sizes,
    greedy_gradient_moments,
    inclusion_probabilities,
    occupancy_and_value,
)
from blockdraft.training.batching import Batch
from blockdraft.training.steps import rounds


def _row_gradient_norms(fwd, drafter, target, batch: Batch, i: int, mode: str):
    """`(acceptance [N+1, K], state, ||g_n|| [N], moments [N+1, K, 3])` of rollout i:
    every usable round start drafted with gradient, one backward per row; the moments
    are those the `gradient` sampler uses (`gradient_sizes`)."""
    one = Batch(**{k: v[i : i + 1] for k, v in batch.__dict__.items()})
    tout = target.forward(
        one.input_ids, attention_mask=one.attention_mask.long(), with_logits=mode == "sampling"
    )
    starts = round_start_anchors(int(one.prompt_lens[0]), int(one.response_lens[0]))
    rb = rounds.RoundsBatch(fwd, target.stop_token_ids, tout, one, _Settings, mode)
    acc, cost, *_ = rounds._acceptance(rb, starts[:-1][None], True)
    k = acc.shape[-1]
    acc = torch.cat([acc[0], acc.new_zeros(1, k)])  # + the dead last row
    cost = torch.cat([cost[0], cost.new_zeros(1, k)])
    state = occupancy_and_value(acc.detach().double(), cost.detach().double())
    if mode == "sampling":
        *_, moments = rounds.score_round_starts(rb, starts[:-1][None], 1 << 30, moments=True)
        moments = torch.cat([moments[0], moments.new_zeros(1, k, 3)])
    else:
        moments = greedy_gradient_moments(acc.detach())
    params = [p for p in drafter.parameters() if p.requires_grad]
    norms = []
    for n in range(acc.shape[0] - 1):
        weights = torch.zeros(acc.shape[0], dtype=acc.dtype)
        weights[n] = 1.0
        grads = torch.autograd.grad(
            edr_surrogate(acc, cost, row_weights=weights), params, retain_graph=True,
            allow_unused=True,
        )  # fmt: skip
        norms.append(sum(float((g.double() ** 2).sum()) for g in grads if g is not None) ** 0.5)
    return acc.detach(), state, torch.tensor(norms, dtype=torch.float64), moments


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_arguments(ap)
    args = ap.parse_args()
    target, drafter, fwd, batch, mode, drafter_dir = load_inputs(args)
    totals: dict[str, float] = {}
    for i in range(batch.input_ids.shape[0]):
        if int(batch.response_lens[i]) - 2 <= args.max_anchors:
            continue  # every usable round start is drafted: nothing is sampled
        acc, state, norms, moments = _row_gradient_norms(fwd, drafter, target, batch, i, mode)
        rows = norms.numel()
        sizes = {
            "uniform": torch.ones(rows, dtype=torch.float64),
            "occupancy": state.occupancy[:rows, 0],
            "gradient": gradient_sizes(state.occupancy, state.td, moments)[:rows],
            "oracle": norms,
        }
        for name, size in sizes.items():
            pi = inclusion_probabilities(size, args.max_anchors)
            drawable = pi > 0
            if bool((norms[~drawable] > 0).any()):
                raise SystemExit(f"{name}: a row with gradient can never be drawn (biased sizes)")
            value = float(((1 / pi[drawable] - 1) * norms[drawable] ** 2).sum())
            totals[name] = totals.get(name, 0.0) + value
    if not totals:
        raise SystemExit(f"no rollout has more than --max-anchors {args.max_anchors} round starts")
    lengths = [int(n) for n in batch.response_lens]
    print(
        f"PPS sizes ({mode} mode, rollouts of {lengths} response tokens, max_anchors "
        f"{args.max_anchors}, drafter {drafter_dir}): Poisson-sampling variance of the "
        "gradient relative to occupancy sizes (< 1: less noise at the same budget)"
    )
    for name, value in totals.items():
        print(f"  {name:10s} {value / totals['occupancy']:.3f}")


if __name__ == "__main__":
    main()
