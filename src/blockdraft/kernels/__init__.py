"""CPU kernels shared by decoding, evaluation and training, behind one switch.

Few-row products with a large weight on a CPU are bound by memory and dispatch:
`packed_linear` packs fp32 weights once, `argmax_screen` finds the exact fp32 argmax of a
large LM head through int8 products, `row_argmax` takes row argmaxes through numpy. All
are exact and none helps an accelerator, so `cpu_kernels_apply` alone decides: tensors on
a CPU, unless `BLOCKDRAFT_CPU_KERNELS=0` (to measure the plain path).
"""

from __future__ import annotations

import os

import torch

ENV = "BLOCKDRAFT_CPU_KERNELS"


def cpu_kernels_apply(device: torch.device | str) -> bool:
    """True when the CPU speed paths should run for tensors on `device`."""
    return torch.device(device).type == "cpu" and os.environ.get(ENV, "1") != "0"
