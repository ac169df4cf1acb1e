"""The one exception type for problems a user can fix, and how the CLI prints them.

Why one base class: the CLI entry point turns every `BlockdraftError` and `OSError` into
one line, `error: <file or key>: <cause>`, and exit status 2, so user and file errors never
end in a traceback, while genuine bugs (any other exception) still do.
"""

from __future__ import annotations

import errno
import os
import shutil


class BlockdraftError(Exception):
    """A problem with the user's input or files; the message is one line naming the culprit."""


UserError = BlockdraftError


class CheckpointError(BlockdraftError, ValueError):
    """A drafter or trainer checkpoint is missing, truncated, corrupt or incompatible."""


_HINTS = {
    errno.ENOSPC: "the disk is full",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EDQUOT: "disk quota exceeded",
}


def os_error_message(exc: OSError) -> str:
    """`path: cause` for an OSError, whatever constructor made it."""
    cause = _HINTS.get(exc.errno or -1) or exc.strerror or str(exc)
    if exc.filename is not None:
        where = os.fsdecode(exc.filename)
        if exc.filename2 is not None:
            where += f" -> {os.fsdecode(exc.filename2)}"
        return f"{where}: {cause}"
    return str(exc) if exc.strerror is None else cause


def disk_write_error(path: os.PathLike | str, exc: BaseException) -> OSError:
    """An OSError naming `path` for a failed write that torch reports as a RuntimeError
    (`[enforce fail at inline_container.cc] unexpected pos`: usually a full disk)."""
    try:
        free = shutil.disk_usage(os.path.dirname(os.fspath(path)) or ".").free
        cause = "the disk is full" if free < (1 << 20) else f"write failed ({str(exc)[:80]})"
    except OSError:
        cause = f"write failed ({str(exc)[:80]})"
    return OSError(errno.ENOSPC if "full" in cause else errno.EIO, cause, os.fspath(path))
