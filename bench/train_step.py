"""Training-step time of every objective relative to `uniform`, same batch, one run.

Why interleaved: the machine's speed drifts (other processes, thermal state), so every
round times each objective once, in rotating order, on the *same* micro-batch and anchors,
and the reported factor is the median over rounds of time(objective) / time(uniform)
within a round. The paper's claim to check: D-PACE costs <= 1.03x uniform; EDR's factor
is reported (it trains on every round start and needs full drafter distributions).

    python bench/train_step.py [--rounds 15] [--block-size 8] [--response 96] [--batch 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from blockdraft.data.rollout_store import Rollout
from blockdraft.models.drafter import BlockDrafter, DrafterConfig
from blockdraft.models.testing import make_random_target
from blockdraft.objectives.registry import make_objective
from blockdraft.training.batching import collate
from blockdraft.training.draft_forward import DraftForward
from blockdraft.training.edr_step import edr_micro_step
from blockdraft.training.objective_step import block_micro_step

OBJECTIVES = ["uniform", "decay", "dpace", "e2e", "edr"]


class _Settings:
    temperature, top_p, top_k, greedy = 0.7, 1.0, 0, False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--response", type=int, default=96, help="response tokens per sequence")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--anchors", type=int, default=64, help="num_anchors for block objectives")
    ap.add_argument("--hidden", type=int, default=128)
    args = ap.parse_args()
    torch.manual_seed(0)
    target = make_random_target("qwen3", hidden_size=args.hidden, num_layers=4, num_heads=4)
    drafter = BlockDrafter(
        DrafterConfig.for_target(target, num_layers=1, block_size=args.block_size)
    )
    drafter.bind_target(target)
    fwd = DraftForward(drafter)
    gen = torch.Generator().manual_seed(1)
    rows = []
    for i in range(args.batch):
        prompt = torch.randint(3, target.vocab_size, (32,), generator=gen)
        resp = torch.randint(3, target.vocab_size, (args.response,), generator=gen)
        rows.append(Rollout(f"b{i}", prompt, resp, torch.full((args.response,), -1.0)))
    batch = collate(rows, list(range(len(rows))), 1, 4096)
    objectives = {
        name: make_objective(
            name, **({"mode": "sampling", "max_anchors": 512} if name == "edr" else {})
        )
        for name in OBJECTIVES
    }

    def step(name: str) -> float:
        obj = objectives[name]
        drafter.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        common = dict(seed=0, step=0, settings=_Settings, want_acc=False, alpha=0.5, variant="full")
        if obj.is_rounds_objective:
            out = edr_micro_step(fwd, drafter, target, obj, batch, mode="sampling", **common)
        else:
            out = block_micro_step(
                fwd, drafter, target, obj, batch, num_anchors=args.anchors, **common
            )
        out.numerator.backward()
        return time.perf_counter() - t0

    for name in OBJECTIVES:  # warm-up
        step(name)
    ratios: dict[str, list[float]] = {n: [] for n in OBJECTIVES}
    for r in range(args.rounds):
        order = OBJECTIVES[r % len(OBJECTIVES) :] + OBJECTIVES[: r % len(OBJECTIVES)]
        times = {name: step(name) for name in order}
        for name in OBJECTIVES:
            ratios[name].append(times[name] / times["uniform"])
    blocks = args.batch * min(args.anchors, args.response - 1)
    print(
        f"train step time relative to uniform (median of {args.rounds} interleaved rounds; "
        f"batch {args.batch} x {args.response} response tokens, block {args.block_size}, "
        f"{blocks} sampled blocks for block objectives, all {args.batch * (args.response - 1)} "
        f"round starts for edr)"
    )
    for name in OBJECTIVES:
        print(f"  {name:8s} {statistics.median(ratios[name]):.3f}x")


if __name__ == "__main__":
    main()
