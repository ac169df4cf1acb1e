"""Session fixtures for training tests (see trainkit.py for the learnable setting)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from trainkit import MAX_NEW_TOKENS, learnable_target, prompts_for

from blockdraft.data.rollouts import SamplingSettings, generate_rollouts


@pytest.fixture(scope="session")
def target():
    return learnable_target()


@pytest.fixture(scope="session")
def rollout_dirs(target, tmp_path_factory) -> dict[str, Path]:
    """{greedy,sampled}: 24 rollouts each (the training configs hold out 1/3 by prompt)."""
    root = tmp_path_factory.mktemp("rollouts")
    out = {}
    for mode, temp in (("greedy", 0.0), ("sampled", 0.7)):
        settings = SamplingSettings(temperature=temp, max_new_tokens=MAX_NEW_TOKENS, seed=1)
        d = root / mode
        shutil.rmtree(d, ignore_errors=True)
        generate_rollouts(target, prompts_for("p", 24), d, settings, batch_size=24, progress=False)
        out[mode] = d
    return out
