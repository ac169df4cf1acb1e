"""Greedy token choice on a CPU: the argmax of each logit row, through numpy.

Why: torch's CPU argmax is a scalar loop over the row, numpy's is vectorised, and every
greedy choice takes one (costs: docs/decoding.md). Both return the first index of the
largest value, so the tokens are the same.
"""

from __future__ import annotations

import numpy as np
import torch

from blockdraft.kernels import cpu_kernels_apply


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)` (int64, same shape without the last dim), numpy's on a CPU."""
    if (
        logits.dtype not in (torch.float32, torch.float64)
        or logits.requires_grad
        or not cpu_kernels_apply(logits.device)
    ):
        return logits.argmax(-1)
    return torch.from_numpy(np.asarray(logits.numpy().argmax(-1), dtype=np.int64))
