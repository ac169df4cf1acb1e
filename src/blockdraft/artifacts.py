"""Stored artefacts: one writer per directory, every file checked against its record.

Rollout sets, feature sets, run directories and exports are written by different stages
but fail in the same few ways: two writers interleave, a byte flips or a file is cut
short, a rerun writes other bytes for the same inputs, the disk fills up half way. Every
stage goes through the lock, integrity check, atomic writes, disk check and artefact
kinds here, so each of these fails the same way everywhere, as one line naming the file.
The contracts are in docs/architecture.md ("Utilities").
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from safetensors.torch import save

from blockdraft.errors import BlockdraftError

LOCK_NAME = ".blockdraft.lock"


class DirectoryInUseError(BlockdraftError):
    """Another live process is writing the directory (the message names its pid)."""


class DiskSpaceError(BlockdraftError):
    """Not enough free disk for what a stage is about to write (need vs free, and where)."""


class IntegrityError(BlockdraftError, ValueError):
    """A stored file does not match the size or SHA-256 its manifest records."""


# --- one writer per directory ------------------------------------------------------------


def _holder(path: Path) -> str:
    """`pid N: command` from a lock file, waiting briefly for a holder still writing it."""
    for _ in range(20):
        try:
            text = path.read_text().strip()
        except OSError:
            text = ""
        if text:
            pid, _, command = text.partition("\n")
            return f"pid {pid}" + (f": {command}" if command else "")
        time.sleep(0.05)
    return "a pid not yet recorded"


@contextlib.contextmanager
def writer_lock(directory: str | os.PathLike, what: str = "directory") -> Iterator[Path]:
    """Hold the one-writer lock of `directory` (created if missing) for the `with` body.

    Raises `DirectoryInUseError` naming the holder's pid when another process holds it.
    The lock file is removed on release (and the directory, if the lock created it and
    nothing else was written there); a file left by a killed holder carries no lock
    (the kernel released it) and is taken over, its pid text rewritten. After taking the
    lock the file is checked to still be the one at the path (a releasing holder may have
    just removed it), so two processes can never both believe they hold it.
    """
    directory = Path(directory)
    created = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_NAME
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DirectoryInUseError(
                f"{directory}: {what} is being written by another blockdraft process "
                f"({_holder(path)}); wait for it to finish or use another directory"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        mine = os.fstat(fd)
        try:
            there = os.stat(path)
        except FileNotFoundError:
            there = None
        if there is not None and (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino):
            break
        os.close(fd)  # the previous holder removed the file between our open and flock
    try:
        command = " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))
        text = f"{os.getpid()}\n{command[:300]}\n".encode()
        os.pwrite(fd, text, 0)  # then cut: a reader sees the old holder or us, never nothing
        os.ftruncate(fd, len(text))
        yield path
    finally:
        with contextlib.suppress(OSError):
            there = os.stat(path)
            if (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino):
                os.unlink(path)  # still ours (an export swap may have moved it away)
        os.close(fd)  # releases the flock
        if created:  # a run refused or failed before writing anything leaves no trace
            with contextlib.suppress(OSError):
                directory.rmdir()  # only if empty


# --- files a manifest lists ---------------------------------------------------------------


def listed_file(
    directory: str | os.PathLike,
    name: Any,
    manifest: str | os.PathLike,
    error: type[BlockdraftError] = IntegrityError,
) -> Path:
    """`directory / name` for a file that `manifest` (the listing file's path) names.

    A manifest describes its own directory, so `name` must be a relative path that stays
    inside it: no absolute path, no `..`, no empty name. Decided from the text alone, so a
    crafted or mistyped entry (`../../../etc/passwd`) is refused before any file is opened,
    statted or written; raises `error` naming the manifest and the entry.
    """
    text = name if isinstance(name, str) else ""
    parts = PurePosixPath(text).parts
    if not parts or "\x00" in text or PurePosixPath(text).is_absolute() or ".." in parts:
        raise error(
            f"{manifest}: entry {name!r} is not a file inside {directory} (a manifest lists "
            "only files in its own directory); restore the manifest or make the set again"
        )
    return Path(directory) / text


def check_listed_files(
    directory: str | os.PathLike,
    entries: Any,
    manifest: str | os.PathLike,
    error: type[BlockdraftError] = IntegrityError,
    *,
    contiguous: bool = True,
) -> None:
    """The shard entries of a manifest (`file`, `first_row`, `rows`, `bytes`, `sha256`) are
    what readers index with: each names a file inside `directory` (`listed_file`), its
    counts are non-negative integers, and (`contiguous`) the shards cover rows 0, 1, ...
    in order, with no gap or overlap. Raises `error` naming the manifest and the entry,
    so a hand-edited count is refused before it indexes past a shard or reads rows twice.
    """
    if not isinstance(entries, list):
        raise error(f"{manifest}: 'shards' must be a list of entries, got {entries!r:.60}")
    row = 0
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or "file" not in entry:
            raise error(f"{manifest}: shards[{i}] {entry!r:.80} has no 'file'")
        listed_file(directory, entry["file"], manifest, error)
        where = f"{manifest}: shards[{i}] ({entry['file']})"
        for key in ("first_row", "rows", "bytes"):
            value = entry.get(key)
            if key == "bytes" and value is None:
                continue  # optional: sets written before sizes were recorded
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise error(f"{where}: {key!r} must be an integer >= 0, got {value!r}")
        if not isinstance(entry.get("sha256", ""), str):
            raise error(f"{where}: 'sha256' must be a hex string, got {entry['sha256']!r:.40}")
        if contiguous and entry["first_row"] != row:
            raise error(
                f"{where}: 'first_row' is {entry['first_row']} but the shards before it "
                f"end at row {row} (edited?); restore the manifest or make the set again"
            )
        row = entry["first_row"] + entry["rows"]


def read_listing_manifest(
    path: Path, kind: str, fmt: str, version: int, error: type[BlockdraftError]
) -> dict[str, Any]:
    """A stored set's manifest (`kind` "rollout" or "features": its `fmt` at `version`)
    with its shard entries checked (`check_listed_files`); a one-line `error` naming it."""
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise error(f"{path}:{exc.lineno}: invalid JSON ({exc.msg})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != fmt:
        raise error(f"{path}: not a blockdraft {kind} manifest (format != {fmt!r})")
    if manifest.get("version") != version:
        raise error(f"{path}: unsupported {kind} format version {manifest.get('version')!r}")
    check_listed_files(path.parent, manifest.get("shards", []), path, error)
    return manifest


# --- files checked against their records -------------------------------------------------


def verify_mode() -> str:
    """`sha256` (default) or `size`, from `BLOCKDRAFT_VERIFY`."""
    mode = os.environ.get("BLOCKDRAFT_VERIFY", "sha256")
    if mode not in ("sha256", "size"):
        raise BlockdraftError(f"BLOCKDRAFT_VERIFY: must be 'sha256' or 'size', got {mode!r}")
    return mode


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_digest(path: str | os.PathLike) -> dict[str, Any]:
    """`{"bytes", "sha256"}` of a file, streamed (the record `check_file` compares with)."""
    with open(path, "rb") as fh:
        digest = hashlib.file_digest(fh, "sha256").hexdigest()
    return {"bytes": Path(path).stat().st_size, "sha256": digest}


_VERIFIED: set[tuple[str, int, int, str]] = set()  # (file, size, mtime, sha256) hashed here


def file_problem(
    path: str | os.PathLike,
    record: dict[str, Any],
    *,
    sha256: bool | None = None,
    source: str = "the manifest",
) -> str | None:
    """What is wrong with `path` against `record` (`bytes`, `sha256`), or None if it matches.

    Size first (a stat); then, unless `sha256=False` (default: `verify_mode()`), the
    SHA-256 of the content, computed once per process for an unchanged file. `source`
    names where the record lives, for the message.
    """
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        return f"{path}: missing (listed in {source})"
    size = record.get("bytes")
    if size is not None and st.st_size != size:
        return f"{path}: truncated or replaced ({st.st_size} bytes, {source} says {size})"
    want = record.get("sha256")
    if sha256 is None:
        sha256 = verify_mode() == "sha256"
    if not (sha256 and want):
        return None
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, want)
    if key in _VERIFIED:
        return None
    if file_digest(path)["sha256"] != want:
        return f"{path}: corrupted (sha256 differs from {source})"
    _VERIFIED.add(key)
    return None


def check_file(
    path: str | os.PathLike,
    record: dict[str, Any],
    error: type[BlockdraftError] = IntegrityError,
    *,
    sha256: bool | None = None,
    source: str = "the manifest",
    hint: str = "",
) -> None:
    """Raise `error` (one line naming the file, plus `hint`) if `file_problem` finds one."""
    problem = file_problem(path, record, sha256=sha256, source=source)
    if problem is not None:
        raise error(problem + (f"; {hint}" if hint else ""))


# --- reproducible bytes, written atomically ----------------------------------------------


def canonical_json(obj: Any) -> bytes:
    """JSON with sorted keys: the same content gives the same bytes."""
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()


def safetensors_bytes(tensors: dict[str, Any], metadata: dict[str, str]) -> bytes:
    """`safetensors.torch.save` with the metadata keys in sorted order.

    safetensors keeps metadata in a hash map whose order changes from call to call, so
    two saves of the same tensors give different bytes; the header is rewritten here with
    sorted metadata (same tensors, same offsets, padded to 8 bytes as safetensors does).
    """
    data = save(tensors, metadata=metadata)
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    if "__metadata__" in header:
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data[8 + n :]


def with_filename(exc: OSError, path: str | os.PathLike) -> OSError:
    """`exc` naming `path` when it names no file (a failed `write()` or `flush()`)."""
    if exc.filename is None:
        return OSError(exc.errno, exc.strerror or str(exc), str(path))
    return exc


def write_atomic(path: str | os.PathLike, data: bytes, per_process: bool = False) -> None:
    """Write `data` to `path` via a temp file, fsync and rename: readers see old or new.

    The temp file never outlives a failure (a full disk must not stay full), and a failed
    write names `path` (Python's write errors carry no file name). `per_process`: the temp
    file's name holds the pid, for writers of one path that may race.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp" if per_process else f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise with_filename(exc, path) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    with contextlib.suppress(OSError):  # directories cannot be fsynced on every platform
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def refuse_existing(path: str | os.PathLike, flag: str, overwrite: bool) -> None:
    """An output file named by the user (`--json PATH`) must not replace a file already
    there (trained weights, a manifest, another run's results) unless `overwrite`; one
    line naming the path. Called before the work, so nothing is computed to be refused."""
    p = Path(path)
    if p.is_dir():
        raise BlockdraftError(f"{flag} {p}: is a directory; name a file")
    if not overwrite and (p.exists() or p.is_symlink()):
        raise BlockdraftError(
            f"{flag} {p}: file exists; pass --overwrite to replace it or choose another path"
        )


def write_new_file(path: str | os.PathLike, data: bytes, flag: str, overwrite: bool) -> None:
    """`write_atomic` of a user-named output after `refuse_existing`: the parent directory
    is created, a full disk leaves the old file (or none) and names the path. Without
    `overwrite` the finished temp file is hard-linked into place, which fails if a file
    appeared there meanwhile (another process's output is refused, never replaced)."""
    refuse_existing(path, flag, overwrite)
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise with_filename(exc, path.parent) from None
    if overwrite:
        write_atomic(path, data)
        return
    staged = path.with_name(f".{path.name}.{os.getpid()}.new")
    write_atomic(staged, data)
    try:
        os.link(staged, path)
    except FileExistsError:
        refuse_existing(path, flag, overwrite)  # raises: it exists now
    except OSError:  # a file system without hard links: the rename, as with overwrite
        os.replace(staged, path)
    finally:
        staged.unlink(missing_ok=True)


# --- disk space ------------------------------------------------------------------------


def _amounts(*sizes: int) -> list[str]:
    """`sizes` as text in one unit (MB, or GB from 1 GB up, by the largest), about three
    digits and never in exponent notation."""
    scale, unit = (1e9, "GB") if max(sizes) >= 1e9 else (1e6, "MB")

    def text(v: float) -> str:
        return f"{v:.0f}" if v >= 100 else f"{v:.3g}" if v >= 0.001 else f"{v:.4f}"

    return [f"{text(n / scale)} {unit}" for n in sizes]


def free_space_reserve(need_bytes: int) -> int:
    """What `ensure_free_space` keeps free beyond a write: 1% of it plus 16 MiB, so a
    stage never fills the disk to the last byte (logs, temporary files, other users)."""
    return int(need_bytes) // 100 + (16 << 20)


def ensure_free_space(directory: str | os.PathLike, need_bytes: int, what: str) -> None:
    """Refuse (one line: need, the reserve kept free, free, and where, in one unit) to
    start writing `need_bytes` of `what` into `directory` when its file system has less
    free space than the two together."""
    where = Path(directory)
    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return  # no answer (some network file systems): the write itself will tell
    need = int(need_bytes)
    reserve = free_space_reserve(need)
    if need > 0 and free < need + reserve:
        need_s, reserve_s, total_s, free_s = _amounts(need, reserve, need + reserve, free)
        raise DiskSpaceError(
            f"{where}: not enough free disk space for {what}: needs {need_s} plus {reserve_s} "
            f"kept free ({total_s} in all), {free_s} free; free some space or choose "
            "another directory"
        )


# --- what a directory holds ------------------------------------------------------------

_RUN_MARKERS = ("run.yaml", "metrics.jsonl", "checkpoints", "final", "best")


def _json_field(path: Path, key: str) -> Any:
    """`key` of the JSON object in `path`; None when it is missing, unreadable or no object."""
    try:
        return json.loads(path.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def stored_artifact(directory: str | os.PathLike) -> str | None:
    """What blockdraft artefact `directory` is: `export`, `checkpoint`, `run`, a manifest's
    `format` (`blockdraft-rollouts`, `blockdraft-features`), or None (not one of ours)."""
    d = Path(directory)
    if not d.is_dir():
        return None
    fmt = _json_field(d / "manifest.json", "format")
    if isinstance(fmt, str) and fmt.startswith("blockdraft-"):
        return fmt
    ours = _json_field(d / "config.json", "blockdraft")
    if isinstance(ours, dict):
        return "export" if "exported_from" in ours else "checkpoint"
    if (d / "trainer_state.json").is_file():
        return "checkpoint"
    if any((d / m).exists() for m in _RUN_MARKERS):
        return "run"
    return None


ARTIFACT_NAMES = {
    "blockdraft-rollouts": "a rollout set",
    "blockdraft-features": "a feature set",
    "run": "a training run",
    "checkpoint": "a drafter checkpoint",
    "export": "an export",
}


def describe_artifact(kind: str) -> str:
    return ARTIFACT_NAMES.get(kind, f"a {kind} directory")


def enclosing_artifact(directory: str | os.PathLike) -> tuple[Path, str] | None:
    """The nearest strict ancestor of `directory` that is a blockdraft artefact, and its kind."""
    d = Path(directory).resolve()
    for parent in d.parents:
        kind = stored_artifact(parent)
        if kind is not None:
            return parent, kind
    return None


def refuse_inside_artifact(
    directory: str | os.PathLike, flag: str, error: type[BlockdraftError] = BlockdraftError
) -> None:
    """Refuse to start a new set in `directory` when it lies inside another artefact (a
    rollout or feature set, a checkpoint or an export; a run directory may hold sets): that
    artefact would hold files it does not list, and replacing it would delete them."""
    inside = enclosing_artifact(directory)
    if inside is not None and inside[1] != "run":
        raise error(
            f"{flag} {directory}: lies inside {inside[0]}, which is "
            f"{describe_artifact(inside[1])}; choose a directory outside it"
        )
