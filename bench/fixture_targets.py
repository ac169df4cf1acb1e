"""The tests' random-weight targets (`tests/random_targets.py`) for the benches.

Benches time real architectures at real shapes without a download; the builder of those
targets is a test fixture, so it lives with the tests and the benches reach it from here.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from random_targets import SHAPES, make_random_target, make_shaped_target  # noqa: E402

__all__ = ["SHAPES", "make_random_target", "make_shaped_target"]
