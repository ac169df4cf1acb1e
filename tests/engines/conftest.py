"""Fixtures for the engine tests: the shipped `tiny` target (a folder vLLM loads), its
greedy rollouts and a briefly trained drafter with a reduced draft vocabulary (`d2t`)."""

from __future__ import annotations

import pytest
from enginekit import train_tiny_drafter

from blockdraft.data.prompt_specs import load_prompts
from blockdraft.data.rollouts import generate_rollouts
from blockdraft.sampling import SamplingSettings
from blockdraft.targets.registry import load_target

MAX_NEW_TOKENS = 48


@pytest.fixture(scope="session")
def tiny():
    return load_target("tiny", progress=False)


@pytest.fixture(scope="session")
def tiny_sets(tiny, tmp_path_factory):
    """Greedy `tiny` rollouts: 48 training prompts and 8 held-out ones."""
    root = tmp_path_factory.mktemp("engine-rollouts")
    settings = SamplingSettings(temperature=0, max_new_tokens=MAX_NEW_TOKENS)
    out = {}
    for name, spec, n in (("train", "stdlib:train", 48), ("eval", "stdlib:eval", 8)):
        prompts = load_prompts(spec, limit=n)
        generate_rollouts(tiny, prompts, root / name, settings, progress=False, prompt_spec=spec)
        out[name] = root / name
    return out


@pytest.fixture(scope="session")
def tiny_drafter(tiny, tiny_sets, tmp_path_factory):
    """A 1-layer DFlash drafter trained for a few dozen steps on a 512-token draft
    vocabulary: enough that vLLM accepts some of its proposals and some it rejects."""
    return train_tiny_drafter(
        tiny, tiny_sets["train"], tmp_path_factory.mktemp("engine-drafter") / "run"
    )
