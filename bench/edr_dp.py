"""EDR recursions: `occupancy_and_value` against a plain compiled per-rollout loop.

The baseline is what a straightforward port of the EDR paper's reference DP looks like: a
numba function per rollout that allocates its outputs, runs the value recursion backward
(float32 values) and the occupancy recursion forward (float64), called from Python once
per rollout on CPU torch tensors (`.numpy()` in, `torch.from_numpy` out). It computes
and returns the same five outputs as ours (values, TD terms, occupancies, each row's share
of J, J): an earlier baseline skipped the row shares and J, i.e. did less work and boxed
one array fewer, which is ~1 us of a 15 us call at L = 256. Ours is
`blockdraft.objectives.edr.occupancy_and_value` (compiled backend), per rollout and on a
padded batch with `lengths`. Same float32 inputs for both.

Why interleaved: the machine is shared, so each round times both once, alternating, and
the reported ratio is the median over rounds of time(ours) / time(plain) within a round.
Ratios <= 1 mean ours is no slower. The old torch loop (`backend="torch"`, the reference)
is timed once per shape for scale.

    python bench/edr_dp.py [--rounds 15] [--batch 16] [--batch-length 2048]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numba
import numpy as np
import torch

from blockdraft.objectives.edr import kernels as edr_kernels
from blockdraft.objectives.edr import occupancy_and_value


@numba.njit(cache=True)
def _plain_kernel(acc, cst):
    """One rollout `[L-1, K]` -> (values, td, occupancy, row values, objective [1]), written
    plainly: the outputs `occupancy_and_value` returns (the round starts are the first
    column of the occupancy in both)."""
    rows, k = acc.shape
    length = rows + 1
    values = np.zeros((rows, k + 1), dtype=np.float32)
    td = np.zeros((rows, k), dtype=np.float32)
    occ = np.zeros((rows, k + 1), dtype=np.float64)
    row_value = np.zeros(rows, dtype=np.float32)
    objective = np.zeros(1, dtype=np.float32)
    round_value = np.zeros(length + k + 2, dtype=np.float32)
    starts = np.zeros(length + k + 2, dtype=np.float64)
    for n in range(rows, 0, -1):  # backward: values
        t = n + k + 1
        v = np.float32(1.0) + round_value[t] if t < length else np.float32(0.0)
        values[n - 1, k] = v
        for h in range(k, 0, -1):
            t = n + h
            if t < length:
                d = v - round_value[t]
                td[n - 1, h - 1] = d
                v = cst[n - 1, h - 1] + acc[n - 1, h - 1] * d + round_value[t]
            else:
                v = np.float32(0.0)
            values[n - 1, h - 1] = v
        round_value[n] = v
    starts[1] = 1.0
    total = 1.0 if length >= 2 else 0.0
    for n in range(1, length):  # forward: occupancies and each row's share of J
        mass = starts[n]
        share = 0.0
        for h in range(1, k + 2):
            t = n + h
            if t > length:
                break
            occ[n - 1, h - 1] = mass
            if t == length:
                break
            if h <= k:
                a = np.float64(acc[n - 1, h - 1])
                starts[t] += mass * (1.0 - a)
                share += mass * np.float64(cst[n - 1, h - 1])
                mass *= a
            else:
                starts[t] += mass
                share += mass
        row_value[n - 1] = share
        total += share
    objective[0] = total
    return values, td, occ, row_value, objective


def ours_kernel_only(acc: np.ndarray, cost: np.ndarray, length: np.ndarray) -> tuple:
    """Our compiled kernel on numpy arrays, allocating its outputs like the plain loop
    (no validation, no tensors): isolates the kernel from the wrapper's fixed cost."""
    batch, rows, k = acc.shape
    outputs = (
        np.empty((batch, rows, k + 1)),
        np.empty((batch, rows, k + 1), acc.dtype),
        np.empty((batch, rows, k), acc.dtype),
        np.empty((batch, rows), acc.dtype),
        np.empty(batch, acc.dtype),
    )
    edr_kernels.occupancy_value_batch(acc, cost, length, *outputs)
    return outputs


