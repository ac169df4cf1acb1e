"""Child process for the one-writer tests: holds a directory's writer lock until killed.

Usage: python lock_holder_child.py DIR MARKER

Takes `artifacts.writer_lock(DIR)`, creates MARKER (so the test knows the lock is held)
and sleeps; the test then tries a second writer, and kills this one with SIGKILL to leave
a lock file behind as a crashed writer would.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from blockdraft.artifacts import writer_lock


def main() -> None:
    directory, marker = Path(sys.argv[1]), Path(sys.argv[2])
    with writer_lock(directory, "a test directory"):
        marker.write_text("locked")
        time.sleep(600)


if __name__ == "__main__":
    main()
