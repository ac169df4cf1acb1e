"""Cache-sized vs memory-budget row chunks for the fused vocabulary kernels, side by side.

Why: `edr/acceptance.py`'s sampling acceptance / TV cost (sampling EDR, E2E) and the `gradient`
sampler's scoring pass read and write each `[rows, V]` chunk several times. With the
memory budget's ~64 MB chunks (`check_chunk_rows`) every pass goes to DRAM; with
`fused_chunk_rows`' ~1 MB chunks on CPU the passes after the first hit cache. Each round
times both chunkings on the same inputs in rotating order; the ratio is the median of
per-round ratios (machine noise cancels within a round).

    python bench/fused_chunks.py [--rows 2632] [--vocab 4096,32768] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from blockdraft.objectives.edr.acceptance import (
    fused_sampling_acceptance,
    scores_with_gradient_moments,
)
from blockdraft.objectives.row_chunks import check_chunk_rows, fused_chunk_rows


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _compare(vocab: int, rows: int, rounds: int) -> None:
    """Print both kernels' times with each chunking at one vocabulary size."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=gen)
    p = torch.softmax(torch.randn(rows, vocab, generator=gen), -1)
    ids = torch.randint(0, vocab, (rows,), generator=gen)
    kw = dict(temperature=0.7, target_is_probs=True, stops=torch.tensor([1, 2]))
    chunks = {
        "budget": check_chunk_rows(None, vocab),
        "cache": fused_chunk_rows(None, vocab, torch.device("cpu")),
    }

    def forward_backward(chunk: int) -> None:
        x = logits.clone().requires_grad_(True)
        acc, cost = fused_sampling_acceptance(x, p, ids, want_cost=True, chunk_rows=chunk, **kw)
        (acc.sum() + cost.sum()).backward()

    def scoring(chunk: int) -> None:
        with torch.inference_mode():
            scores_with_gradient_moments(logits, p, ids, chunk_rows=chunk, **kw)

    work = {"acceptance fwd+bwd": forward_backward, "gradient-sampler scoring": scoring}
    for what, fn in work.items():
        fn(chunks["cache"])  # warm-up
        ratios, times = [], {name: [] for name in chunks}
        for r in range(rounds):
            order = list(chunks) if r % 2 == 0 else list(reversed(chunks))
            got = {name: _timed(lambda n=name, f=fn: f(chunks[n])) for name in order}
            for name, t in got.items():
                times[name].append(t)
            ratios.append(got["budget"] / got["cache"])
        print(
            f"  V={vocab:6d} {what:25s} budget ({chunks['budget']} rows) "
            f"{statistics.median(times['budget']) * 1e3:7.1f} ms, cache "
            f"({chunks['cache']} rows) {statistics.median(times['cache']) * 1e3:7.1f} ms: "
            f"{statistics.median(ratios):.2f}x faster"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2632, help="block rows x K (4 x 94 x 7)")
    ap.add_argument("--vocab", default="4096,32768")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"fused vocabulary kernels, {args.rows} rows, median of {args.rounds} rounds")
    for vocab in (int(v) for v in args.vocab.split(",")):
        _compare(vocab, args.rows, args.rounds)


if __name__ == "__main__":
    main()
