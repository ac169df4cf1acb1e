"""Where blockdraft keeps things it builds once and reuses: the user cache directory.

Built targets (the trained `tiny` model, the safetensors copy of Gemma) are expensive to
make and cheap to load, so they live in a per-user cache, never inside the checkout.
Every entry is written to a temporary sibling directory and renamed into place only when
complete, so an interrupted build can never be mistaken for a finished one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CACHE_ENV = "BLOCKDRAFT_CACHE"
TMP_PREFIX = ".tmp-"


def cache_root() -> Path:
    """The user cache dir: `$BLOCKDRAFT_CACHE`, else the platform's cache dir + `blockdraft`.

    Mirrors platformdirs' `user_cache_dir` without the dependency: `$XDG_CACHE_HOME` or
    `~/.cache` on Linux, `~/Library/Caches` on macOS, `%LOCALAPPDATA%` on Windows.
    """
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    if sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    elif os.name == "nt":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "blockdraft"


def targets_dir(cache_dir: str | Path | None = None) -> Path:
    """Directory holding built targets (one sub-directory per cache key)."""
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    return root / "targets"


def stable_hash(obj: Any) -> str:
    """sha256 of a JSON-serialisable object with sorted keys: the basis of cache keys."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


@contextlib.contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield a fresh temporary directory that becomes `final` only if the block succeeds.

    The temporary directory sits next to `final` (same filesystem, so the rename is
    atomic) and is removed on any exception, KeyboardInterrupt included. If another
    process finished the same entry first, its copy wins and ours is discarded.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    purge_stale_builds(final)
    tmp = Path(
        tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{final.name}-{os.getpid()}-", dir=final.parent)
    )
    try:
        yield tmp
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # lost a race to an identical build
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # exists but not ours, or cannot tell: leave it alone
    return True


def purge_stale_builds(final: Path) -> None:
    """Remove temp dirs next to `final` left by builds whose process is gone (e.g. SIGKILL).

    Exceptions clean up after themselves; a killed process cannot, so its temp dir
    (`.tmp-<entry>-<pid>-<random>`) is removed by the next build in the same directory.
    """
    for tmp in final.parent.glob(TMP_PREFIX + "*"):
        parts = tmp.name.rsplit("-", 2)
        pid = parts[1] if len(parts) == 3 else ""
        if not pid.isdigit() or not _pid_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)
