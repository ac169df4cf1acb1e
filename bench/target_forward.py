"""Target forward for training with and without the LM head, at Gemma 3 270M's shape.

Why: cross-entropy objectives (decay, D-PACE, greedy E2E/EDR) need only the target's
hidden states; at a 262k-token vocabulary the LM head (640 x 262144) is more compute than
all 18 decoder layers together, so `Target.forward(with_logits=False)` skips it. Random
weights at the real shape (no download); the two variants alternate on the same batch
and the printed factor is the median over rounds of time(full) / time(features only).

    python bench/target_forward.py [--rounds 5] [--batch 8] [--seq 128] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fixture_targets import make_shaped_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    target = make_shaped_target("gemma-3-270m")  # gemma-3-270m's published shape
    ids = torch.randint(0, target.vocab_size, (args.batch, args.seq))
    mask = torch.ones_like(ids)

    def timed(with_logits: bool) -> float:
        t = time.perf_counter()
        target.forward(ids, attention_mask=mask, with_logits=with_logits)
        return time.perf_counter() - t

    timed(True), timed(False)  # warm-up
    ratios, full_s, lean_s = [], [], []
    for r in range(args.rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        t = {w: timed(w) for w in order}
        full_s.append(t[True])
        lean_s.append(t[False])
        ratios.append(t[True] / t[False])
    print(
        f"batch {args.batch}x{args.seq}, {args.threads} thread(s): full forward "
        f"{statistics.median(full_s):.2f}s, features only {statistics.median(lean_s):.2f}s; "
        f"full / features-only = {statistics.median(ratios):.2f}x (median of {args.rounds})"
    )


if __name__ == "__main__":
    main()
