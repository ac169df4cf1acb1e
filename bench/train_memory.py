"""Training-step memory, in fresh processes (what `bench/train_step.py --part heap|memory`
runs): settings that are process-wide, or peaks that need a clean process, cannot be
measured side by side inside one.

Heap: the `new` drafter step with glibc keeping freed memory (blockdraft/heap.py, what
training stages set) vs glibc's defaults, whole processes alternating. Memory: peak RSS
growth of `forward_blocks` forward+backward per attention path at the scaled recipe
shape, then the attention-specific terms at the full recipe computed analytically.

    python bench/train_memory.py [--part all|heap|memory] [--shapes tiny,gemma,recipe]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys

import torch

from blockdraft.drafters import block_attention
from blockdraft.heap import retain_freed_memory
from blockdraft.training.draft_forward import DraftForward
from common import MEMORY_SHAPE, SHAPES, build, drafter_step


# --- heap: glibc keeping freed memory (blockdraft/heap.py) ------------------------------------
def heap_probe(spec: str) -> None:
    """(subprocess) median seconds of the `new` path at shape `name`, heap retained or not."""
    name, mode, steps = spec.split(":")
    if mode == "retain":
        retain_freed_memory()
    batch = build(SHAPES[name])
    fwd = DraftForward(batch[0])
    times = [drafter_step(fwd, batch, "new") for _ in range(int(steps) + 2)][2:]
    print(statistics.median(times))


def heap_report(shapes: list[str], threads: int, rounds: int) -> None:
    """Whole processes alternate (the setting is process-wide): glibc default vs retained."""
    print(
        "new path with glibc keeping freed memory (training stages set it, blockdraft/heap.py) "
        f"vs glibc's defaults; fresh processes alternating, {rounds} rounds of 5 steps"
    )
    for name in shapes:
        times: dict[str, list[float]] = {"default": [], "retain": []}
        for r in range(rounds):
            for mode in ("default", "retain") if r % 2 == 0 else ("retain", "default"):
                out = subprocess.run(
                    [sys.executable, __file__, "--heap-probe", f"{name}:{mode}:5",
                     "--threads", str(threads)],
                    capture_output=True, text=True, check=True,
                )  # fmt: skip
                times[mode].append(float(out.stdout.split()[-1]))
        pairs = zip(times["default"], times["retain"], strict=True)
        ratio = statistics.median(d / k for d, k in pairs)
        print(
            f"  {name}: default {statistics.median(times['default']):.3f} s/step, "
            f"retained {statistics.median(times['retain']):.3f} s/step, speed {ratio:.2f}x"
        )


# --- memory -----------------------------------------------------------------------------------
def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(field)


def memory_probe(impl: str) -> None:
    """(subprocess) peak RSS growth of forward_blocks fwd+bwd at the scaled recipe shape."""
    drafter, feats, ids, anchors, _, _ = build(MEMORY_SHAPE)
    warm = anchors[:, :2].clamp(max=63)  # first backward's one-off allocations, not counted
    drafter.forward_blocks(feats[:, :64], ids[:, :64], warm, impl).sum().backward()
    drafter.zero_grad(set_to_none=True)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS watermark
    base = _status_kb("VmRSS")
    drafter.forward_blocks(feats, ids, anchors, impl).square().sum().backward()
    print((_status_kb("VmHWM") - base) / 1024)


def memory_report(threads: int) -> None:
    s = MEMORY_SHAPE
    T, L = s.prompt + s.response, s.anchors * s.block
    print(
        f"forward_blocks fwd+bwd peak RSS growth, measured at the scaled recipe shape "
        f"(T={T}, {s.anchors} anchors x block {s.block}, width {s.hidden}, 1 layer):"
    )
    measured = {}
    for impl in ("dense", "tiled"):
        out = subprocess.run(
            [sys.executable, __file__, "--memory-probe", impl, "--threads", str(threads)],
            capture_output=True,
            text=True,
            check=True,
        )
        measured[impl] = float(out.stdout.split()[-1])
        print(f"  {impl:6s} {measured[impl]:8.1f} MiB")
    print(f"  tiled / dense = {measured['tiled'] / measured['dense']:.2f}")
    # Full recipe, per layer, attention-specific terms only (bytes); Qwen3-8B drafter.
    T, A, Kb, h, kvh, d = 3072, 512, 16, 32, 8, 128
    L = A * Kb
    tile = max(1, block_attention.TILE_QUERIES // Kb) * Kb
    gib = 1 << 30
    dense_cpu = L * (T + L) * (1 + 4)  # bool mask + the float mask SDPA saves per layer
    dense_cuda = h * L * (T + L) * 4  # >= the math kernel's fp32 scores (issue 17)
    # tiled: float masks over [context up to the tile's largest anchor; tile] (sorted,
    # uniform anchors: ~T/2 on average) + the per-tile K/V copies SDPA saves (bf16)
    tiled = L * (T // 2 + tile) * 4 + (L // tile) * (T // 2 + tile) * kvh * d * 2 * 2
    flex = h * L * 4 + (L // 128) * ((T + L) // 128) * 4 * 2  # logsumexp + BlockMask
    print(
        f"full recipe (T={T}, {A} anchors x block {Kb}, {h}/{kvh} heads, d={d}), "
        "attention memory per layer, analytic:"
    )
    print(f"  dense on CPU (bool + float mask)        {dense_cpu / gib:7.2f} GiB")
    print(f"  dense on CUDA (math kernel scores, >=)  {dense_cuda / gib:7.2f} GiB")
    print(f"  tiled on CPU (masks + K/V tile copies)  {tiled / gib:7.2f} GiB")
    print(f"  flex on CUDA (lse + BlockMask)          {flex / gib:7.3f} GiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", default="all", choices=["all", "heap", "memory"])
    ap.add_argument("--shapes", default="tiny,gemma,recipe")
    ap.add_argument("--rounds", type=int, default=5, help="alternations of the heap part")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--memory-probe", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--heap-probe", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_probe:
        memory_probe(args.memory_probe)
    elif args.heap_probe:
        heap_probe(args.heap_probe)
    else:
        if args.part != "memory":
            heap_report(args.shapes.split(","), args.threads, args.rounds)
        if args.part != "heap":
            memory_report(args.threads)


if __name__ == "__main__":
    main()
