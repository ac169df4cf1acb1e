"""Checkpoints a run can be resumed from exactly, written so a crash never corrupts one.

A checkpoint (the drafter, `trainer_state.pt` of plain tensors, `trainer_state.json`,
`run.yaml`) is built in a hidden sibling and renamed into place; `recover_interrupted_swaps`
repairs what a killed write leaves. `trainer_state.json`, written last, records each
file's size and SHA-256, so `--resume` takes the newest *valid* one. Layout:
docs/architecture.md.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from blockdraft.artifacts import (
    describe_artifact,
    enclosing_artifact,
    ensure_free_space,
    file_digest,
    file_problem,
    listed_file,
    stored_artifact,
)
from blockdraft.errors import CheckpointError, disk_write_error
from blockdraft.serialization.checkpoint import verify_weights

STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_PT = "trainer_state.pt"
STATE_JSON = "trainer_state.json"
CHECKED_FILES = ("model.safetensors", "config.json", STATE_PT, "run.yaml")
# leftovers of killed writes: ours (.tmp-*, .old-*, .prune-*) and serialization.checkpoint's
# (.NAME.tmp-XXXXXXXX, .NAME.old-XXXXXXXX, e.g. `..tmp-step-4-123.tmp-1a2b3c4d`)
_LEFTOVER = re.compile(r"^\.(tmp-|prune-|.+\.(tmp|old)-[0-9a-f]{8}$)")


@dataclass
class TrainerProgress:
    """The scalar state of a run: where it is and what it has seen."""

    step: int = 0
    tokens_seen: int = 0
    best_mal: float | None = None
    best_step: int | None = None
    world_size: int = 1
    global_batch: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_checkpoint_dir(
    path: Path,
    write_model: Callable[[Path], None],
    trainer_tensors: dict[str, Any],
    progress: TrainerProgress,
    run_yaml: str,
) -> Path:
    """Write a complete checkpoint into `path` atomically (replacing any existing one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".tmp-{path.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        ensure_free_space(path.parent, _tensor_bytes(trainer_tensors), "the trainer state")
        write_model(tmp)  # save_drafter creates the directory (itself atomically)
        tmp.mkdir(exist_ok=True)
        try:
            torch.save(trainer_tensors, tmp / STATE_PT)
        except RuntimeError as exc:  # torch reports a full disk as "unexpected pos ..."
            raise disk_write_error(path / STATE_PT, exc) from None
        (tmp / "run.yaml").write_text(run_yaml)
        files = {n: file_digest(tmp / n) for n in CHECKED_FILES if (tmp / n).is_file()}
        body = {**asdict(progress), "files": files}
        (tmp / STATE_JSON).write_text(json.dumps(body, indent=2))  # written last
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed write leaves nothing behind
        if isinstance(exc, OSError) and exc.filename is None:  # name the checkpoint
            raise OSError(exc.errno, exc.strerror, str(path)) from None
        raise
    if path.exists():
        old = path.parent / f".old-{path.name}"
        if old.exists():
            shutil.rmtree(old)
        path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old)
    else:
        tmp.rename(path)
    return path


def _tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in a nested state (what `torch.save` will write, roughly)."""
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def recover_interrupted_swaps(run_dir: Path) -> None:
    """Undo a swap cut short between its two renames; drop leftovers of killed writes
    (temporary directories of either writer, half-pruned step checkpoints)."""
    for parent in (run_dir, run_dir / "checkpoints"):
        if not parent.is_dir():
            continue
        for child in parent.iterdir():
            if child.name.startswith(".old-"):
                live = parent / child.name[len(".old-") :]
                if live.exists():
                    shutil.rmtree(child)
                else:
                    child.rename(live)
            elif _LEFTOVER.match(child.name):
                if child.is_dir():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink(missing_ok=True)
            elif (
                parent.name == "checkpoints"
                and STEP_DIR.match(child.name)
                and child.is_dir()
                and not is_complete(child)
            ):  # step dirs appear only by rename when whole: this one was half-pruned
                shutil.rmtree(child, ignore_errors=True)


def is_complete(path: Path) -> bool:
    return (path / STATE_JSON).is_file() and (path / STATE_PT).is_file()


def step_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete `checkpoints/step-N` directories, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    matches = ((STEP_DIR.match(child.name), child) for child in root.iterdir())
    return sorted((int(m.group(1)), child) for m, child in matches if m and is_complete(child))


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpts = step_checkpoints(run_dir)
    return ckpts[-1][1] if ckpts else None


def checkpoint_problem(path: Path) -> str | None:
    """Why step checkpoint `path` cannot be resumed from, or None: the recorded size and
    SHA-256 of each file, or for older checkpoints that the files parse."""
    path = Path(path)
    try:
        data = json.loads((path / STATE_JSON).read_text())
    except (OSError, ValueError) as exc:
        return f"{path / STATE_JSON}: unreadable ({exc})"
    files = data.get("files") if isinstance(data, dict) else None
    if files:  # the check rollout and feature shards get (artifacts.file_problem)
        for name, rec in files.items():
            try:  # a record names a file of this checkpoint, nothing outside it
                listed = listed_file(path, name, path / STATE_JSON, CheckpointError)
            except CheckpointError as exc:
                return str(exc)
            problem = file_problem(listed, rec, sha256=True, source=STATE_JSON)
            if problem is not None:
                return problem
        return None
    try:
        verify_weights(path)
        with zipfile.ZipFile(path / STATE_PT) as z:
            bad = z.testzip()
        if bad is not None:
            return f"{path / STATE_PT}: corrupted member {bad}"
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        return str(exc)
    return None


def latest_valid_checkpoint(run_dir: Path, warn: Callable[[str], None] = print) -> Path | None:
    """The newest step checkpoint that passes `checkpoint_problem`; skipped ones are reported."""
    for step, path in reversed(step_checkpoints(run_dir)):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        warn(f"--resume: skipping step {step}: {problem}")
    return None


def prune_checkpoints(run_dir: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` step checkpoints, each renamed to a hidden
    `.prune-step-N` first (a kill mid-delete leaves no half `step-N`)."""
    ckpts = step_checkpoints(run_dir)
    for _, path in ckpts[: max(0, len(ckpts) - keep_last)]:
        doomed = path.parent / f".prune-{path.name}"
        path.rename(doomed)
        shutil.rmtree(doomed, ignore_errors=True)


