"""The mask tokens recorded by the artifacts a stage reads: rollout sets and drafters.

Why: a pipeline names its mask token once; every later stage loads the target with the
token these records hold (`blockdraft.targets.mask_token.load_target_with_mask`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from blockdraft.data.rollouts.store import read_manifest
from blockdraft.serialization.checkpoint import read_config, resolve_checkpoint
from blockdraft.serialization.drafter_spec import DrafterSpec, checkpoint_of
from blockdraft.targets.mask_token import RecordedMask


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return [value] if isinstance(value, (str, Path, DrafterSpec)) else list(value)


def recorded_masks(
    rollouts: Iterable[str | Path] = (), drafters: Iterable[DrafterSpec | str | Path] = ()
) -> list[RecordedMask]:
    """The mask tokens recorded by rollout sets (manifest `target.mask_token`) and drafter
    checkpoints (`mask_token_id`) a command will read; unreadable ones are left to the
    command's own checks."""
    found: list[RecordedMask] = []
    for directory in _as_list(rollouts):
        try:
            target = ((read_manifest(Path(directory)) or {}).get("target")) or {}
        except (OSError, ValueError):
            continue
        token = target.get("mask_token")
        if token is None:
            token = target.get("mask_token_id")
        if token is not None:
            found.append(RecordedMask(f"the rollouts in {directory}", token))
    for spec in _as_list(drafters):
        try:
            # a plain path (export, serve-check) names a checkpoint
            ckpt = (
                checkpoint_of(spec) if isinstance(spec, DrafterSpec) else resolve_checkpoint(spec)
            )
            cfg = read_config(ckpt) if ckpt is not None else {}
        except (OSError, ValueError):
            continue
        mask_id = (cfg.get("dflash_config") or {}).get("mask_token_id", cfg.get("mask_token_id"))
        if isinstance(mask_id, int):
            found.append(RecordedMask(f"drafter {ckpt}", mask_id))
    return found
