"""Fixtures for the engine tests: the shipped `tiny` target (a folder vLLM loads), its
greedy rollouts and a briefly trained drafter with a reduced draft vocabulary (`d2t`)."""

from __future__ import annotations

import pytest

from blockdraft.data.prompt_specs import load_prompts
from blockdraft.data.rollouts import generate_rollouts
from blockdraft.sampling import SamplingSettings
from blockdraft.targets.registry import load_target
from blockdraft.training import config_from_dict, train

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


def _train(tiny, rollouts, run, layer_ids=None):
    cfg = config_from_dict(
        {
            "run_dir": str(run),
            "seed": 0,
            "target": {"layer_ids": layer_ids},
            "num_anchors": 32,
            "data": {"train_rollouts": str(rollouts), "eval_split": 0.1,
                     "max_seq_len": 256},
            "drafter": {"num_layers": 1, "block_size": 8, "draft_vocab_size": 512},
            "objective": {"name": "dpace"},
            "optim": {"lr": 3e-3, "batch_size": 8, "max_steps": 60, "warmup_steps": 4},
            "eval": {"every": 0, "at_start": False},
            "checkpoint": {"save_every": 0},
            "logging": {"every": 20, "progress": False, "tensorboard": False},
        }
    )  # fmt: skip
    return train(cfg, target=tiny)


@pytest.fixture(scope="session")
def tiny_drafter(tiny, tiny_sets, tmp_path_factory):
    """A 1-layer DFlash drafter trained for a few dozen steps on a 512-token draft
    vocabulary: enough that vLLM accepts some of its proposals and some it rejects."""
    return _train(tiny, tiny_sets["train"], tmp_path_factory.mktemp("engine-drafter") / "run")
