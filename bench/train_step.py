"""Training-step speed: old vs new drafter path at three shapes, attention memory, and
every objective's step time relative to `uniform`, each measured side by side in one run.

Throughput (`--part throughput`): drafter forward + cross-entropy + backward on fixed
target features (the target forward is not timed: cached features remove it, see
bench/train_features.py). "old" = dense block mask + chunked cross-entropy (main before
issue 12); "new" = the defaults (tiled block attention on CPU, probabilities kept when
they fit `cross_entropy.MAX_KEPT_PROBS_BYTES`). Paths alternate step by step on the same
batch and the ratio is the median of per-round ratios. Shapes: the demo's `tiny` step,
a Gemma-3-270M-shaped step (random weights, its config's 32k draft vocabulary) and
DFlash's GPU recipe scaled down to fit this CPU.

Heap and memory (`--part heap`, `--part memory`): run in fresh processes by
bench/train_memory.py (glibc keeping freed memory vs its defaults; peak RSS growth of
`forward_blocks` per attention path, and the full recipe's attention memory).

bf16 autocast (`--part amp`): the same "new" step in fp32 and under CPU bf16 autocast
(`amp: bf16`), alternating, with this CPU's bf16 and fp32 GEMM rates: the ratio says whether
`amp=bf16` pays here (CPUs with bf16 matrix units, e.g. Intel AMX) or costs (without them).
Shape `servable`: the DFlash form of configs/gemma-3-270m.yaml's drafter (2 layers, block 8,
8k draft vocabulary, batch 8 x 32 anchors) on Gemma 3 270M's geometry.

Objectives (`--part objectives`): bench/train_objectives.py (every objective's step time
relative to `uniform`, EDR with each round-start sampler).

    python bench/train_step.py [--part all|throughput|amp|heap|memory|objectives]
        [--rounds 15] [--shapes servable]
        [--block-size 8] [--response 96] [--batch 4]
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import time

import torch

import blockdraft.objectives.cross_entropy as ce
import train_memory
import train_objectives
from blockdraft.training.draft_forward import DraftForward
from common import PATHS, SHAPES, build, drafter_step


# --- throughput: old vs new drafter path -----------------------------------------------------
def gemm_rate(n: int = 1024, reps: int = 20, dtype: torch.dtype = torch.float32) -> float:
    """This CPU's GEMM rate (FLOP/s) in `dtype` on square products into a reused buffer:
    the ceiling every step below is compared with (its FLOPs are mostly such products)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    out = torch.empty(n, n, dtype=dtype)
    torch.mm(a, b, out=out)
    t0 = time.perf_counter()
    for _ in range(reps):
        torch.mm(a, b, out=out)
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def step_flops(fwd: DraftForward, batch, path: str) -> float:  # type: ignore[no-untyped-def]
    """FLOPs of one step on `path` (torch's counter: matmuls and attention)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        drafter_step(fwd, batch, path)
    return float(counter.get_total_flops())


def interleaved(run, keys: list, rounds: int) -> dict:  # type: ignore[no-untyped-def]
    """Seconds of `run(key)` per key: one warm-up each, then `rounds` rounds, each starting
    one key later than the last (machine drift hits every key alike)."""
    for key in keys:
        run(key)
    times: dict = {key: [] for key in keys}
    for r in range(rounds):
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            times[key].append(run(key))
    return times


def throughput(shapes: list[str], rounds: int) -> None:
    peak = gemm_rate()
    print(
        "drafter training step (features given), old = dense mask + chunked CE, "
        f"new = defaults; median of {rounds} interleaved rounds; this CPU's fp32 GEMM rate "
        f"{peak / 1e9:.0f} GFLOP/s ('floor': the step's FLOPs at that rate)"
    )
    for name in shapes:
        s = SHAPES[name]
        batch = build(s)
        fwd = DraftForward(batch[0])
        labels = int((batch[4] >= 0).sum())
        paths = ["old", "new"] + (["attn-only", "ce-only"] if name == "tiny" else [])
        times = interleaved(functools.partial(drafter_step, fwd, batch), paths, rounds)
        rows, vocab = labels, s.draft_vocab or s.vocab
        kept = ce.keeps_probabilities(batch[4].numel(), vocab, torch.float32, PATHS["new"][1])
        print(
            f"  {name}: B={s.batch} T={s.prompt + s.response} anchors={s.anchors} "
            f"block={s.block} width={s.hidden} vocab={vocab} layers={s.drafter_layers} "
            f"({rows} labels; new CE {'keeps probabilities' if kept else 'chunked'})"
        )
        for path in paths:
            med = statistics.median(times[path])
            ratio = statistics.median(o / t for o, t in zip(times["old"], times[path], strict=True))
            flops = step_flops(fwd, batch, path)
            print(
                f"    {path:9s} {med:7.3f} s/step {rows / med:9.0f} label tok/s  "
                f"speed vs old {ratio:.2f}x  {flops / 1e9:6.1f} GFLOP/step "
                f"{flops / med / 1e9:5.0f} GFLOP/s  floor {flops / peak:.3f} s "
                f"(old / floor {statistics.median(times['old']) / (flops / peak):.1f}x)"
            )
        del batch, fwd
        gc.collect()
        ce.MAX_KEPT_PROBS_BYTES = PATHS["new"][1]


def amp_speed(shapes: list[str], rounds: int) -> None:
    fp32, bf16 = gemm_rate(), gemm_rate(dtype=torch.bfloat16)
    print(
        f"drafter training step, fp32 vs CPU bf16 autocast (amp: bf16), median of {rounds} "
        f"interleaved rounds; GEMM 1024^3: fp32 {fp32 / 1e9:.0f} GFLOP/s, bf16 "
        f"{bf16 / 1e9:.0f} GFLOP/s ({bf16 / fp32:.2f}x)"
    )
    for name in shapes:
        s = SHAPES[name]
        batch = build(s)
        fwd = DraftForward(batch[0])
        times = interleaved(
            functools.partial(drafter_step, fwd, batch, "new"), [False, True], rounds
        )
        ratio = statistics.median(a / b for a, b in zip(times[False], times[True], strict=True))
        print(
            f"  {name}: B={s.batch} anchors={s.anchors} block={s.block} width={s.hidden} "
            f"vocab={s.draft_vocab or s.vocab} layers={s.drafter_layers}: fp32 "
            f"{statistics.median(times[False]):.3f} s/step, bf16 "
            f"{statistics.median(times[True]):.3f} s/step, bf16 speed {ratio:.2f}x fp32"
        )
        del batch, fwd
        gc.collect()


# --- objective ratios -------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--part",
        default="all",
        choices=["all", "throughput", "amp", "heap", "memory", "objectives"],
    )
    ap.add_argument("--rounds", type=int, default=15, help="objective-ratio rounds")
    ap.add_argument("--throughput-rounds", type=int, default=5)
    ap.add_argument("--shapes", default="tiny,gemma,recipe")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: stable on busy hosts)"
    )
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--response", type=int, default=96, help="response tokens per sequence")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument(
        "--anchors",
        type=int,
        default=512,
        help="objectives, library defaults: num_anchors = objective.max_anchors (512)",
    )
    ap.add_argument(
        "--sampled-anchors",
        type=int,
        default=64,
        help="objectives, sub-sampled: anchors / EDR round starts with gradient per sequence",
    )
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument(
        "--heap",
        default="retain",
        choices=["retain", "default"],
        help="objectives: glibc keeps freed memory as in training (retain) or its defaults",
    )
    ap.add_argument("--objectives-shape", default="tiny", choices=["tiny", "gemma"])
    ap.add_argument(
        "--steps-per-turn",
        type=int,
        default=None,
        help="objectives: consecutive steps per row and turn, the last one timed "
        "(default 1 at the tiny shape, 2 at the Gemma one)",
    )
    ap.add_argument(
        "--denormals",
        default="flush",
        choices=["flush", "keep"],
        help="objectives: flush denormals to zero as `blockdraft train` does, or keep them",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.part in ("all", "throughput"):
        throughput(args.shapes.split(","), args.throughput_rounds)
    if args.part in ("all", "amp"):
        amp_speed(args.shapes.split(","), args.throughput_rounds)
    if args.part in ("all", "heap", "memory"):  # fresh processes: bench/train_memory.py
        if args.part != "memory":
            train_memory.heap_report(args.shapes.split(","), args.threads, args.throughput_rounds)
        if args.part != "heap":
            train_memory.memory_report(args.threads)
    if args.part in ("all", "objectives"):
        train_objectives.objective_ratios(args)


if __name__ == "__main__":
    main()
