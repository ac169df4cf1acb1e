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
import dataclasses
import functools
import gc
import statistics
import time
from dataclasses import dataclass

import torch

import blockdraft.objectives.cross_entropy as ce
from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
from blockdraft.objectives.cross_entropy import weighted_cross_entropy
from blockdraft.targets.target import Target
from blockdraft.targets.testing import make_random_target
from blockdraft.training.draft_forward import DraftForward


# --- throughput: old vs new drafter path -----------------------------------------------------
@dataclass(frozen=True)
class Shape:
    name: str
    arch: str  # HF architecture of the random target
    batch: int
    prompt: int
    response: int
    anchors: int
    block: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    target_layers: int
    drafter_layers: int
    draft_vocab: int | None = None


SHAPES = {
    # the demo's step: 8 sequences x 64 anchors x block 8, tiny target (4 layers, width 128)
    "tiny": Shape("tiny", "qwen3", 8, 48, 128, 64, 8, 128, 4, 2, 32, 384, 4096, 4, 1),
    # Gemma 3 270M geometry and configs/gemma-3-270m.yaml's drafter (2 layers, block 16,
    # 32k draft vocabulary); batch and length cut so a step takes seconds on CPU
    "gemma": Shape(
        "gemma", "gemma3", 2, 128, 256, 64, 16, 640, 4, 1, 256, 2048, 262144, 6, 2, 32768
    ),
    # configs/gemma-3-270m.yaml's batch and drafter as DFlash (2 layers, block 8, 8k vocabulary)
    "servable": Shape(
        "servable", "gemma3", 8, 64, 128, 32, 8, 640, 4, 1, 256, 2048, 262144, 6, 2, 8192
    ),
    # DFlash's recipe (T=3072, 512 anchors, block 16, Qwen3 vocabulary) scaled down 4x in
    # length and anchors, 8x in width, 1 drafter layer, and a 16k draft vocabulary: with
    # the full 152k vocabulary both paths run the same chunked CE (1,920 x 151,936 rows do
    # not fit the budget) and one step takes minutes on a shared CPU
    "recipe": Shape(
        "recipe", "qwen3", 1, 128, 640, 128, 16, 512, 8, 2, 64, 1536, 151936, 4, 1, 16384
    ),
}


# The scaled recipe with 256 anchors (half the recipe's 512): the attention-specific memory
# then dominates the peak, as it does at the full recipe.
MEMORY_SHAPE = dataclasses.replace(SHAPES["recipe"], anchors=256)


def random_target(s: Shape) -> Target:
    """A random target of the shape's geometry (weights never run: features are given)."""
    small = make_random_target("qwen3")  # borrows its tokenizer and mask token
    common = dict(
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_hidden_layers=s.target_layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        max_position_embeddings=4096,
    )
    if s.arch == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        model = Gemma3ForCausalLM(Gemma3TextConfig(**common, query_pre_attn_scalar=s.head_dim))
    else:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        model = Qwen3ForCausalLM(Qwen3Config(**common, tie_word_embeddings=True))
    return Target(
        model, small.tokenizer, name=f"random-{s.name}", mask_token_id=small.mask_token_id
    )


def build(s: Shape, seed: int = 0):  # type: ignore[no-untyped-def]
    """(drafter, features, input_ids, anchors [sorted, as sampled], labels, prev)."""
    torch.manual_seed(seed)
    target = random_target(s)
    cfg = DrafterConfig.for_target(
        target, num_layers=s.drafter_layers, block_size=s.block, draft_vocab_size=s.draft_vocab
    )
    drafter = BlockDrafter(cfg).bind_target(target)
    if s.draft_vocab:
        drafter.set_draft_vocab(torch.arange(s.draft_vocab))
    g = torch.Generator().manual_seed(seed)
    T, K = s.prompt + s.response, s.block - 1
    ids = torch.randint(3, s.draft_vocab or s.vocab, (s.batch, T), generator=g)
    feats = torch.randn(s.batch, T, target.feature_size, generator=g)
    anchors = torch.stack(
        [
            s.prompt + torch.randperm(s.response - 1, generator=g)[: s.anchors].sort().values
            for _ in range(s.batch)
        ]
    )
    pos = anchors[..., None] + torch.arange(1, K + 1)
    labels = torch.where(
        pos < T, ids.gather(1, pos.clamp(max=T - 1).flatten(1)).view(pos.shape), -1
    )
    prev = torch.cat([ids.gather(1, anchors)[..., None], labels[..., :-1].clamp(min=0)], -1)
    return drafter, feats, ids, anchors, labels, prev


PATHS = {  # name -> (attention, MAX_KEPT_PROBS_BYTES)
    "old": ("dense", 0),
    "new": ("auto", ce.MAX_KEPT_PROBS_BYTES),
    "attn-only": ("auto", 0),
    "ce-only": ("dense", ce.MAX_KEPT_PROBS_BYTES),
}


def drafter_step(fwd: DraftForward, batch, path: str, bf16: bool = False) -> float:  # type: ignore[no-untyped-def]
    """One drafter forward + uniform-weighted CE + backward on `path` (under CPU bf16
    autocast when `bf16`, as `amp: bf16` trains); seconds."""
    _, feats, ids, anchors, labels, prev = batch
    fwd.drafter.attention, ce.MAX_KEPT_PROBS_BYTES = PATHS[path]
    fwd.drafter.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        _, logq, _ = fwd(feats, ids, anchors, labels, prev)
        loss = weighted_cross_entropy(logq, torch.ones(()), labels >= 0)
    loss.backward()
    return time.perf_counter() - t0


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
        import train_memory

        if args.part != "memory":
            train_memory.heap_report(args.shapes.split(","), args.threads, args.throughput_rounds)
        if args.part != "heap":
            train_memory.memory_report(args.threads)
    if args.part in ("all", "objectives"):
        import train_objectives

        train_objectives.objective_ratios(args)


if __name__ == "__main__":
    main()
