"""Start a child that holds a directory's writer lock (`lock_holder_child.py`), and kill it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"


def hold_lock(directory: Path, marker: Path) -> subprocess.Popen:
    """A child process holding `directory`'s writer lock (returns once it holds it)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), str(HERE)]))
    child = subprocess.Popen(
        [sys.executable, str(HERE / "lock_holder_child.py"), str(directory), str(marker)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    while not marker.exists():
        if child.poll() is not None:
            raise AssertionError(f"lock holder exited early: {child.stderr.read()}")
        time.sleep(0.02)
    return child


def kill(child: subprocess.Popen) -> None:
    """SIGKILL: the child gets no chance to clean up (its lock file stays behind)."""
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    if child.stderr is not None:
        child.stderr.close()
