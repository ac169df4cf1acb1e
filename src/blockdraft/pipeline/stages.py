"""Reuse a pipeline stage's output when its inputs did not change.

Each stage of the demo (rollouts, training, scoring) writes into its own directory and,
when it finishes, a `stage.json` holding a fingerprint of everything it was computed
from. A later run with the same fingerprint reuses the directory; another fingerprint
redoes the stage, and so does an interruption (no `stage.json` yet).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blockdraft.artifacts import write_atomic

MARKER = "stage.json"


def fingerprint(inputs: dict[str, Any]) -> str:
    """A stable short hash of JSON-serialisable stage inputs."""
    blob = json.dumps(inputs, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclass
class Stage:
    """One cached pipeline stage: `directory` plus the inputs it depends on."""

    directory: Path
    inputs: dict[str, Any]

    @property
    def key(self) -> str:
        return fingerprint(self.inputs)

    def _marker(self) -> Any:
        try:
            return json.loads((self.directory / MARKER).read_text())
        except (json.JSONDecodeError, OSError):
            return {}

    def is_done(self) -> bool:
        return self._marker().get("key") == self.key

    def outputs(self) -> dict[str, Any]:
        """What `finish` recorded (empty if the stage is not done)."""
        marker = self._marker()
        return marker.get("outputs", {}) if marker.get("key") == self.key else {}

    def finish(self, outputs: dict[str, Any] | None = None) -> None:
        """Record completion atomically (`write_atomic`)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        record = {"key": self.key, "inputs": self.inputs, "outputs": outputs or {}}
        write_atomic(self.directory / MARKER, json.dumps(record, indent=2, default=str).encode())


def recorded_key(directory: Path) -> str | None:
    """The key a finished stage in `directory` recorded (None if it never finished):
    downstream stages fold it into their own inputs, so recomputing an upstream stage
    invalidates everything built on it."""
    marker = directory / MARKER
    return json.loads(marker.read_text()).get("key") if marker.exists() else None


def portable(value: Any, out: Path) -> Any:
    """`value` with the output directory written as `<out>` wherever it appears.

    Stage keys must not depend on where the pipeline's directory is or how it was typed
    (`--out d` vs `--out /abs/d`, or a moved directory): only on what was computed.
    """
    if isinstance(value, dict):
        return {k: portable(v, out) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [portable(v, out) for v in value]
    if isinstance(value, str) and str(out) in value:
        return value.replace(str(out), "<out>")
    return value
