"""blockdraft: train and evaluate parallel block draft models for speculative decoding.

`import blockdraft` is cheap (no torch): the Python API's names (`blockdraft.api`,
docs/python-api.md) load on first use through the module `__getattr__` (PEP 562), so a
script that only reads `blockdraft.__version__`, or the CLI's `--help`, pays nothing.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# the public names, each from `blockdraft.api` (its `__all__`)
API = (
    "RolloutSet",
    "Target",
    "TrainConfig",
    "compare",
    "decode",
    "evaluate",
    "export",
    "generate_rollouts",
    "load_drafter",
    "load_prompts",
    "load_target",
    "open_rollouts",
    "run_suite",
    "train",
)
__all__ = ["__version__", *API]


def __getattr__(name: str) -> Any:
    if name in API:
        value = getattr(importlib.import_module("blockdraft.api"), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    raise AttributeError(f"module 'blockdraft' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *API])