def plain_rollout(acc: torch.Tensor, cost: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(torch.from_numpy(x) for x in _plain_kernel(acc.numpy(), cost.numpy()))


def plain_batch(acc: torch.Tensor, cost: torch.Tensor, lengths: list[int]) -> list[tuple]:
    return [plain_rollout(acc[b, : n - 1], cost[b, : n - 1]) for b, n in enumerate(lengths)]


def _time(fn: Callable[[], object], reps: int, repeats: int = 3) -> float:
    """Best of `repeats` mean times over `reps` calls (the best is the least disturbed by
    other processes on a shared machine)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def compare(ours: Callable, plain: Callable, rounds: int, reps: int) -> tuple[float, float, float]:
    """Median ratio ours/plain over interleaved rounds, and median times (seconds)."""
    ours(), plain()  # warm-up (compilation, caches)
    ratios, t_ours, t_plain = [], [], []
    for r in range(rounds):
        pair = [(0, ours), (1, plain)] if r % 2 == 0 else [(1, plain), (0, ours)]
        times = [0.0, 0.0]
        for slot, fn in pair:
            times[slot] = _time(fn, reps)
        ratios.append(times[0] / times[1])
        t_ours.append(times[0])
        t_plain.append(times[1])
    return statistics.median(ratios), statistics.median(t_ours), statistics.median(t_plain)


def _inputs(gen: torch.Generator, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    acc = 0.3 + 0.7 * torch.rand(shape, generator=gen)  # float32, like training
    return acc, torch.rand(shape, generator=gen)


def _check(state, ref: tuple[torch.Tensor, ...], rows: slice = slice(None)) -> float:
    """Max abs difference ours vs plain (float32 values in the plain loop)."""
    values, td, occ, row_value, objective = ref
    return max(
        float((state.value[rows] - values).abs().max()),
        float((state.td[rows] - td).abs().max()),
        float((state.occupancy[rows] - occ).abs().max()),
        float((state.row_value[rows] - row_value).abs().max()),
        abs(float(state.objective) - float(objective[0])),
    )


def precision(gen: torch.Generator, length: int, k: int) -> tuple[float, float]:
    """Errors of float32 arithmetic against our float64 recursion on the same float32
    inputs: (max relative error of round starts of the old float32 torch loop at
    near-certain acceptance, max abs TD error of the plain float32 value loop)."""
    from blockdraft.objectives.edr import reference as edr_torch

    acc = 1 - 1e-3 * torch.rand(1, length - 1, k, generator=gen)
    starts32, _ = edr_torch.round_starts(acc, torch.tensor([length]))
    truth = occupancy_and_value(acc[0], acc[0]).round_start
    rel = float(((starts32[0].double() - truth).abs() / truth.clamp_min(1e-300)).max())
    acc, cost = _inputs(gen, (length - 1, k))
    td32 = plain_rollout(acc, cost)[1]
    return rel, float((td32.double() - occupancy_and_value(acc, cost).td).abs().max())


def bench_rollout(gen: torch.Generator, length: int, k: int, rounds: int) -> str:
    acc, cost = _inputs(gen, (length - 1, k))
    reps = max(1, 100_000 // (length * k))
    ratio, t_ours, t_plain = compare(
        lambda: occupancy_and_value(acc, cost), lambda: plain_rollout(acc, cost), rounds, reps
    )
    a2, c2 = acc.numpy(), cost.numpy()
    a3, c3, lens = a2[None], c2[None], np.array([length])
    kernel_ratio, _, _ = compare(
        lambda: ours_kernel_only(a3, c3, lens), lambda: _plain_kernel(a2, c2), rounds, reps
    )
    t_torch = _time(lambda: occupancy_and_value(acc, cost, backend="torch"), 1, 1)
    diff = _check(occupancy_and_value(acc, cost), plain_rollout(acc, cost))
    return (
        f"{f'per rollout L={length} K={k}':28s} {t_ours * 1e6:8.1f}us "
        f"{t_plain * 1e6:8.1f}us {ratio:7.3f} {kernel_ratio:7.3f} {t_torch * 1e3:9.1f}ms "
        f"{diff:9.1e}"
    )


def bench_batch(gen: torch.Generator, b: int, n: int, k: int, rounds: int) -> str:
    """`b` rollouts padded to `n` tokens, lengths drawn in [n/2, n] (the first is n)."""
    acc, cost = _inputs(gen, (b, n - 1, k))
    lengths = [n] + torch.randint(n // 2, n + 1, (b - 1,), generator=gen).tolist()
    lens = torch.tensor(lengths)
    ratio, t_ours, t_plain = compare(
        lambda: occupancy_and_value(acc, cost, lens),
        lambda: plain_batch(acc, cost, lengths),
        rounds,
        1,
    )
    a3, c3, lens_np = acc.numpy(), cost.numpy(), lens.numpy()
    kernel_ratio, _, _ = compare(
        lambda: ours_kernel_only(a3, c3, lens_np),
        lambda: [_plain_kernel(a3[i, : m - 1], c3[i, : m - 1]) for i, m in enumerate(lengths)],
        rounds,
        1,
    )
    t_torch = _time(lambda: occupancy_and_value(acc, cost, lens, backend="torch"), 1, 1)
    state = occupancy_and_value(acc, cost, lens)
    refs = plain_batch(acc, cost, lengths)
    diff = max(
        _check(type(state)(*(getattr(state, f)[i] for f in FIELDS)), ref, slice(0, m - 1))
        for i, (m, ref) in enumerate(zip(lengths, refs, strict=True))
    )
    return (
        f"{f'batched {b}x{n} K={k}':28s} {t_ours * 1e6:8.1f}us {t_plain * 1e6:8.1f}us "
        f"{ratio:7.3f} {kernel_ratio:7.3f} {t_torch * 1e3:9.1f}ms {diff:9.1e}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--batch-length", type=int, default=2048)
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--ks", type=int, nargs="+", default=[7, 15])
    args = ap.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    print(
        f"occupancy_and_value vs a plain compiled per-rollout loop (float32 inputs, "
        f"median of {args.rounds} interleaved rounds; ratio = ours / plain, <= 1 is no slower)"
    )
    print(
        f"{'case':28s} {'ours':>10s} {'plain':>10s} {'ratio':>7s} {'kernel':>7s} "
        f"{'torch loop':>11s} {'max diff':>9s}"
    )
    print(
        "  (ratio: the public call vs the plain loop with its minimal wrapper; kernel: both\n"
        "   compiled kernels alone on numpy arrays; torch loop: the old recursion, one call;\n"
        "   max diff: ours vs plain, i.e. the plain loop's float32 value error)"
    )
    for k in args.ks:
        for length in args.lengths:
            print(bench_rollout(gen, length, k, args.rounds))
        print(bench_batch(gen, args.batch, args.batch_length, k, args.rounds))
    print("\nprecision: float32 arithmetic vs our float64 recursion on the same float32 inputs")
    for k in args.ks:
        for length in args.lengths:
            rel, td_err = precision(gen, length, k)
            print(
                f"  L={length:5d} K={k:2d}: round starts, old float32 torch loop at near-certain "
                f"acceptance: max rel err {rel:.1e}; TD terms, plain float32 loop: max abs err "
                f"{td_err:.1e}"
            )


FIELDS = ("occupancy", "value", "td", "row_value", "objective")


if __name__ == "__main__":
    main()
