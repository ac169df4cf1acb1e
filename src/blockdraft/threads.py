"""How torch runs on the CPU (threads, denormals), set once for every stage that runs models.

Threads: torch's default (one per core) is the worst choice on a shared machine, because
OpenMP workers spin while they wait for a busy core; the default here is the cores idle
now (/proc/stat), capped at torch's count and `DEFAULT_CAP`. Denormals are flushed to zero
(FTZ/DAZ): the objectives' gradients multiply small probabilities, x86 arithmetic on
denormals is far slower, and values that small are zero for every purpose here.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

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


class OtherLoad:
    """How many cores other processes kept busy while the `with` body ran (Linux
    /proc/stat less this process's own CPU time), for a wall-clock measurement to say
    when it was taken on a machine too busy to trust: `others` (cores, None if unknown),
    `cores`, and `contended(threads)`: fewer cores than `threads` were left to us."""

    def __init__(self) -> None:
        self.others: float | None = None
        self.cores = os.cpu_count() or 1

    def __enter__(self) -> OtherLoad:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> OtherLoad:
        try:
            self._start = (_cpu_times(), time.process_time(), time.perf_counter())
        except (OSError, ValueError, IndexError):
            self._start = None
        return self

    def stop(self) -> None:
        if self._start is None:
            return
        try:
            (idle0, total0), own0, wall0 = self._start
            idle1, total1 = _cpu_times()
        except (OSError, ValueError, IndexError):
            return
        wall = time.perf_counter() - wall0
        busy_s = ((total1 - idle1) - (total0 - idle0)) / os.sysconf("SC_CLK_TCK")
        if wall > 0:
            self.others = max(0.0, (busy_s - (time.process_time() - own0)) / wall)

    def contended(self, threads: int) -> bool:
        return self.others is not None and self.cores - self.others < 0.9 * threads


def default_threads(cap: int = DEFAULT_CAP) -> int:
    """`$BLOCKDRAFT_THREADS`, else the idle cores now, capped at torch's count and `cap`."""
    env = os.environ.get(ENV)
    if env:
        return _positive(env, ENV)
    n = min(torch.get_num_threads(), cap)
    idle = idle_cores()
    return max(1, min(n, idle)) if idle is not None else max(1, n)


def configure_cpu(threads: int | None = None, device: str = "cpu") -> int:
    """Set torch's thread count (`None`: `default_threads()`) and flush denormals when the
    work runs on a CPU; return the thread count."""
    n = default_threads() if threads is None else _positive(threads, "--threads")
    torch.set_num_threads(n)
    if runs_on_cpu(device):
        flush_denormals()
    return n


def runs_on_cpu(device: str) -> bool:
    """True for `cpu`, and for `auto` on a machine without CUDA (what `devices` resolves)."""
    if device == "auto":
        return not torch.cuda.is_available()
    try:
        return torch.device(device).type == "cpu"
    except RuntimeError:  # not a device name: the caller's own check reports it
        return False


def flush_denormals() -> bool:
    """Treat denormal floats as zero, process-wide (FTZ/DAZ); False where the CPU has no
    such mode."""
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
