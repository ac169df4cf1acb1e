"""Every script in examples/ runs as a user would run it: `python examples/X.py` from an
empty directory (it writes there), with its own user cache, and exits 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from blockdraft.user_cache import CACHE_ENV

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.py"))


def test_there_are_examples():
    assert EXAMPLES, "examples/*.py: none found"


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(script: Path, tmp_path: Path) -> None:
    env = {**os.environ, CACHE_ENV: str(tmp_path / "cache")}
    run = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, f"{script.name} failed:\n{run.stdout}\n{run.stderr[-3000:]}"
    assert run.stdout.strip(), f"{script.name} printed nothing"
