"""Every objective's training-step time relative to `uniform` (`python bench/train_step.py
--part objectives`; split from bench/train_step.py, which parses the arguments).

Why interleaved: the machine's speed drifts (other processes, thermal state), so every
round times each row once, in rotating order, on the *same* micro-batch, and the reported
factor is the median over rounds of time(row) / time(its baseline) within a round.

Two regimes, each against the `uniform` step of the same settings:

- **library defaults** (`--anchors`, default 512 = `num_anchors` = `objective.max_anchors`
  of TrainConfig): the bench's rollouts have fewer round starts than that, so the block
  objectives train a block at every round start and EDR drafts every round start with
  gradient (no sampling, no scoring pass). Same blocks with gradient on both sides: this
  is what a user running `blockdraft train` with and without `objective.name=edr` pays.
  The paper's claim to check: D-PACE <= 1.03x uniform; issue 14's: EDR <= 1.3x.
- **sub-sampled** (`--sampled-anchors`, default 64 of the 94 round starts per rollout):
  the block objectives sample 64 anchors per sequence; EDR draws 64 round starts per
  rollout with gradient by each round-start sampler (`gradient`, the default: PPS on
  estimated row gradient norms after a no-grad scoring pass over every round start;
  `occupancy`: the same pass, PPS on occupancy; `uniform`: drawn first, only the other
  round starts scored). This is what rollouts longer than `max_anchors` cost (at the
  defaults: responses over 513 tokens): the exact gradient needs every round start's
  current acceptance, so EDR also scores the round starts it does not draft.

`--objectives-shape gemma`: the same rows at the Gemma-3-270M shape of bench/train_step.py
(random weights, the 262k target vocabulary, configs/gemma-3-270m.yaml's drafter: 2 layers,
block 16, 32k draft vocabulary; 2 rollouts x (128 + 256) tokens, steps take seconds, so
only the library-default rows: the sub-sampled ones are the tiny shape's). There each
turn runs `--steps-per-turn` (default 2 at this shape) consecutive steps of one row and
times the last: a training run repeats one objective, and its gigabyte-sized buffers
come back from the heap warm, while a step right after another objective's pays for
fresh pages (1.4x vs 2.0x for sampling EDR here). Training flushes denormals
(`threads.flush_denormals`); `--denormals keep` shows what that is worth.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from blockdraft.data.anchors import round_start_anchors
from blockdraft.data.rollouts.store import Rollout
from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
from blockdraft.heap import retain_freed_memory
from blockdraft.objectives.registry import make_objective
from blockdraft.threads import flush_denormals
from blockdraft.training.batching import collate
from blockdraft.training.draft_forward import DraftForward
from blockdraft.training.feature_sources import OnlineTargetFeatures
from blockdraft.training.steps import StepInputs
from blockdraft.training.steps.anchored_blocks import pad_anchor_lists
from blockdraft.training.steps.block import block_step
from blockdraft.training.steps.rounds import RoundsBatch, rounds_step, score_round_starts
from common import SHAPES, random_target
from fixture_targets import make_random_target


@dataclasses.dataclass(frozen=True)
class Row:
    """One timed step: an objective at a budget, reported relative to `baseline`'s step."""

    objective: str
    sampled: bool  # the sub-sampled regime (--sampled-anchors) instead of the defaults
    mode: str = ""  # EDR: sampling (TV cost on full distributions) | greedy (A = q(x))
    sampler: str = "gradient"  # EDR's anchor_sampler (only matters when sub-sampled)

    @property
    def name(self) -> str:
        edr = f"-{self.mode}" if self.mode == "greedy" else ""
        sampler = f"/{self.sampler}" if self.sampled and self.objective == "edr" else ""
        return f"{self.objective}{edr}{sampler}" + (" @sub" if self.sampled else "")

    @property
    def baseline(self) -> str:
        return Row("uniform", self.sampled).name


ROWS = [
    Row("uniform", False),
    Row("decay", False),
    Row("dpace", False),
    Row("e2e", False),
    Row("edr", False, "sampling"),
    Row("edr", False, "greedy"),
    Row("uniform", True),
    *(
        Row("edr", True, mode, sampler)
        for mode in ("sampling", "greedy")
        for sampler in ("gradient", "occupancy", "uniform")
    ),
]
SCORING = "edr scoring pass @sub"  # not a step: the sub-sampled rows' no-grad pass alone
CROSS = "uniform / uniform @sub"


GEMMA_ROWS = {  # the rows that run at the Gemma shape (steps of seconds, not milliseconds)
    row.name
    for row in [
        Row("uniform", False), Row("dpace", False), Row("e2e", False),
        Row("edr", False, "sampling"), Row("edr", False, "greedy"),
    ]
}  # fmt: skip


class _Settings:
    temperature, top_p, top_k, greedy = 0.7, 1.0, 0, False


