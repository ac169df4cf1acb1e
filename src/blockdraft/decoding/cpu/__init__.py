"""CPU-only speed code of the decoding loop, behind one switch.

At batch 1 on a CPU every few-row product is bound by memory and dispatch, so the loop
packs fp32 weights (`packed_linear`) and screens large LM heads with int8 products before
an exact fp32 argmax (`argmax_screen`). Neither helps on an accelerator, and both are
exact, so `cpu_kernels_apply` alone decides: tensors on a CPU, unless the environment sets
`BLOCKDRAFT_CPU_KERNELS=0` (to measure the plain path side by side).
"""

from __future__ import annotations

import os

import torch

ENV = "BLOCKDRAFT_CPU_KERNELS"


def cpu_kernels_apply(device: torch.device | str) -> bool:
    """True when the CPU speed paths should run for tensors on `device`."""
    return torch.device(device).type == "cpu" and os.environ.get(ENV, "1") != "0"
