"""What a resumed run may change: a `--resume` with another objective or drafter shape is refused.

The checkpoint's `run.yaml` is compared with the new config before the target loads:
shape keys (the weights would not fit) are always refused, meaning keys (objective,
target) unless named in `--allow-changed`; everything else may change (docs/training.md).
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

import yaml

from blockdraft.objectives.registry import parameter_defaults
from blockdraft.training.config import ConfigError, TrainConfig

SHAPE_KEYS = (
    "drafter.arch",
    "drafter.num_layers",
    "drafter.block_size",
    "drafter.markov_rank",
    "drafter.lookup_inputs",
    "drafter.selector_rank",
    "drafter.selector_top_k",
    "drafter.conv_kernel_size",
    "drafter.conv_group_size",
    "drafter.draft_vocab_size",
    "target.layer_ids",
)
MEANING_KEYS = ("objective.name", "objective.mode", "data.train_subset", "target.name")


def meaning_keys() -> tuple[str, ...]:
    """`MEANING_KEYS` and every registered objective's parameters."""
    return MEANING_KEYS + tuple(f"objective.{k}" for k in parameter_defaults())


def check_allowed_keys(allow_changed: Collection[str]) -> None:
    """`allow_changed` names only keys a resumed run may be allowed to change."""
    for key in allow_changed:
        if key in SHAPE_KEYS:
            raise ConfigError(
                f"--allow-changed {key}: the drafter's shape cannot change on resume (its "
                "weights would not fit); start a new run instead"
            )
        if key not in meaning_keys():
            raise ConfigError(
                f"--allow-changed {key}: not a key a resume refuses (choose from "
                f"{', '.join(meaning_keys())}; other keys may change without it)"
            )


def _lookup(data: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def check_resumed_config(
    cfg: TrainConfig, checkpoint: Path, allow_changed: Collection[str] = ()
) -> None:
    """Refuse `cfg` when it changes what `checkpoint` means; one line naming every key."""
    check_allowed_keys(allow_changed)
    try:
        stored = yaml.safe_load((Path(checkpoint) / "run.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return  # an older checkpoint without a readable run.yaml: nothing to compare
    if not isinstance(stored, dict):
        return
    now = cfg.to_dict()
    shape, meaning = [], []
    for key in SHAPE_KEYS + meaning_keys():
        found, before = _lookup(stored, key)
        present, after = _lookup(now, key)
        if not (found and present) or before == after:
            continue  # a parameter only one side's objective has changes with objective.name
        change = f"{key} {before!r} -> {after!r}"
        if key in SHAPE_KEYS:
            shape.append(change)
        elif key not in allow_changed:
            meaning.append(change)
    if shape:
        raise ConfigError(
            f"--resume: {', '.join(shape)} differs from {checkpoint}: its weights do not fit "
            "another drafter shape; resume with the checkpoint's settings or start a new run"
        )
    if meaning:
        keys = " ".join(f"--allow-changed {c.split(' ', 1)[0]}" for c in meaning)
        raise ConfigError(
            f"--resume: {', '.join(meaning)} differs from {checkpoint}, which was trained "
            f"with the first; resume with its settings, or pass {keys} to change it mid-run"
        )
