"""Where training metrics go: `metrics.jsonl` (always), tensorboard (default), wandb (opt-in).

`metrics.jsonl` is the machine-readable record other tools (the report) read: one JSON
object per log event, each with at least `step` and `event` ("train" or "eval"), lists
kept as lists (`acc_k`, `dpace_weight_profile`). Tensorboard and wandb get the same
numbers, lists flattened to one scalar per slot. Only rank 0 writes.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from blockdraft.artifacts import with_filename, write_atomic

METRICS_FILE = "metrics.jsonl"


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if hasattr(value, "item"):
        return _jsonable(value.item())
    return value


def truncate_metrics(run_dir: Path, last_step: int) -> None:
    """On resume: events after the resumed checkpoint are superseded by the new run.

    They are moved (not deleted) to `metrics.superseded.jsonl`, so the main file reads as
    one uninterrupted run and nothing written is lost.
    """
    path = run_dir / METRICS_FILE
    if not path.exists():
        return
    keep, drop = [], []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            step = json.loads(line).get("step", 0)
        except json.JSONDecodeError:
            drop.append(line)
            continue
        (keep if step <= last_step else drop).append(line)
    if drop:
        with open(run_dir / "metrics.superseded.jsonl", "a") as fh:
            fh.write("\n".join(drop) + "\n")
    write_atomic(path, "".join(line + "\n" for line in keep).encode())


class MetricsLogger:
    """Fan one metrics dict out to jsonl, tensorboard and (if asked) wandb."""

    def __init__(
        self,
        run_dir: Path,
        *,
        enabled: bool,
        tensorboard: bool = True,
        wandb: bool = False,
        wandb_project: str = "blockdraft",
        config: dict[str, Any] | None = None,
    ) -> None:
        self._t0 = time.perf_counter()
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.run_dir / METRICS_FILE, "a")  # noqa: SIM115 - closed in close()
        if tensorboard:
            # lazy: tensorboard is slow to import and only `logging.tensorboard` runs use it
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        if wandb:
            try:
                # lazy: optional extra (blockdraft[wandb])
                import wandb as wandb_mod
            except ImportError:
                raise RuntimeError(
                    "logging.wandb=true but wandb is not installed (pip install wandb)"
                ) from None
            self._wandb = wandb_mod.init(
                project=wandb_project, config=config, dir=str(self.run_dir), resume="allow"
            )

    def log(self, step: int, metrics: dict[str, Any], event: str = "train") -> None:
        if not self.enabled:
            return
        # seconds since this logger started: learning curves against compute, not only steps
        elapsed = round(time.perf_counter() - self._t0, 2)
        record = {"step": int(step), "event": event, "elapsed_s": elapsed, **_jsonable(metrics)}
        try:
            self._fh.write(json.dumps(record) + "\n")
            self._fh.flush()
        except OSError as exc:  # a full disk: name the file (write() names none)
            raise with_filename(exc, self.run_dir / METRICS_FILE) from None
        scalars = self._flatten(metrics, prefix=f"{event}/")
        if self._tb is not None:
            for key, val in scalars.items():
                self._tb.add_scalar(key, val, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    @staticmethod
    def _flatten(metrics: dict[str, Any], prefix: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for key, val in metrics.items():
            if isinstance(val, (list, tuple)):
                for i, v in enumerate(val):
                    if isinstance(v, (int, float)):
                        out[f"{prefix}{key}/{i + 1}"] = float(v)
            elif isinstance(val, (int, float)) and not isinstance(val, bool):
                out[f"{prefix}{key}"] = float(val)
        return out

    def close(self) -> None:
        if not self.enabled:
            return
        self._fh.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
