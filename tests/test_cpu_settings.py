"""`configure_cpu` / `flush_denormals`: denormal floats are treated as zero afterwards (the
objectives' gradients underflow into them, and x86 math on them is ~100x slower)."""

from __future__ import annotations

import os

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


def test_other_load_counts_the_cores_other_processes_kept_busy(monkeypatch):
    """Busy jiffies of the whole machine (/proc/stat) less this process's own CPU time,
    per second of wall clock: 2 s of wall on 4 cores, 7 core-seconds busy of which 1 was
    ours -> other processes held 3 cores, which leaves 1 for a 2-thread measurement."""
    import blockdraft.threads as threads_mod

    hz = os.sysconf("SC_CLK_TCK")
    stats = iter([(10 * hz, 20 * hz), (10 * hz + 1 * hz, 20 * hz + 8 * hz)])  # (idle, total)
    clocks = iter([100.0, 102.0])  # perf_counter: 2 s
    cpu = iter([5.0, 6.0])  # process_time: 1 s ours
    monkeypatch.setattr(threads_mod, "_cpu_times", lambda: next(stats))
    monkeypatch.setattr(threads_mod.time, "perf_counter", lambda: next(clocks))
    monkeypatch.setattr(threads_mod.time, "process_time", lambda: next(cpu))
    load = threads_mod.OtherLoad()
    load.cores = 4
    with load:
        pass
    assert load.others == pytest.approx((8 - 1 - 1) / 2)  # (7 busy - 1 ours) / 2 s = 3
    assert load.contended(threads=2) and not load.contended(threads=1)


def test_other_load_is_unknown_without_proc_stat(monkeypatch):
    import blockdraft.threads as threads_mod

    def unreadable():
        raise OSError("no /proc")

    monkeypatch.setattr(threads_mod, "_cpu_times", unreadable)
    with threads_mod.OtherLoad() as load:
        pass
    assert load.others is None and not load.contended(threads=64)