RUN_OUTPUTS = ("final", "best", "checkpoints", "metrics.jsonl", "tensorboard", "run.yaml")


def existing_outputs(run_dir: Path) -> list[str]:
    """Names of a previous run's outputs in `run_dir` (what a fresh start would replace)."""
    run_dir = Path(run_dir)
    found = [n for n in RUN_OUTPUTS if (run_dir / n).exists() and n != "run.yaml"]
    if found == ["checkpoints"] and not any((run_dir / "checkpoints").iterdir()):
        return []
    return found


def clear_run_outputs(run_dir: Path) -> list[str]:
    """Delete a previous run's outputs (`--overwrite`): only the names `train` writes."""
    removed = []
    for name in RUN_OUTPUTS:
        p = Path(run_dir) / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
        else:
            continue
        removed.append(name)
    return removed


class RunDirError(CheckpointError):
    """A run directory that cannot be started or resumed as asked (names the fix)."""


def refuse_foreign_run_dir(run_dir: Path) -> None:
    """A run never writes (or `--overwrite`s) into a rollout set, feature set, checkpoint
    or export, nor inside one: its outputs would mix with, or delete, that artefact."""
    kind = stored_artifact(run_dir)
    where = run_dir
    if kind in (None, "run"):
        found = enclosing_artifact(run_dir)
        kind, where = (found[1], found[0]) if found and found[1] != "run" else (None, run_dir)
    if kind is not None:
        inside = "" if where == run_dir else f"lies inside {where}, which is "
        raise RunDirError(
            f"run_dir: {run_dir} {inside or 'is '}{describe_artifact(kind)}, not a run "
            "directory; choose another run_dir"
        )


def prepare_run_dir(
    run_dir: Path, *, resume: bool = False, overwrite: bool = False, warn: Callable = print
) -> Path | None:
    """Make `run_dir` ready and return the checkpoint to resume from (None: fresh start).

    Nothing of an earlier run is replaced unasked: a fresh start over its outputs needs
    `overwrite` (which deletes exactly those); `resume` takes the newest valid step
    checkpoint and refuses a run that left none rather than silently restarting.
    """
    run_dir = Path(run_dir)
    if resume and overwrite:
        raise RunDirError("--resume and --overwrite contradict each other: pass one")
    refuse_foreign_run_dir(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    recover_interrupted_swaps(run_dir)
    if overwrite:
        removed = clear_run_outputs(run_dir)
        if removed:
            warn(f"--overwrite: removed {', '.join(removed)} from {run_dir}")
    if not resume:
        found = existing_outputs(run_dir)
        if found:
            raise RunDirError(
                f"run_dir: {run_dir} already holds a run ({', '.join(found)}); pass --resume "
                "to continue it, --overwrite to replace it, or choose another run_dir"
            )
        return None
    resume_from = latest_valid_checkpoint(run_dir, warn)
    if resume_from is None:
        found = [n for n in existing_outputs(run_dir) if n != "checkpoints"]
        if found:
            raise RunDirError(
                f"run_dir: {run_dir} holds a run ({', '.join(found)}) but no valid step "
                "checkpoint to resume from (checkpoint.save_every=0, or all broken); pass "
                "--overwrite to start again or choose another run_dir"
            )
        warn(f"--resume: no checkpoint in {run_dir / 'checkpoints'}; starting from scratch")
    return resume_from


def read_progress(path: Path) -> TrainerProgress:
    """The progress a step checkpoint records, checked key by key (an edited file is one
    line naming the key, never a resume from step 0 or a TypeError)."""
    file = Path(path) / STATE_JSON
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file}: unreadable ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object")
    data.pop("files", None)
    known = {f.name for f in fields(TrainerProgress)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise CheckpointError(f"{file}: unknown key {unknown[0]!r}")
    for key in ("step", "tokens_seen", "best_step", "world_size", "global_batch"):
        value = data.get(key)
        if key in ("step", "tokens_seen") and value is None:
            raise CheckpointError(f"{file}: {key!r} missing")
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise CheckpointError(f"{file}: {key!r} must be an integer, got {value!r}")
    best = data.get("best_mal")
    if best is not None and (not isinstance(best, (int, float)) or isinstance(best, bool)):
        raise CheckpointError(f"{file}: 'best_mal' must be a number, got {best!r}")
    if not isinstance(data.get("extra", {}), dict):
        raise CheckpointError(f"{file}: 'extra' must be a mapping")
    return TrainerProgress(**data)


def read_trainer_tensors(path: Path) -> dict[str, Any]:
    """Optimizer/scheduler/RNG state; `weights_only=True` so no arbitrary code can run."""
    file = Path(path) / STATE_PT
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # weights_only refused it: never suggest loading it anyway
        raise CheckpointError(
            f"{file}: refused: it holds more than plain tensors (torch's weights-only loader "
            "stopped it), so blockdraft did not write it; delete this checkpoint directory "
            "to resume from an earlier one"
        ) from None
    except (RuntimeError, EOFError, ValueError) as exc:  # truncated zip, bad pickle
        raise CheckpointError(f"{file}: unreadable ({str(exc).splitlines()[0]})") from None
