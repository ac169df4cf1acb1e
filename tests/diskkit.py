"""A disk that fills up for one kind of file: `os.fsync` raises ENOSPC for temp files whose
name ends with `suffix` (the atomic writers fsync before renaming), every other write works."""

from __future__ import annotations

import errno
import os


def full_disk_for(monkeypatch, suffix: str) -> None:
    real = os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(suffix):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
