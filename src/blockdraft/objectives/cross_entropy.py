"""`log q(target)` from the drafter's hidden states, and the weighted cross-entropy that
every block objective but E2E is (`sum(w * -log q) / sum(w)`, the weights detached).

`log q(target)` is those objectives' only vocabulary-sized work, so it has two memory
modes and one place that chooses (`keeps_probabilities`, a byte budget): `[rows, V]`
probabilities kept from forward and turned into the gradient in place (one such tensor,
where `F.cross_entropy` allocates four), or, past the budget (real vocabularies), one row
chunk at a time with its logits recomputed in backward. Without autograd (scoring
passes) neither: cache-sized chunks, nothing kept. A negative target id means "no label":
log-probability 0, no gradient.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

_IGNORE = -100  # cross_entropy's ignore_index; every negative target is mapped to it

# Elements of one [chunk_rows, V] fp32 logits buffer when chunk_rows is chosen for you (64 MB).
DEFAULT_CHUNK_ELEMENTS = 1 << 24

# Largest `[rows, V]` probability buffer (bytes, compute dtype) `target_logprobs` keeps from
# forward to backward instead of recomputing logits chunk by chunk. The one knob that
# decides the mode; 0 forces the chunked mode (what the bench's "old path" does).
MAX_KEPT_PROBS_BYTES = 256 << 20

# Elements of one logits chunk when no gradient is wanted (4 MB fp32: about what stays in
# cache while its softmax statistics are taken), but never fewer than this many rows, so
# a large vocabulary's head weight is not streamed from memory once per handful of rows.
NO_GRAD_CHUNK_ELEMENTS = 1 << 20
NO_GRAD_MIN_ROWS = 64


def default_chunk_rows(vocab_size: int) -> int:
    """Rows per chunk so that one fp32 `[rows, V]` buffer stays around 64 MB."""
    return max(1, DEFAULT_CHUNK_ELEMENTS // max(1, vocab_size))


def check_chunk_rows(chunk_rows: int | None, vocab_size: int) -> int:
    """`chunk_rows`, or the default for this vocabulary; a clear error for bad values."""
    if chunk_rows is None:
        return default_chunk_rows(vocab_size)
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")
    return chunk_rows


def keeps_probabilities(
    rows: int, vocab_size: int, dtype: torch.dtype, budget_bytes: int | None = None
) -> bool:
    """Whether `target_logprobs` keeps the `[rows, V]` probabilities (no recompute).

    The single place the mode is decided: the buffer's size in the compute dtype against
    `budget_bytes` (default `MAX_KEPT_PROBS_BYTES`, read at call time).
    """
    budget = MAX_KEPT_PROBS_BYTES if budget_bytes is None else budget_bytes
    itemsize = torch.empty((), dtype=_compute_dtype(dtype)).element_size()
    return rows * vocab_size * itemsize <= budget


def _check_targets(targets: torch.Tensor, vocab_size: int, expected_shape: torch.Size) -> None:
    if targets.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise ValueError(f"targets must be an integer tensor of token ids, got {targets.dtype}")
    if targets.shape != expected_shape:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} does not match expected {tuple(expected_shape)}"
        )
    if targets.numel() and int(targets.max()) >= vocab_size:
        raise ValueError(
            f"target id {int(targets.max())} is out of range for vocab size {vocab_size}"
        )


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics in at least float32 (bf16/fp16 logits would lose the tail)."""
    return torch.promote_types(dtype, torch.float32)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`log softmax(logits)[target]`, shape `logits.shape[:-1]`; for logits that already exist.

    Goes through the fused `cross_entropy(reduction="none")` kernel, faster forward +
    backward on CPU than gather-minus-logsumexp, so the weighted loss built on it costs
    what plain cross-entropy costs (bench/objectives.py; research/training-benchmarks.md).
    """
    if logits.dim() < 1:
        raise ValueError("logits must have a trailing vocabulary dimension")
    _check_targets(targets, logits.shape[-1], logits.shape[:-1])
    flat_targets = targets.reshape(-1).long()
    flat_targets = torch.where(
        flat_targets >= 0, flat_targets, torch.full_like(flat_targets, _IGNORE)
    )
    flat_logits = logits.reshape(-1, logits.shape[-1]).to(_compute_dtype(logits.dtype))
    nll = torch.nn.functional.cross_entropy(
        flat_logits, flat_targets, reduction="none", ignore_index=_IGNORE
    )
    return (-nll).reshape(targets.shape)


def _softmax_(logits: torch.Tensor, normalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn `logits [rows, V]` into probabilities in place; return (probs, logsumexp).

    `normalise=False` skips the final division (the caller only wants the logsumexp).

    In place because on CPU every fresh `[rows, V]` tensor is page-faulted in anew
    (`torch.logsumexp` alone allocates one): this buffer is the only vocabulary-sized one.
    """
    top = logits.amax(dim=1, keepdim=True)
    probs = logits.sub_(top).exp_()
    total = probs.sum(dim=1, keepdim=True)
    if normalise:
        probs.div_(total)
    return probs, (top + total.log()).squeeze(1)


