"""CPU kernels shared by decoding, evaluation and training, behind one switch.

At batch 1 (decoding) or a few dozen rows (greedy rollouts) on a CPU, products with a
large weight are bound by memory and dispatch: `packed_linear` packs fp32 weights once,
`argmax_screen` finds the exact fp32 argmax of a 262k-column LM head through int8
products, and `row_argmax` takes each row's argmax through numpy (every greedy choice:
the decoding loop, the evaluator, training's slot accuracies). None helps on an
accelerator, and all are exact, so `cpu_kernels_apply` alone decides: tensors on a CPU,
unless the environment sets `BLOCKDRAFT_CPU_KERNELS=0` (to measure the plain path side by
side).
"""

from __future__ import annotations

import os

import torch

ENV = "BLOCKDRAFT_CPU_KERNELS"


def cpu_kernels_apply(device: torch.device | str) -> bool:
    """True when the CPU speed paths should run for tensors on `device`."""
    return torch.device(device).type == "cpu" and os.environ.get(ENV, "1") != "0"
