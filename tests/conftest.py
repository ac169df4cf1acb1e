"""Shared fixtures: small random targets (no downloads, sub-second)."""

from __future__ import annotations

import pytest
import torch

from blockdraft.models.testing import make_random_target


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def random_target():
    """A random-weight Qwen3-architecture target with a real BPE tokenizer."""
    return make_random_target("qwen3")
