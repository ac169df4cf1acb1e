"""Checkpoints a run can be resumed from exactly, written so a crash never corrupts one.

A checkpoint directory holds the drafter (`model.safetensors` + `config.json`, written by
`blockdraft.models.checkpoint.save_drafter`), `trainer_state.pt` (optimizer, scheduler
and RNG states: only tensors and plain containers, loaded with `weights_only=True`),
`trainer_state.json` (step, best MAL, data position: human-readable) and `run.yaml` (the
resolved config with package version and git sha).

Atomicity: everything is written into a hidden temporary sibling directory which is
renamed into place only when complete; replacing `best/` or `final/` renames the old copy
aside first and deletes it last, and `recover_interrupted_swaps` repairs the one window
where neither name exists. The data position is just the optimizer step: batches and
anchors are pure functions of (seed, step) (see `batching.py`), so nothing else about the
data stream needs saving.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_PT = "trainer_state.pt"
STATE_JSON = "trainer_state.json"


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


def _tmp_sibling(path: Path) -> Path:
    return path.parent / f".tmp-{path.name}-{os.getpid()}"


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
    tmp = _tmp_sibling(path)
    if tmp.exists():
        shutil.rmtree(tmp)
    write_model(tmp)  # save_drafter creates the directory (itself atomically)
    tmp.mkdir(exist_ok=True)
    torch.save(trainer_tensors, tmp / STATE_PT)
    (tmp / "run.yaml").write_text(run_yaml)
    (tmp / STATE_JSON).write_text(json.dumps(asdict(progress), indent=2))  # written last
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


def recover_interrupted_swaps(run_dir: Path) -> None:
    """Undo a swap cut short between its two renames; drop half-written temp dirs."""
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
            elif child.name.startswith(".tmp-"):
                shutil.rmtree(child, ignore_errors=True)


def is_complete(path: Path) -> bool:
    return (path / STATE_JSON).is_file() and (path / STATE_PT).is_file()


def step_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete `checkpoints/step-N` directories, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = STEP_DIR.match(child.name)
        if m and is_complete(child):
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpts = step_checkpoints(run_dir)
    return ckpts[-1][1] if ckpts else None


def prune_checkpoints(run_dir: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` step checkpoints (best/ and final/ untouched)."""
    ckpts = step_checkpoints(run_dir)
    for _, path in ckpts[: max(0, len(ckpts) - keep_last)]:
        shutil.rmtree(path, ignore_errors=True)


def read_progress(path: Path) -> TrainerProgress:
    data = json.loads((Path(path) / STATE_JSON).read_text())
    return TrainerProgress(**data)


def read_trainer_tensors(path: Path) -> dict[str, Any]:
    """Optimizer/scheduler/RNG state; `weights_only=True` so no arbitrary code can run."""
    return torch.load(Path(path) / STATE_PT, map_location="cpu", weights_only=True)
