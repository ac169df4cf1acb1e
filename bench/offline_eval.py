"""Offline evaluator throughput: vectorised recursion vs a plain per-state Python loop.

Workload: 1,000 rollouts of 512 tokens, K = 15 (DFlash block 16). A "state" is one
decision state (n, t), i.e. one entry of the `[L-1, K]` acceptance tensor; each rollout
has (L-1) * K = 7,665 of them. Timed side by side in one run:

- vectorised: `blockdraft.objectives.edr.expected_rounds` (forward occupancy, the
  evaluator's recursion) and `occupancy_and_value` (forward + backward, what the EDR
  training loss needs) on the whole batch at once;
- loop: the same forward occupancy recursion written state by state in plain Python
  (floats in lists), timed on a subset of rollouts and extrapolated per state (the
  cost per state does not depend on the rollout); the loop's expected rounds are checked
  against the vectorised ones on that subset.

Usage: python bench/offline_eval.py [--rollouts 1000] [--length 512] [--k 15] [--loop-rollouts 20]
"""

from __future__ import annotations

import argparse
import time

import torch

from blockdraft.objectives.edr import expected_rounds, occupancy_and_value


def loop_expected_rounds(acc: list[list[float]], length: int, k: int) -> float:
    """Forward occupancy, one state at a time (the straightforward implementation)."""
    start = [0.0] * (length + 1)  # start[m] = P(a round starts at m)
    if length >= 2:
        start[1] = 1.0
    for n in range(1, length):
        if start[n] == 0.0:
            continue
        reach = start[n]
        for h in range(1, k + 1):
            t = n + h
            if t >= length:
                break
            a = acc[n - 1][h - 1]
            start[t] += reach * (1.0 - a)
            reach *= a
        else:
            if n + k + 1 < length:
                start[n + k + 1] += reach
    return sum(start[1:length])


def _time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=1000)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--k", type=int, default=15)
    parser.add_argument("--loop-rollouts", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: same core budget as the Python loop)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    gen = torch.Generator().manual_seed(0)
    acc = (0.5 + 0.5 * torch.rand(args.rollouts, args.length - 1, args.k, generator=gen)).float()
    states = args.rollouts * (args.length - 1) * args.k
    print(
        f"workload: {args.rollouts} rollouts x {args.length} tokens, K={args.k}: "
        f"{states:,} states; torch {torch.__version__}, {torch.get_num_threads()} threads"
    )

    vec_s = _time(lambda: expected_rounds(acc), args.repeats)
    both_s = _time(lambda: occupancy_and_value(acc, 1 - acc), args.repeats)

    subset = [acc[i].tolist() for i in range(args.loop_rollouts)]
    loop_values: list[float] = []
    loop_s = _time(
        lambda: loop_values.__setitem__(
            slice(None), [loop_expected_rounds(a, args.length, args.k) for a in subset]
        ),
        args.repeats,
    )
    loop_states = args.loop_rollouts * (args.length - 1) * args.k
    check = expected_rounds(acc[: args.loop_rollouts].double())
    err = max(abs(a - b) for a, b in zip(loop_values, check.tolist(), strict=True))

    vec_rate, both_rate, loop_rate = states / vec_s, states / both_s, loop_states / loop_s
    rows = [
        ("vectorised forward (expected_rounds)", vec_s, vec_rate),
        ("vectorised forward+backward (occupancy_and_value)", both_s, both_rate),
        (f"python per-state loop, forward ({args.loop_rollouts} rollouts)", loop_s, loop_rate),
    ]
    for name, seconds, rate in rows:
        print(f"{name:<52} {seconds * 1e3:8.1f} ms {rate / 1e6:9.2f} M states/s")
    print(
        f"(the loop was timed on {args.loop_rollouts} rollouts and is compared per state; "
        f"max |expected rounds difference| vs vectorised: {err:.1e})"
    )
    print(f"speedup forward vs loop: {vec_rate / loop_rate:.1f}x (goal >= 50x)")
    print(f"speedup forward+backward vs forward-only loop: {both_rate / loop_rate:.1f}x")


if __name__ == "__main__":
    main()
