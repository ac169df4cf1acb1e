"""Row-wise maths over `[rows, V]` vocabulary tensors, a bounded number of rows at a time.

Why: the sampled E2E/EDR quantities (softmax of q, `min(p, q)`, `[p - q]_+`, `log q(x)`)
are per row, but written on whole tensors each step makes another `[rows, V]` float32
tensor and autograd keeps several for backward (gigabytes each at real recipes). Here
`fn` runs on `chunk_rows` rows at a time, each chunk checkpointed under autograd, so only
its inputs are kept. Values and gradients equal the unchunked computation (the maths is
row-wise): the chunk size is a pure memory knob (`default_chunk_rows` by default).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.utils.checkpoint import checkpoint

from blockdraft.objectives.cross_entropy import check_chunk_rows

Tensor = torch.Tensor


# ~1 MB of float32 per [rows, V] buffer: a chunk that stays in a core's cache between the
# several passes the fused kernels make over it
CPU_FUSED_CHUNK_BYTES = 1 << 20


def fused_chunk_rows(chunk_rows: int | None, vocab_size: int, device: torch.device) -> int:
    """Rows per chunk for the fused vocabulary kernels (`edr/acceptance.py`): `chunk_rows`, or by
    default `check_chunk_rows`' budget, capped on CPU at `CPU_FUSED_CHUNK_BYTES` per
    buffer (at least 8 rows).

    Why: those kernels read and write each `[rows, V]` chunk several times (softmax,
    `p - q`, the sums), so a chunk that fits in cache makes every pass after the first
    cheap; the memory budget's ~64 MB chunks go to DRAM on every pass (measured by
    bench/fused_chunks.py; research/training-benchmarks.md).
    Accelerators keep the large chunks (fewer kernel launches)."""
    rows = check_chunk_rows(chunk_rows, vocab_size)
    if chunk_rows is None and device.type == "cpu":
        rows = min(rows, max(8, CPU_FUSED_CHUNK_BYTES // (4 * vocab_size)))
    return rows


def by_row_chunks(
    fn: Callable[..., Tensor | tuple[Tensor, ...]],
    inputs: Sequence[Tensor | None],
    chunk_rows: int,
) -> tuple[Tensor, ...]:
    """`fn(*inputs)` computed `chunk_rows` rows at a time; outputs concatenated on dim 0.

    Every input has the same leading (row) dimension, or is None (passed on as None);
    `fn` returns one tensor or a tuple of tensors with that leading dimension and must be
    row-wise (row i of an output depends only on row i of the inputs)."""
    first = next(t for t in inputs if t is not None)
    rows = first.shape[0]
    track = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    if rows <= chunk_rows and not track:
        out = fn(*inputs)
        return out if isinstance(out, tuple) else (out,)
    parts: list[tuple[Tensor, ...]] = []
    for start in range(0, max(rows, 1), chunk_rows):
        args = [None if t is None else t[start : start + chunk_rows] for t in inputs]
        out = checkpoint(fn, *args, use_reentrant=False) if track else fn(*args)
        parts.append(out if isinstance(out, tuple) else (out,))
    return tuple(torch.cat(pieces) for pieces in zip(*parts, strict=True))
