"""Rollouts from N processes (torchrun, one or several nodes) into one rollout directory.

Why it can be simple: a rollout depends only on its prompt, the seed and the target
(counter-based randomness, `sampler.py`), never on its batch, shard or process. So the
one-process shard grid is kept, shards are dealt to ranks round-robin, and N processes
write what one process writes, byte for byte. Rank 0 alone writes `manifest.json` (a
contiguous prefix of shards) and plans; other ranks record finished shards in their own
part files, which rank 0 folds in; a run that dies keeps every finished shard and the next
one, with any number of processes, writes only the rest (docs/architecture.md, "data").
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from blockdraft.artifacts import check_listed_files
from blockdraft.data.rollouts.store import MANIFEST, RolloutError, write_atomic
from blockdraft.devices import resolve_device

PART_PREFIX = "manifest.rank-"
# Ranks finish at different times and the last barrier waits for the slowest one; a rank
# that dies is handled by torchrun (it stops the others), so a long timeout never hangs.
PROCESS_GROUP_TIMEOUT = timedelta(hours=24)


@dataclass(frozen=True)
class RankContext:
    """This process's place among the rollout processes (rank 0 of 1 without torchrun)."""

    rank: int = 0
    world_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (pickled; plans are small)."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def rank_context() -> RankContext:
    """The context of an initialised process group, else the one-process context."""
    if dist.is_available() and dist.is_initialized():
        return RankContext(dist.get_rank(), dist.get_world_size())
    return RankContext()


def init_from_env(device: str = "auto") -> tuple[RankContext, torch.device, bool]:
    """Join torchrun's process group if `WORLD_SIZE` > 1; pick this rank's device.

    Returns (context, device, created) where `created` says whether we created the group
    (and so should destroy it). `auto` is this rank's GPU when there is one, else CPU;
    plain `cuda` also means this rank's GPU (`LOCAL_RANK`).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))

    dev = resolve_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world <= 1 or dist.is_initialized():
        return rank_context(), dev, False
    backend = "nccl" if dev.type == "cuda" else "gloo"
    # nccl cannot broadcast Python objects without a device; gloo carries the small plan.
    dist.init_process_group(
        backend=backend,
        timeout=PROCESS_GROUP_TIMEOUT,
        device_id=dev if dev.type == "cuda" else None,
    )
    return rank_context(), dev, True


@dataclass(frozen=True)
class ShardTask:
    """Rows `first_row .. first_row + rows - 1` to generate into `file`."""

    file: str
    first_row: int
    rows: int


# --- part files --------------------------------------------------------------------------


def part_path(out: Path, rank: int) -> Path:
    return out / f"{PART_PREFIX}{rank:05d}.json"


def part_files(out: Path) -> list[Path]:
    return sorted(out.glob(f"{PART_PREFIX}*.json"))


def read_part(path: Path) -> list[dict[str, Any]]:
    """Shard entries recorded in one part file (clear error naming the file if unusable)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except json.JSONDecodeError as exc:
        raise RolloutError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg})") from None
    shards = data.get("shards") if isinstance(data, dict) else None
    if not isinstance(shards, list) or not all(
        isinstance(s, dict) and {"file", "first_row", "rows"} <= set(s) for s in shards
    ):
        raise RolloutError(f"{path}: not a rollout part file (key 'shards' missing or malformed)")
    check_listed_files(path.parent, shards, path, RolloutError, contiguous=False)
    return shards


def record_part(out: Path, rank: int, entry: dict[str, Any]) -> None:
    """Add a finished shard's entry to this rank's part file (keeps older entries)."""
    path = part_path(out, rank)
    shards = [s for s in read_part(path) if s["first_row"] != entry["first_row"]] + [entry]
    data = {"rank": rank, "shards": sorted(shards, key=lambda s: s["first_row"])}
    write_atomic(path, (json.dumps(data, indent=1) + "\n").encode())


def drop_part_entries(out: Path, first_rows: set[int]) -> None:
    """Forget recorded shards starting at `first_rows` (damaged files, to be made again)."""
    for path in part_files(out):
        shards = read_part(path)
        kept = [s for s in shards if s["first_row"] not in first_rows]
        if len(kept) != len(shards):
            data = json.loads(path.read_text())
            write_atomic(path, (json.dumps({**data, "shards": kept}, indent=1) + "\n").encode())


def remove_parts(out: Path) -> None:
    for path in part_files(out):
        path.unlink(missing_ok=True)


def finished_beyond_prefix(out: Path, manifest: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Part-file entries that start at or after the manifest's prefix, keyed by first row."""
    done = manifest["num_rollouts"]
    pool: dict[int, dict[str, Any]] = {}
    for path in part_files(out):
        for entry in read_part(path):
            if entry["first_row"] >= done:
                pool[entry["first_row"]] = entry
    return pool


def extend_prefix(manifest: dict[str, Any], pool: dict[int, dict[str, Any]]) -> bool:
    """Move pool entries that continue the manifest's prefix into it; True if any moved."""
    moved = False
    while manifest["num_rollouts"] in pool:
        entry = pool.pop(manifest["num_rollouts"])
        manifest["shards"].append(entry)
        manifest["num_rollouts"] += entry["rows"]
        manifest["num_response_tokens"] += entry["response_tokens"]
        moved = True
    for stale in [k for k in pool if k < manifest["num_rollouts"]]:
        del pool[stale]
    return moved


def plan_tasks(
    manifest: dict[str, Any], pool: dict[int, dict[str, Any]], num_prompts: int, shard_size: int
) -> list[ShardTask]:
    """The shards still to generate, in row order, on the grid of a one-process run.

    From the end of the prefix, rows are cut every `shard_size` rows, except that a
    shard recorded in the pool is skipped whole (and the shard before it ends there).
    Shard files are numbered by position, like a one-process run numbers them.
    """
    if shard_size < 1:
        raise ValueError("shard_size must be >= 1")
    taken = {e["file"] for e in pool.values()}
    starts = sorted(pool)
    index, row, tasks = len(manifest["shards"]), manifest["num_rollouts"], []
    while row < num_prompts:
        if row in pool:
            row += pool[row]["rows"]
            index += 1
            continue
        nxt = next((s for s in starts if s > row), num_prompts)
        stop = min(row + shard_size, nxt, num_prompts)
        name = f"shard-{index:05d}.safetensors"
        if name in taken:  # only if an earlier run used another shard size
            name = f"shard-{index:05d}-{row}.safetensors"
        tasks.append(ShardTask(name, row, stop - row))
        row, index = stop, index + 1
    return tasks


def manifest_digest(out: Path) -> str:
    """SHA-256 of `manifest.json` as this process sees it (the shared-filesystem check)."""
    try:
        return hashlib.sha256((out / MANIFEST).read_bytes()).hexdigest()
    except FileNotFoundError:
        return "missing"
