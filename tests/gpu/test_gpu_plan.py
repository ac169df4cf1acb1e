"""The memory planner (`blockdraft train --plan`) against the measured peak on the device.

On CUDA the measure is `torch.cuda.max_memory_allocated` over building the target,
drafter and optimizer and running two real training steps (`training/synthetic.py`:
the trainer's builders, `loop.train_step`, bf16 target and autocast, `flex` attention),
minus what was allocated before; the plan is `plan_memory` of the same config and
target config on "cuda". Within 20%, for each shape. On the CPU
(BLOCKDRAFT_GPU_TESTS_ON_CPU=1) the same steps are measured as live tensor bytes
(tests/training/test_memory_plan.py's `LiveBytes`) against the CPU plan.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_memory_plan import LiveBytes

from blockdraft.data.rollouts.sampler import SamplingSettings
from blockdraft.devices import resolve_dtype
from blockdraft.training.config import load_config
from blockdraft.training.loop import train_step
from blockdraft.training.memory_plan import plan_memory
from blockdraft.training.synthetic import random_rollouts, synthetic_run
from random_targets import make_shaped_target

# (target shape overrides of `qwen3-8b`, config overrides, rollout temperature)
CUDA_SHAPES = {
    "dpace-T1024": (
        dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=4, vocab_size=32768),
        {"data.max_seq_len": 1024, "num_anchors": 128, "drafter.block_size": 16,
         "drafter.num_layers": 2, "optim.batch_size": 1},
        0.0,
    ),
    "dpace-b2-T768": (
        dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=6,
             num_attention_heads=8, num_key_value_heads=4, vocab_size=32768),
        {"data.max_seq_len": 768, "num_anchors": 96, "drafter.block_size": 8,
         "drafter.num_layers": 3, "optim.batch_size": 2},
        0.0,
    ),
    "edr-sampling-T512": (
        dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=6,
             num_attention_heads=8, num_key_value_heads=4, vocab_size=32768),
        {"data.max_seq_len": 512, "objective.name": "edr", "objective.max_anchors": 64,
         "drafter.block_size": 16, "drafter.num_layers": 2, "optim.batch_size": 1},
        1.0,
    ),
}  # fmt: skip


def _shape(device, name: str):  # type: ignore[no-untyped-def]
    """`CUDA_SHAPES[name]`, scaled down on the CPU (width / 8, vocabulary / 8, sequence
    and anchors / 4) so BLOCKDRAFT_GPU_TESTS_ON_CPU runs the same cases in seconds."""
    shape, overrides, temperature = CUDA_SHAPES[name]
    if device.type == "cuda":
        return shape, overrides, temperature
    shape = {
        **shape,
        "hidden_size": 128,
        "intermediate_size": 384,
        "vocab_size": 4096,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
    }
    small = {k: v // 4 if k in ("data.max_seq_len", "num_anchors", "objective.max_anchors")
             else v for k, v in overrides.items()}  # fmt: skip
    return shape, small, temperature


@contextlib.contextmanager
def measured_peak(device):  # type: ignore[no-untyped-def]
    """Yields a dict whose "peak" is set on exit: bytes at the high-water mark, above
    what was allocated on entry."""
    result: dict[str, int] = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        yield result
        torch.cuda.synchronize(device)
        result["peak"] = torch.cuda.max_memory_allocated(device) - base
    else:
        with LiveBytes() as meter:
            yield result
        result["peak"] = meter.peak


def measure_against_plan(device, name: str) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """(planned peak, measured peak) in bytes of two steps of shape `name`."""
    shape, overrides, temperature = _shape(device, name)
    keys = {"data.train_rollouts": "synthetic", "data.eval_split": 0, **overrides}
    cfg = load_config(None, [f"{k}={v}" for k, v in keys.items()])
    T, batch = cfg.data.max_seq_len, cfg.optim.batch_size
    with measured_peak(device) as peak:
        dtype = resolve_dtype(cfg.target.dtype, device)
        target = make_shaped_target("qwen3-8b", device=device, dtype=dtype, **shape)
        rollouts = random_rollouts(batch, T // 8, T - T // 8, shape["vocab_size"], seed=1)
        parts = synthetic_run(cfg, target, rollouts, SamplingSettings(temperature), device)
        for step in range(2):
            train_step(parts, step, want_acc=False)
        del parts, target
    plan = plan_memory(cfg, 1, device.type, hf_config=make_config_only(shape))
    return plan.peak, peak["peak"]


def make_config_only(shape: dict):  # type: ignore[no-untyped-def]
    from transformers import Qwen3Config

    from random_targets import SHAPES

    return Qwen3Config(**{**SHAPES["qwen3-8b"][1], **shape})


@pytest.mark.parametrize("name", list(CUDA_SHAPES))
def test_plan_within_20_percent_of_measured_peak(device, name):
    planned, measured = measure_against_plan(device, name)
    ratio = planned / measured
    assert 0.8 <= ratio <= 1.2, (name, planned / 2**30, measured / 2**30, ratio)
