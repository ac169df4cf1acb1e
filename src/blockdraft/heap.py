"""Keep freed CPU memory for reuse instead of returning it to the OS (glibc malloc).

Why: glibc serves every allocation above its mmap threshold with a fresh `mmap` and
unmaps it on free, so each training step page-faults its big buffers (logits, attention
scores, activations) in again. `retain_freed_memory()` takes every allocation from the
heap and keeps freed memory mapped for the rest of the process: resident memory stays at
its peak, which a training process reaches every step anyway. Called by the stages that
train, never on import; `bench/train_step.py --part heap` measures it (docs/training.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
_DEFAULT_MMAP_MAX = 65536
_RETAIN_TRIM = 1 << 40


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


def retain_freed_memory(on: bool = True) -> bool:
    """Serve large CPU allocations from the heap and keep freed memory (module doc);
    `on=False` restores glibc's defaults. Returns False where malloc is not glibc's."""
    libc = _libc()
    if libc is None:
        return False
    mmap_max = 0 if on else _DEFAULT_MMAP_MAX
    trim = _RETAIN_TRIM if on else 128 * 1024
    ok = libc.mallopt(M_MMAP_MAX, mmap_max) == 1
    # mallopt takes an int: the largest positive one stands for "never trim"
    ok &= libc.mallopt(M_TRIM_THRESHOLD, min(trim, 2**31 - 1)) == 1
    return bool(ok)
