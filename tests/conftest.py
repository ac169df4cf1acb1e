"""Shared fixtures: small random targets (no downloads, sub-second)."""

from __future__ import annotations

import pytest
import torch

from random_targets import make_random_target

# Test models are tiny: one thread is as fast as two and immune to oversubscription when
# several processes share the 2 cores of a CI machine (two threads were seen 10x slower).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _deterministic():
    """Seeded, and back to one thread after every test (CLI tests apply `--threads`)."""
    torch.manual_seed(0)
    yield
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def random_target():
    """A random-weight Qwen3-architecture target with a real BPE tokenizer."""
    return make_random_target("qwen3")