def _chunked_logq(hidden, weight, safe_targets, step, normalise, top_k=0):  # type: ignore[no-untyped-def]
    """`(log q(target), logsumexp, last chunk's probabilities, top-k logits, their columns)`,
    `step` rows of logits at a time; the probabilities are normalised only if asked (the
    kept mode's backward); the top-k `[rows, top_k]` are taken before the softmax."""
    rows = hidden.shape[0]
    dtype = _compute_dtype(hidden.dtype)
    logq = torch.zeros(rows, dtype=dtype, device=hidden.device)
    lse = torch.zeros(rows, dtype=dtype, device=hidden.device)
    top = torch.empty((rows, top_k), dtype=dtype, device=hidden.device)
    columns = torch.empty((rows, top_k), dtype=torch.long, device=hidden.device)
    probs = None
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        logits = (hidden[start:stop] @ weight.T).to(dtype)
        picked = logits.gather(1, safe_targets[start:stop, None]).squeeze(1)
        if top_k:
            torch.topk(logits, top_k, dim=1, out=(top[start:stop], columns[start:stop]))
        probs, lse[start:stop] = _softmax_(logits, normalise=normalise)
        logq[start:stop] = picked - lse[start:stop]
    return logq, lse, probs, top, columns


def _no_grad_logprobs(hidden, weight, targets, top_k=0):  # type: ignore[no-untyped-def]
    """`log q(target)` with nothing kept for backward (scoring passes): each chunk's logits
    are reduced while they are in cache, never normalised, never written out whole."""
    step = max(NO_GRAD_MIN_ROWS, NO_GRAD_CHUNK_ELEMENTS // max(1, weight.shape[0]))
    logq, _, _, top, columns = _chunked_logq(
        hidden, weight, targets.clamp_min(0), step, normalise=False, top_k=top_k
    )
    return torch.where(targets >= 0, logq, torch.zeros_like(logq)), top, columns


def _forward(ctx, hidden, weight, targets, chunk_rows, keep_probs, top_k):  # type: ignore[no-untyped-def]
    valid = targets >= 0
    safe_targets = targets.clamp_min(0)
    step = max(hidden.shape[0], 1) if keep_probs else chunk_rows
    logq, lse, probs, top, columns = _chunked_logq(
        hidden, weight, safe_targets, step, normalise=keep_probs, top_k=top_k
    )
    logq = torch.where(valid, logq, torch.zeros_like(logq))
    ctx.save_for_backward(hidden, weight, safe_targets, valid, lse, columns)
    ctx.mark_non_differentiable(columns)
    ctx.chunk_rows = chunk_rows
    # An intermediate (not an input/output), so it may live on ctx; freed after one use.
    ctx.probs = probs if keep_probs else None
    return logq, top, columns


def _backward(ctx, grad_logq, grad_top):  # type: ignore[no-untyped-def]
    hidden, weight, safe_targets, valid, lse, columns = ctx.saved_tensors
    need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_hidden = torch.empty_like(hidden) if need_hidden else None
    dtype = lse.dtype
    grad_weight = (
        torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_weight else None
    )
    g = torch.where(valid, grad_logq.to(dtype), torch.zeros_like(lse))
    kept, ctx.probs = ctx.probs, None  # a second backward (retain_graph) recomputes
    rows = hidden.shape[0]
    step = max(rows, 1) if kept is not None else ctx.chunk_rows
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        h = hidden[start:stop]
        if kept is not None:
            grad_logits = kept
        else:
            grad_logits = (h @ weight.T).to(dtype).sub_(lse[start:stop, None]).exp_()
        # d logq / d logits = onehot(target) - softmax; scaled by the incoming gradient.
        g_chunk = g[start:stop, None]
        grad_logits.mul_(-g_chunk).scatter_add_(1, safe_targets[start:stop, None], g_chunk)
        if columns.shape[1]:  # the top-k logits' own gradient lands on their columns
            grad_logits.scatter_add_(1, columns[start:stop], grad_top[start:stop].to(dtype))
        if need_hidden:
            grad_hidden[start:stop] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
        if need_weight:
            grad_weight.addmm_(grad_logits.T, h.to(dtype))
        del grad_logits
    if need_weight:
        grad_weight = grad_weight.to(weight.dtype)
    return grad_hidden, grad_weight, None, None, None, None


def _make_function(device_type: str) -> type[torch.autograd.Function]:
    """The autograd function for one device type, autocast-aware (`custom_fwd/custom_bwd`).

    Under autocast the forward's matmuls run in the autocast dtype; `custom_bwd` makes the
    backward (which autograd runs outside the autocast region) use the same state, so its
    recomputed logits match the forward's and its matmuls are not silently fp32.
    `custom_fwd` needs the device type at decoration time, hence one class per type.
    """

    class _TargetLogprobs(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type=device_type)
        def forward(ctx, hidden, weight, targets, chunk_rows, keep_probs, top_k):  # type: ignore[override]
            return _forward(ctx, hidden, weight, targets, chunk_rows, keep_probs, top_k)

        @staticmethod
        @torch.amp.custom_bwd(device_type=device_type)
        @once_differentiable
        def backward(ctx, grad_logq, grad_top, _grad_columns):  # type: ignore[override]
            return _backward(ctx, grad_logq, grad_top)

    _TargetLogprobs.__name__ = _TargetLogprobs.__qualname__ = f"TargetLogprobs_{device_type}"
    return _TargetLogprobs


_FUNCTIONS: dict[str, type[torch.autograd.Function]] = {}


def _function_for(device: torch.device) -> type[torch.autograd.Function]:
    if device.type not in _FUNCTIONS:
        _FUNCTIONS[device.type] = _make_function(device.type)
    return _FUNCTIONS[device.type]


def target_logprobs(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_rows: int | None = None,
    max_kept_bytes: int | None = None,
) -> torch.Tensor:
    """`log q(target)` for rows of final hidden states, differentiable, never `[rows, V]` twice.

    hidden `[..., H]` (the drafter's final-normed states), head_weight `[V, H]` (the LM
    head, no bias), targets `[...]` int ids (negative = no label). Returns float32 `[...]`.
    Gradients flow to `hidden` and, if it requires grad, to `head_weight`. If the
    `[rows, V]` probabilities fit `max_kept_bytes` (default `MAX_KEPT_PROBS_BYTES`; see
    `keeps_probabilities`) they are kept for backward; otherwise peak extra memory is
    O(chunk_rows * V) including the backward pass, which recomputes each chunk's logits.
    `chunk_rows=None` picks ~64 MB chunks. Values and gradients are the same either way.
    """
    return target_logprobs_and_top(hidden, head_weight, targets, 0, chunk_rows, max_kept_bytes)[0]


def target_logprobs_and_top(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    targets: torch.Tensor,
    top_k: int,
    chunk_rows: int | None = None,
    max_kept_bytes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(log q(target) [...], top-k logits [..., top_k], their columns [..., top_k])`.

    `target_logprobs` that also returns each row's `top_k` largest logits (float32,
    differentiable, descending) and their columns, from the same head product: a DFlash2
    selector re-ranks exactly those candidates, so its training step needs no second pass
    over the vocabulary and no `[rows, k, H]` gather of head rows. In backward the top-k
    logits' gradient joins the cross-entropy's `[rows, V]` gradient before its two products.
    """
    if hidden.dim() < 1 or head_weight.dim() != 2:
        raise ValueError(
            f"expected hidden [..., H] and head_weight [V, H], "
            f"got {tuple(hidden.shape)} and {tuple(head_weight.shape)}"
        )
    vocab_size, hidden_size = head_weight.shape
    if hidden.shape[-1] != hidden_size:
        raise ValueError(
            f"hidden size {hidden.shape[-1]} does not match head_weight {tuple(head_weight.shape)}"
        )
    if hidden.dtype != head_weight.dtype:
        raise ValueError(
            f"hidden dtype {hidden.dtype} differs from head_weight dtype {head_weight.dtype}"
        )
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= vocab_size:
        raise ValueError(f"top_k must be an int in [0, {vocab_size}], got {top_k!r}")
    _check_targets(targets, vocab_size, hidden.shape[:-1])
    chunk_rows = check_chunk_rows(chunk_rows, vocab_size)
    lead_shape = hidden.shape[:-1]
    flat_hidden = hidden.reshape(-1, hidden_size)
    flat_targets = targets.reshape(-1).long()
    if not (torch.is_grad_enabled() and (hidden.requires_grad or head_weight.requires_grad)):
        logq, top, columns = _no_grad_logprobs(flat_hidden, head_weight, flat_targets, top_k)
    else:
        keep = keeps_probabilities(flat_hidden.shape[0], vocab_size, hidden.dtype, max_kept_bytes)
        fn = _function_for(hidden.device)
        logq, top, columns = fn.apply(
            flat_hidden, head_weight, flat_targets, chunk_rows, keep, top_k
        )
    return logq.reshape(lead_shape), top.view(*lead_shape, top_k), columns.view(*lead_shape, top_k)


def weighted_cross_entropy(
    logq: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """`sum(w * -logq * mask) / sum(w * mask)`, weights detached; the shared reduction.

    Normalising by the summed weights over the whole batch (not per block) matches the
    DFlash baseline's reduction, so uniform, decay and D-PACE are comparable at the same
    learning rate. `weights` broadcasts against `logq` (e.g. `[K]` or `[N, K]`). Masked
    entries are removed with `where`, so a -inf log-prob at a padding slot cannot turn
    into NaN. An all-zero total weight gives a loss of 0 (still attached to the graph).
    """
    weights = weights.detach()
    try:
        weights = torch.broadcast_to(weights, logq.shape)
    except RuntimeError:
        raise ValueError(
            f"weights shape {tuple(weights.shape)} does not broadcast to logq {tuple(logq.shape)}"
        ) from None
    keep = torch.ones_like(logq, dtype=torch.bool) if mask is None else mask
    if keep.shape != logq.shape or keep.dtype != torch.bool:
        raise ValueError(
            f"mask must be a bool tensor of shape {tuple(logq.shape)}, "
            f"got {keep.dtype} {tuple(keep.shape)}"
        )
    w = torch.where(
        keep, weights.to(logq.dtype), torch.zeros((), dtype=logq.dtype, device=logq.device)
    )
    nll = torch.where(keep, -logq, torch.zeros((), dtype=logq.dtype, device=logq.device))
    total = w.sum()
    safe_total = torch.where(total > 0, total, torch.ones_like(total))
    return (w * nll).sum() / safe_total
