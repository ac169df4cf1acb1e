"""`configure_cpu` / `flush_denormals`: denormal floats are treated as zero afterwards (the
objectives' gradients underflow into them, and x86 math on them is ~100x slower)."""

from __future__ import annotations

import pytest
import torch

from blockdraft.threads import configure_cpu, flush_denormals


@pytest.fixture
def restore_denormals():
    yield
    torch.set_flush_denormal(False)


def _denormal_survives() -> bool:
    tiny = torch.tensor([1e-39, 3e-42], dtype=torch.float32)  # both below float32's 1.2e-38
    return bool((tiny * 1.0 != 0).any() or (tiny @ torch.ones(2) != 0))


def test_denormals_flush_after_configure_cpu(restore_denormals, monkeypatch) -> None:
    torch.set_flush_denormal(False)
    assert _denormal_survives()  # the check can fail: without FTZ they are kept
    monkeypatch.setenv("BLOCKDRAFT_THREADS", "1")
    if not flush_denormals():
        pytest.skip("this CPU has no flush-to-zero mode")
    torch.set_flush_denormal(False)
    assert configure_cpu(None) == 1
    assert not _denormal_survives()
    # normal small numbers are untouched
    assert torch.tensor(2e-38) * 1.0 == torch.tensor(2e-38)
