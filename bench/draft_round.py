"""One drafter round, isolated: `BlockDrafter`'s context update + block vs the lean round.

    python bench/draft_round.py --target tiny --drafter runs/dpace/final
    python bench/draft_round.py --target gemma-3-270m --drafter DIR --threads 2 --reps 100
    python bench/draft_round.py --target gemma-3-270m --drafter DIR --drafter-dtype bfloat16

Times, interleaved and repeated (median of per-call CPU time, robust to a loaded
machine; wall time with --threads > 1), the drafter's linears packed as the loop packs
them: the drafter's `extend_context` of 3 verified positions + `draft_hidden` + the
greedy head, the same through `LeanDrafter` (decoding/cpu/lean_drafter.py), the head
alone, the greedy choice over the draft and target rows by torch's argmax and by
`row_argmax` (kernels/row_argmax.py), and the target's lean 1-token and 8-token
forwards; prints each in lean AR steps (the 1-token forward) and the largest difference
between the two drafters' hidden states.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from blockdraft.decoding.cpu.lean_drafter import LeanDrafter
from blockdraft.decoding.proposers import GreedyDraftHead
from blockdraft.decoding.target_runner import TargetRunner
from blockdraft.kernels.packed_linear import packed_linears
from blockdraft.kernels.row_argmax import row_argmax
from blockdraft.serialization.drafter_spec import DrafterSpec, load_drafter_spec
from blockdraft.targets.registry import load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="tiny")
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--context", type=int, default=60, help="verified positions before the block")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--drafter-dtype", default="float32", choices=["float32", "bfloat16"],
        help="the dtype the drafter runs in (the target stays fp32)",
    )  # fmt: skip
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(args.target)
    drafter, _ = load_drafter_spec(
        DrafterSpec.parse(args.drafter), target, dtype=getattr(torch, args.drafter_dtype)
    )
    lean = LeanDrafter.of(drafter)
    if lean is None:
        raise SystemExit(f"{args.drafter}: no lean round for this drafter (see LeanDrafter)")
    head, run = GreedyDraftHead.of(drafter), TargetRunner(target)
    g = torch.Generator().manual_seed(0)
    a = args.context
    prompt = torch.randint(3, target.vocab_size, (1, a), generator=g)
    with torch.inference_mode(), packed_linears(drafter):  # the loop packs the drafter
        pre = run.step(prompt, features=True)
        feats, cache = pre.features, pre.cache
        ref, fast = drafter.new_state(), lean.new_state()
        if drafter.config.lookup_inputs:  # a lookup-input drafter: a full lookup each round
            ref.lookup = fast.lookup = prompt[0, 1 : drafter.config.block_size].tolist()
        drafter.extend_context(ref, feats[:, : a - 3], 0)
        lean.extend_context(fast, feats[:, : a - 3], 0)
        lean.draft_hidden(fast, 5, a - 3)
        block = prompt[:, :8]

        def reference() -> torch.Tensor:
            drafter.extend_context(ref, feats[:, a - 3 :], a - 3)
            hidden = drafter.draft_hidden(ref, 5, a)
            ref.crop(a - 3)
            return hidden

        def leaned() -> torch.Tensor:
            lean.extend_context(fast, feats[:, a - 3 :], a - 3)
            hidden = lean.draft_hidden(fast, 5, a)
            fast.crop(a - 3)
            return hidden

        hidden = leaned()
        logits = head.products(hidden).float()
        target_rows = run.step(block, cache, keep=8).logits
        run.crop(cache, a)
        jobs = {
            "BlockDrafter round + head": lambda: head.pick(reference()),
            "lean round + head": lambda: head.pick(leaned()),
            "head alone (K rows + argmax)": lambda: head.pick(hidden),
            "argmax of the K draft rows: torch": lambda: logits.argmax(-1),
            "argmax of the K draft rows: row_argmax": lambda: row_argmax(logits),
            "argmax of the 8 target rows: torch": lambda: target_rows.argmax(-1),
            "argmax of the 8 target rows: row_argmax": lambda: row_argmax(target_rows),
            "target: lean 1 token": lambda: (run.step(block[:, :1], cache), run.crop(cache, a)),
            "target: lean 8 tokens + features": lambda: (
                run.step(block, cache, keep=8, features=True, argmax=True),
                run.crop(cache, a),
            ),
        }
        diff = (reference() - leaned()).abs().max().item()
        took: dict[str, list[float]] = {name: [] for name in jobs}
        # one thread: its CPU time (robust to a loaded machine); more: wall time
        clock = time.thread_time if args.threads == 1 else time.perf_counter
        for _ in range(args.reps):
            for name, job in jobs.items():
                t0 = clock()
                job()
                took[name].append(clock() - t0)
    med = {name: statistics.median(v) for name, v in took.items()}
    step = med["target: lean 1 token"]
    print(f"max |hidden difference| {diff:.2e}")
    for name, sec in med.items():
        print(f"  {name:<42}{1e3 * sec:8.3f} ms  {sec / step:5.2f} lean AR steps")


if __name__ == "__main__":
    main()
