"""`configure_cpu` / `flush_denormals`: denormal floats are treated as zero afterwards (the
objectives' gradients underflow into them, and x86 math on them is ~100x slower)."""

from __future__ import annotations

import pytest
import torch

from blockdraft.threads import configure_cpu, flush_denormals, runs_on_cpu


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


def test_work_on_an_accelerator_keeps_the_process_defaults(restore_denormals) -> None:
    """`configure_cpu` for a GPU run sets threads but leaves denormal handling alone."""
    if not flush_denormals():
        pytest.skip("this CPU has no flush-to-zero mode")
    torch.set_flush_denormal(False)
    assert configure_cpu(1, "cuda:0") == 1
    assert _denormal_survives()
    assert configure_cpu(1, "cpu") == 1
    assert not _denormal_survives()


def test_runs_on_cpu_resolves_auto_like_the_device_flags() -> None:
    assert runs_on_cpu("cpu") and not runs_on_cpu("cuda") and not runs_on_cpu("cuda:1")
    assert runs_on_cpu("auto") == (not torch.cuda.is_available())
    assert not runs_on_cpu("not-a-device")  # left to the caller's own one-line error
