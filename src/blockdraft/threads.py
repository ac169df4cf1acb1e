"""How torch runs on the CPU (threads, denormals), set once for every stage that runs models.

Why this exists: on a small shared machine torch's default (one thread per core) is the
worst choice whenever another process is busy. OpenMP worker threads spin while they
wait for a core, so two threads on two cores shared with one other busy process ran
5-10x *slower* than one thread (the demo's online stage measured 50 tok/s on `tiny`
against 583 tok/s with one thread). The default therefore counts the cores that are
idle *right now* (sampled from /proc/stat over a fraction of a second, the same rule
`targets/tiny.py` uses for its build), capped at torch's own choice and at
`DEFAULT_CAP`. `--threads N` (every CLI stage that runs models) overrides it, and
`BLOCKDRAFT_THREADS` overrides the default for a whole shell session.

Denormals: `configure_cpu` also flushes denormal floats to zero (FTZ/DAZ). Why: x86
arithmetic on denormals (|x| < 1.2e-38 in float32) is ~100x slower, and the training
objectives make them: a gradient like EDR's `dA/dz_v = A q_v (...)` multiplies small
probabilities, so at a 32k draft vocabulary most of the LM head's gradient is denormal
(one `[1860, 32768] x [32768, 640]` product took 11.4 s instead of ~0.4 s; greedy EDR's
step at the Gemma shape was 6x slower than `uniform`'s, 1.03x with FTZ). Values that small
are zero for every purpose here (GPUs flush them in their fast paths too).

Usage: `add_threads_arg(parser)` in a CLI's `register`, then `configure_cpu(args.threads)`
first thing in its `run` (it returns the thread count it set, so callers can print it).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

ENV = "BLOCKDRAFT_THREADS"
DEFAULT_CAP = 8  # batch-1 decoding of small models gains nothing beyond a few threads


def _cpu_times() -> tuple[int, int]:
    """(idle + iowait, total) jiffies summed over all CPUs, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return fields[3] + (fields[4] if len(fields) > 4 else 0), sum(fields)


def idle_cores(window_s: float = 0.3) -> int | None:
    """Cores idle over the last `window_s` seconds (Linux /proc/stat), or None if unknown."""
    try:
        idle0, total0 = _cpu_times()
        time.sleep(window_s)
        idle1, total1 = _cpu_times()
    except (OSError, ValueError, IndexError):
        return None
    cores = os.cpu_count() or 1
    busy = cores * (1 - (idle1 - idle0) / max(1, total1 - total0))
    return max(1, min(cores, int(cores - busy + 0.5)))


def default_threads(cap: int = DEFAULT_CAP) -> int:
    """`$BLOCKDRAFT_THREADS`, else the idle cores now, capped at torch's count and `cap`."""
    import torch  # lazily: CLI modules import this file at registration (`--help` stays fast)

    env = os.environ.get(ENV)
    if env:
        return _positive(env, ENV)
    n = min(torch.get_num_threads(), cap)
    idle = idle_cores()
    return max(1, min(n, idle)) if idle is not None else max(1, n)


def configure_cpu(threads: int | None = None) -> int:
    """Set torch's intra-op thread count (`None` = `default_threads()`) and flush denormals
    (`flush_denormals`); return the thread count."""
    import torch

    n = default_threads() if threads is None else _positive(threads, "--threads")
    torch.set_num_threads(n)
    flush_denormals()
    return n


def flush_denormals() -> bool:
    """Treat denormal floats as zero on this CPU (FTZ/DAZ; see the module docstring for
    why). Process-wide: torch's worker threads follow it. False where the CPU has no such
    mode (then nothing changes)."""
    import torch

    return bool(torch.set_flush_denormal(True))


def add_threads_arg(parser: argparse.ArgumentParser) -> None:
    """The one `--threads` flag every model-running CLI stage shares."""
    parser.add_argument(
        "--threads",
        type=_threads_type,
        default=None,
        help=f"CPU threads for torch (default: ${ENV}, else the cores idle now, at most "
        f"{DEFAULT_CAP}; busy shared cores make extra threads much slower, not faster)",
    )


def _threads_type(value: str) -> int:
    try:
        return _positive(value, "--threads")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(value: int | str, what: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{what} must be a positive integer, got {value!r}") from None
    if n < 1:
        raise ValueError(f"{what} must be >= 1, got {n}")
    return n
