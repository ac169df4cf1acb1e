"""tests/gpu: what CPU tests can only assume, checked on a CUDA device.

Every test here takes the `device` fixture. With CUDA present it is `cuda`; without it
the tests are skipped (so CI on CPU machines stays green and reports them as skipped),
unless `BLOCKDRAFT_GPU_TESTS_ON_CPU=1`, which runs the same bodies on the CPU at the
same small shapes: how these tests are debugged on a machine without a GPU. On the CPU
the device's own paths are the CPU's (`tiled` attention instead of `flex`, live-tensor
bytes instead of `torch.cuda.max_memory_allocated`), so a CPU pass proves the harness,
not the GPU.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ON_CPU_ENV = "BLOCKDRAFT_GPU_TESTS_ON_CPU"
HERE = Path(__file__).resolve().parent
# the CPU suites' helpers (chi-square, exact enumeration, live-bytes meter), by public name
for helpers in ("decoding", "training"):
    if str(HERE.parent / helpers) not in sys.path:
        sys.path.insert(0, str(HERE.parent / helpers))


def gpu_tests_on_cpu() -> bool:
    return os.environ.get(ON_CPU_ENV, "") not in ("", "0")


def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    if torch.cuda.is_available() or gpu_tests_on_cpu():
        return
    skip = pytest.mark.skip(reason=f"needs CUDA (or {ON_CPU_ENV}=1 to run them on the CPU)")
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device under test: the GPU, or the CPU under BLOCKDRAFT_GPU_TESTS_ON_CPU=1."""
    if torch.cuda.is_available() and not gpu_tests_on_cpu():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
