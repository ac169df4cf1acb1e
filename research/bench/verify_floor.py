"""The least a verification forward of K+1 tokens can cost on this CPU, in AR steps.

A speculative round verifies K+1 tokens in one target forward. Where a forward is pure
dispatch (a very small target) that costs what one token costs; where the weights come
from DRAM (a large target) it costs about the same too; in between, on a fast core whose
caches hold the weights, the extra rows are compute. This bench separates the two: it
times the target's weight products alone (every layer's fused q/k/v, o, gate/up, down and
the LM head, one `torch.mm` each, as the lean forward runs them) at M = 1, 2, 4, 8 rows,
next to the whole lean forward at the same rows, interleaved in one run. What the
products add from 1 to M rows is arithmetic that no dispatch work removes, so

    floor(M) = (AR step + products(M) - products(1)) / AR step

bounds the verification of M tokens from below with this BLAS, and a round costs at least
that plus the drafter. The last line prints the products' rate at M rows against a large
product's (the CPU's attainable GEMM rate), to show whether few-row products are what
limits. docs/decoding.md, "Why a `tiny` round cannot cost 1.5 AR steps on a fast core".

    python research/bench/verify_floor.py [--target tiny] [--threads 1] [--reps 400]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from blockdraft.decoding.cpu.lean_target import LeanTarget
from blockdraft.targets.registry import load_target
from blockdraft.threads import flush_denormals

ROWS = (1, 2, 4, 8)


def weights(lean: LeanTarget) -> list[torch.Tensor]:
    """The `[in, out]` matrices one lean forward multiplies by, in order."""
    mats = []
    for w in lean.layers:
        mats += [w.qkv, w.o, w.gate_up, w.down]
    return mats + [lean.head_t]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="tiny")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=400)
    ap.add_argument("--context", type=int, default=64, help="cached positions before the rows")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    flush_denormals()
    target = load_target(args.target, progress=False)
    lean = LeanTarget.of(target.model, list(target.layer_ids))
    if lean is None:
        raise SystemExit(
            f"{args.target}: no lean forward for this target (LeanTarget.supports); "
            "its forward is compute or memory already, not dispatch"
        )
    mats = weights(lean)
    flops = {m: 2 * m * sum(w.shape[0] * w.shape[1] for w in mats) for m in ROWS}
    gen = torch.Generator().manual_seed(0)
    vocab = lean.head_t.shape[1]
    ids = torch.randint(0, vocab, (args.context + max(ROWS),), generator=gen)
    inputs = {m: [torch.randn(m, w.shape[0], generator=gen) for w in mats] for m in ROWS}

    def products(m: int) -> None:
        for x, w in zip(inputs[m], mats, strict=True):
            torch.mm(x, w)

    caches = {}
    for m in ROWS:
        caches[m] = lean.new_cache(args.context + m)
        lean.forward(ids[: args.context], caches[m])

    def forward(m: int) -> None:
        cache = caches[m]
        cache.crop(args.context)
        hidden, _ = lean.forward(ids[args.context : args.context + m], cache, m > 1)
        lean.logits(hidden).argmax(-1)

    jobs = [(kind, m) for m in ROWS for kind in ("products", "forward")]
    fns = {"products": products, "forward": forward}
    times: dict[tuple[str, int], list[float]] = {j: [] for j in jobs}
    with torch.inference_mode():
        for j in jobs:  # warm-up
            for _ in range(20):
                fns[j[0]](j[1])
        for r in range(args.reps):  # interleaved, rotating order: drift hits all alike
            for j in jobs[r % len(jobs) :] + jobs[: r % len(jobs)]:
                t0 = time.perf_counter()
                fns[j[0]](j[1])
                times[j].append(time.perf_counter() - t0)
        big = torch.randn(512, mats[-1].shape[0], generator=gen)
        peak = []
        for _ in range(20):
            t0 = time.perf_counter()
            torch.mm(big, mats[-1])
            peak.append(time.perf_counter() - t0)
    med = {j: statistics.median(t) * 1e3 for j, t in times.items()}
    ar = med[("forward", 1)]
    params = sum(p.numel() for p in target.model.parameters())
    print(
        f"target {args.target} ({params / 1e6:.1f}M params), {len(mats)} products per forward, "
        f"{args.context} cached positions, {args.threads} thread(s), torch {torch.__version__}"
    )
    print(
        f"{'rows':>4}  {'forward ms':>10}  {'x 1 row':>7}  {'products ms':>11}  "
        f"{'GFLOP/s':>7}  {'floor (AR steps)':>16}"
    )
    for m in ROWS:
        prod = med[("products", m)]
        floor = (ar + prod - med[("products", 1)]) / ar
        rate = flops[m] / (prod * 1e-3) / 1e9
        print(
            f"{m:>4}  {med[('forward', m)]:>10.3f}  {med[('forward', m)] / ar:>6.2f}x  "
            f"{prod:>11.3f}  {rate:>7.1f}  {floor:>16.2f}"
        )
    peak_rate = 2 * big.shape[0] * mats[-1].numel() / statistics.median(peak) / 1e9
    m = max(ROWS)
    share = flops[m] / (med[("products", m)] * 1e-3) / 1e9 / peak_rate
    print(
        f"a 512-row head product runs at {peak_rate:.1f} GFLOP/s: the {m}-row products reach "
        f"{100 * share:.0f}% of it; floor({m}) is the verification of a K = {m - 1} block"
    )


if __name__ == "__main__":
    main()
