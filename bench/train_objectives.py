"""Every objective's training-step time relative to `uniform` (`python bench/train_step.py
--part objectives`; split from bench/train_step.py, which parses the arguments).

Why interleaved: the machine's speed drifts (other processes, thermal state), so every
round times each objective once, in rotating order, on the *same* micro-batch and anchors,
and the reported factor is the median over rounds of time(objective) / time(uniform)
within a round. The paper's claim to check: D-PACE costs <= 1.03x uniform. EDR runs three
times per mode: at the block objectives' budget of drafter blocks with gradient
(`max_anchors` = `--anchors` round starts per rollout) drawn by each round-start sampler
(`gradient`, the default: PPS with Horvitz-Thompson weights on estimated row gradient
norms after a no-grad scoring pass over every round start; `occupancy`: the same pass, PPS
on occupancy; `uniform`: drawn first, only the other round starts scored), and on every
round start (`max_anchors` 512: no sampling, no scoring pass, more blocks with gradient
than the block objectives).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from blockdraft.data.anchors import round_start_anchors
from blockdraft.data.rollout_store import Rollout
from blockdraft.heap import retain_freed_memory
from blockdraft.models.drafter import BlockDrafter, DrafterConfig
from blockdraft.models.testing import make_random_target
from blockdraft.objectives.registry import make_objective
from blockdraft.training.batching import collate
from blockdraft.training.draft_forward import DraftForward
from blockdraft.training.edr_step import edr_micro_step, score_round_starts
from blockdraft.training.objective_step import block_micro_step, pad_anchor_lists

OBJECTIVES = [
    "uniform",
    "decay",
    "dpace",
    "e2e",
    "edr",
    "edr-greedy",
    "edr-occupancy",
    "edr-greedy-occupancy",
    "edr-uniform",
    "edr-greedy-uniform",
    "edr-all",
    "edr-greedy-all",
]
SCORING = "edr-scoring"  # not a step: the equal-budget rows' no-grad scoring pass alone
# EDR rows: name -> (mode, budget, anchor_sampler); "equal": the block objectives' anchors
# per rollout as max_anchors, "all": every round start (max_anchors 512, nothing sampled)
EDR_ROWS = {
    "edr": ("sampling", "equal", "gradient"),  # the default sampler
    "edr-greedy": ("greedy", "equal", "gradient"),  # greedy: A = q(x), no [.., V] distributions
    "edr-occupancy": ("sampling", "equal", "occupancy"),
    "edr-greedy-occupancy": ("greedy", "equal", "occupancy"),
    "edr-uniform": ("sampling", "equal", "uniform"),
    "edr-greedy-uniform": ("greedy", "equal", "uniform"),
    "edr-all": ("sampling", "all", "occupancy"),
    "edr-greedy-all": ("greedy", "all", "occupancy"),
}


class _Settings:
    temperature, top_p, top_k, greedy = 0.7, 1.0, 0, False


def objective_ratios(args: argparse.Namespace) -> None:
    if args.heap == "retain":  # as `blockdraft train`/`demo` run their steps (heap.py)
        retain_freed_memory()
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
        name: make_objective(name)
        if name not in EDR_ROWS
        else make_objective(
            "edr",
            mode=EDR_ROWS[name][0],
            max_anchors=args.anchors if EDR_ROWS[name][1] == "equal" else 512,
            anchor_sampler=EDR_ROWS[name][2],
        )
        for name in OBJECTIVES
    }

    tout = target.forward(
        batch.input_ids, attention_mask=batch.attention_mask.long(), with_logits=True
    )
    every_start = pad_anchor_lists(  # all round starts but the dead last one
        [
            round_start_anchors(int(p), int(n))[:-1]
            for p, n in zip(batch.prompt_lens, batch.response_lens, strict=True)
        ]
    )

    def step(name: str) -> float:
        if name == SCORING:  # features and target logits given, as inside edr_micro_step
            t0 = time.perf_counter()
            score_round_starts(
                fwd, target, tout, batch, every_start, _Settings, "sampling", args.anchors
            )
            return time.perf_counter() - t0
        obj = objectives[name]
        drafter.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        common = dict(seed=0, step=0, settings=_Settings, want_acc=False, alpha=0.5, variant="full")
        if obj.is_rounds_objective:
            mode = EDR_ROWS[name][0]
            out = edr_micro_step(fwd, drafter, target, obj, batch, mode=mode, **common)
        else:
            out = block_micro_step(
                fwd, drafter, target, obj, batch, num_anchors=args.anchors, **common
            )
        out.numerator.backward()
        return time.perf_counter() - t0

    names = [*OBJECTIVES, SCORING]
    for name in names:  # warm-up
        step(name)
    ratios: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        times = {name: step(name) for name in order}
        for name in names:
            ratios[name].append(times[name] / times["uniform"])
    blocks = args.batch * min(args.anchors, args.response - 1)
    starts = args.batch * (args.response - 2)  # round starts n = 1..L-2 (the last has no block)
    sampled = args.batch * min(args.anchors, args.response - 2)
    print(
        f"train step time relative to uniform (median of {args.rounds} interleaved rounds; "
        f"batch {args.batch} x {args.response} response tokens, block {args.block_size}; "
        f"block objectives: {blocks} sampled blocks with gradient)\n"
        "  edr / edr-greedy: EDR at the same budget with the default sampler (gradient: PPS "
        "on estimated row gradient norms, Horvitz-Thompson weights), max_anchors "
        f"{args.anchors} per rollout = {sampled} blocks with gradient, plus a no-grad scoring "
        f"pass over all {starts} round starts\n"
        "  edr-occupancy / edr-greedy-occupancy: the same, PPS on round-start occupancy\n"
        "  edr-uniform / edr-greedy-uniform: the same budget drawn uniformly first "
        f"(anchor_sampler uniform): {sampled} blocks with gradient + the other "
        f"{starts - sampled} scored without (noisier: bench/edr_sampler.py)\n"
        f"  edr-all / edr-greedy-all: every one of the {starts} drafted round starts with "
        "gradient (max_anchors 512), no scoring pass\n"
        "  (edr* = sampling-mode EDR, TV cost on full distributions; edr-greedy* = A = q(x))"
    )
    for name in OBJECTIVES:
        factor = statistics.median(ratios[name])
        note = ""
        if name in EDR_ROWS and EDR_ROWS[name][1] == "all":
            note = (
                f"   {factor * blocks / starts:.3f}x per block with gradient ({starts} vs {blocks})"
            )
        elif name in EDR_ROWS and EDR_ROWS[name][2] == "uniform":
            note = (
                f"   equal budget: {sampled} blocks with gradient + {starts - sampled} scored "
                "without"
            )
        elif name in EDR_ROWS:
            note = f"   equal budget: {sampled} blocks with gradient + {starts} scored without"
        print(f"  {name:20s} {factor:.3f}x{note}")
    print(
        f"  of which the scoring pass alone (no grad, all {starts} round starts, sampling mode, "
        f"{args.anchors} per rollout per pass; target forward not included): "
        f"{statistics.median(ratios[SCORING]):.3f}x uniform's step"
    )
