"""`heap.retain_freed_memory`: freed large CPU tensors stay mapped (reused without page
faults) instead of going back to the OS. Checked in fresh processes (the setting is
process-wide) through resident memory after freeing a 256 MB tensor, both ways, so the
test fails if the call does nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from blockdraft import heap

PROBE = """
import sys, torch
from blockdraft.heap import retain_freed_memory
if sys.argv[1] == "retain":
    assert retain_freed_memory()
def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
base = rss_mb()
x = torch.ones(64 << 20)  # 256 MB, touched
del x
print(rss_mb() - base)
"""


@pytest.mark.skipif(heap._libc() is None, reason="malloc is not glibc's")
def test_freed_memory_is_kept_only_when_asked() -> None:
    kept = {}
    for mode in ("default", "retain"):
        out = subprocess.run(
            [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
        )
        kept[mode] = float(out.stdout.split()[-1])
    assert kept["default"] < 64, kept  # glibc unmapped the block on free
    assert kept["retain"] > 192, kept  # ... and keeps it when asked
