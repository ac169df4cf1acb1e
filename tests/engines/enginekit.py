"""Shared marks and the drafter trainer of the engine tests."""

import pytest

from blockdraft.engines.dflash_support import vllm_version
from blockdraft.training import config_from_dict, train

needs_vllm = pytest.mark.skipif(
    vllm_version() is None, reason="vLLM is not installed (`make engine` installs it)"
)


def train_tiny_drafter(tiny, rollouts, run, layer_ids=None, draft_vocab_size=512):
    """A 1-layer DFlash drafter, 60 steps of D-PACE: good enough that an engine accepts
    some proposals and rejects others (`draft_vocab_size=None`: the whole vocabulary)."""
    cfg = config_from_dict(
        {
            "run_dir": str(run),
            "seed": 0,
            "target": {"layer_ids": layer_ids},
            "num_anchors": 32,
            "data": {"train_rollouts": str(rollouts), "eval_split": 0.1,
                     "max_seq_len": 256},
            "drafter": {"num_layers": 1, "block_size": 8, "draft_vocab_size": draft_vocab_size},
            "objective": {"name": "dpace"},
            "optim": {"lr": 3e-3, "batch_size": 8, "max_steps": 60, "warmup_steps": 4},
            "eval": {"every": 0, "at_start": False},
            "checkpoint": {"save_every": 0},
            "logging": {"every": 20, "progress": False, "tensorboard": False},
        }
    )  # fmt: skip
    return train(cfg, target=tiny)