def _bench_batch(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """A random target, a fresh drafter and one micro-batch of random rollouts: the tiny
    shape (one-layer drafter, 375-token vocabulary, 32-token prompts) or the Gemma one."""
    torch.manual_seed(0)
    prompt_len, token_limit = 32, None
    if args.objectives_shape == "gemma":
        s = SHAPES["gemma"]
        target = random_target(s)
        config = DrafterConfig.for_target(
            target, num_layers=s.drafter_layers, block_size=s.block, draft_vocab_size=s.draft_vocab
        )
        drafter = BlockDrafter(config)
        drafter.set_draft_vocab(torch.arange(s.draft_vocab))
        args.batch, args.response, args.block_size = s.batch, s.response, s.block
        prompt_len, token_limit = s.prompt, s.draft_vocab  # tokens of the draft vocabulary
    else:
        target = make_random_target("qwen3", hidden_size=args.hidden, num_layers=4, num_heads=4)
        drafter = BlockDrafter(
            DrafterConfig.for_target(target, num_layers=1, block_size=args.block_size)
        )
    drafter.bind_target(target)
    top = token_limit or target.vocab_size
    gen = torch.Generator().manual_seed(1)
    rows = []
    for i in range(args.batch):
        prompt = torch.randint(3, top, (prompt_len,), generator=gen)
        resp = torch.randint(3, top, (args.response,), generator=gen)
        rows.append(Rollout(f"b{i}", prompt, resp, torch.full((args.response,), -1.0)))
    return target, drafter, collate(rows, list(range(len(rows))), 1, 4096)


def objective_ratios(args: argparse.Namespace) -> None:
    if args.heap == "retain":  # as `blockdraft train`/`demo` run their steps (heap.py)
        retain_freed_memory()
    if args.denormals == "flush":  # as `blockdraft train` runs (threads.py)
        flush_denormals()
    target, drafter, batch = _bench_batch(args)
    rows = ROWS if args.objectives_shape == "tiny" else [r for r in ROWS if r.name in GEMMA_ROWS]
    fwd = DraftForward(drafter)
    source = OnlineTargetFeatures(target)

    def budget(row: Row) -> int:
        return args.sampled_anchors if row.sampled else args.anchors

    objectives = {
        row.name: make_objective(row.objective)
        if row.objective != "edr"
        else make_objective(
            "edr", mode=row.mode, max_anchors=budget(row), anchor_sampler=row.sampler
        )
        for row in rows
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
        if name == SCORING:  # features and target logits given, as inside rounds_step
            t0 = time.perf_counter()
            rb = RoundsBatch(fwd, target.stop_token_ids, tout, batch, _Settings, "sampling")
            score_round_starts(rb, every_start, args.sampled_anchors, moments=True)
            return time.perf_counter() - t0
        row = by_name[name]
        obj = objectives[name]
        drafter.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        if row.objective == "edr":
            inputs = StepInputs(
                fwd, drafter, source, obj, _Settings, mode=row.mode,
                stop_token_ids=target.stop_token_ids,
            )  # fmt: skip
            out = rounds_step(inputs, batch, 0, False)
        else:
            inputs = StepInputs(fwd, drafter, source, obj, _Settings, num_anchors=budget(row))
            out = block_step(inputs, batch, 0, False)
        out.numerator.backward()
        return time.perf_counter() - t0

    by_name = {row.name: row for row in rows}
    names = [*by_name] + ([SCORING] if args.objectives_shape == "tiny" else [])
    for name in names:  # warm-up
        step(name)
    ratios: dict[str, list[float]] = {n: [] for n in names}
    ratios[CROSS] = []  # the defaults' uniform step / the sub-sampled one (more blocks)
    turn = args.steps_per_turn or (1 if args.objectives_shape == "tiny" else 2)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        times = {name: [step(name) for _ in range(turn)][-1] for name in order}
        for name in names:
            base = by_name[name].baseline if name in by_name else Row("uniform", True).name
            ratios[name].append(times[name] / times[base])
        if Row("uniform", True).name in times:
            sub = times[Row("uniform", True).name]
            ratios[CROSS].append(times[Row("uniform", False).name] / sub)
    _report(args, ratios, rows, target.vocab_size)


def _report(args: argparse.Namespace, ratios: dict[str, list[float]], rows, vocab) -> None:
    starts = args.response - 2  # round starts n = 1..L-2 per rollout (the last has no block)
    full = args.batch * min(args.anchors, args.response - 1)
    edr_full = args.batch * min(args.anchors, starts)
    sub = args.batch * min(args.sampled_anchors, args.response - 1)
    edr_sub = args.batch * min(args.sampled_anchors, starts)
    sub_line = (
        f"  @sub ({args.sampled_anchors} per rollout): block objectives {sub} blocks, EDR "
        f"{edr_sub} drawn with gradient by the named sampler + the no-grad scoring of "
        f"{args.batch * starts} round starts (uniform sampler: the {args.batch * starts - edr_sub}"
        " not drawn)\n"
    )
    print(
        f"train step time relative to uniform at the same settings (median of {args.rounds} "
        f"interleaved rounds; {args.objectives_shape} shape: batch {args.batch} x "
        f"{args.response} response tokens, block {args.block_size}, vocabulary {vocab}; "
        f"denormals {args.denormals}; {args.steps_per_turn or 'default'} steps per turn)\n"
        f"  library defaults (num_anchors = max_anchors = {args.anchors}): block objectives "
        f"{full} blocks with gradient, EDR {edr_full} "
        + ("(every round start, nothing sampled)\n" if args.anchors >= starts else "(sampled)\n")
        + (sub_line if any(row.sampled for row in rows) else "")
        + "  (edr = sampling-mode EDR, TV cost on full distributions; edr-greedy = A = q(x))"
    )
    for row in rows:
        factor = statistics.median(ratios[row.name])
        print(f"  {row.name:28s} {factor:.3f}x")
    if SCORING in ratios and ratios[SCORING]:
        print(
            f"  {SCORING:28s} {statistics.median(ratios[SCORING]):.3f}x uniform @sub's step "
            f"(no grad, all {args.batch * starts} round starts with moments, target forward "
            "not included)"
        )
    if not ratios[CROSS]:
        return
    cross = statistics.median(ratios[CROSS])
    print(
        f"  {CROSS:28s} {cross:.3f}x ({full} vs {sub} blocks): EDR on every round start = "
        f"{statistics.median(ratios['edr']) * cross:.3f}x uniform @sub's step (greedy "
        f"{statistics.median(ratios['edr-greedy']) * cross:.3f}x)"
    )
