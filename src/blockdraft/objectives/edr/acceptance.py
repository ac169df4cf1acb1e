"""Per-proposal acceptance A and immediate cost c of EDR (docs/methods.md, "EDR"), from logits.

Modes: `"sampling"` (lossless speculative sampling, `A = min(1, q(x)/p(x))`, TV cost),
`"greedy_hard"` (`A = 1[argmax q = x]`, evaluation) and `"greedy_soft"` (`A = q(x)` at
`temperature` beta, i.e. `softmax(z / beta)(x)`: the greedy-EDR training relaxation); at
a realised stop token the cost is 0. The readable per-row formula (`_RowsFn`) and the
fused single pass with an analytic backward (`fused_sampling_acceptance`, what training
runs) sit side by side so the tests compare one with the other. Definitions and the
backward's derivation: docs/methods.md, "EDR".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from blockdraft.objectives.row_chunks import by_row_chunks, check_chunk_rows, fused_chunk_rows

Tensor = torch.Tensor
MODES = ("sampling", "greedy_hard", "greedy_soft")
COST_FORMS = ("tv", "realised")


def _check(draft_logits: Tensor, target: Tensor | None, target_ids: Tensor, mode: str) -> None:
    if mode not in MODES:
        hint = (
            " ('greedy' is ambiguous: pick greedy_hard or greedy_soft)" if mode == "greedy" else ""
        )
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}{hint}")
    if draft_logits.dim() < 2:
        raise ValueError(f"draft_logits must be [..., K, V], got shape {tuple(draft_logits.shape)}")
    if target_ids.shape != draft_logits.shape[:-1]:
        raise ValueError(
            f"target_ids {tuple(target_ids.shape)} must match draft_logits "
            f"{tuple(draft_logits.shape)} without V"
        )
    if (
        target_ids.dtype.is_floating_point
        or target_ids.dtype.is_complex
        or target_ids.dtype == torch.bool
    ):
        raise ValueError(f"target_ids must be integer token ids, got dtype {target_ids.dtype}")
    vocab = draft_logits.shape[-1]
    if target_ids.numel() and (int(target_ids.min()) < 0 or int(target_ids.max()) >= vocab):
        raise ValueError(
            f"target_ids must lie in [0, {vocab}), "
            f"got range [{int(target_ids.min())}, {int(target_ids.max())}]"
        )
    if mode == "sampling":
        if target is None:
            raise ValueError("sampling mode needs the target distribution (logits or probs)")
        if target.shape != draft_logits.shape:
            raise ValueError(
                f"target {tuple(target.shape)} must match draft_logits {tuple(draft_logits.shape)}"
            )


def _stop_mask(target_ids: Tensor, stop_token_ids: Sequence[int]) -> Tensor:
    stops = torch.as_tensor(list(stop_token_ids), dtype=torch.long, device=target_ids.device)
    if stops.numel() == 0:
        return torch.zeros_like(target_ids, dtype=torch.bool)
    return torch.isin(target_ids.long(), stops)


def acceptance_and_cost(
    draft_logits: Tensor,
    target: Tensor | None,
    target_ids: Tensor,
    *,
    mode: str = "sampling",
    temperature: float = 1.0,
    target_is_probs: bool = False,
    stop_token_ids: Sequence[int] = (),
    cost_form: str = "tv",
    chunk_rows: int | None = None,
    fused: bool = True,
) -> tuple[Tensor, Tensor]:
    """Acceptance `A` and immediate cost `c` for each proposal (module docstring).

    Computed `chunk_rows` proposals at a time (`row_chunks`: None = ~64 MB of float32 per
    chunk), so no full `[..., V]` float32 intermediate exists and autograd keeps none;
    the same values and gradients as one pass.

    `fused` (sampling mode, target without gradient): `edr/acceptance.py`'s single pass with a
    closed-form backward instead of autograd through the formula below; same values and
    gradients up to rounding, fewer `[.., V]` passes. `fused=False` runs the
    straightforward formula (`_RowsFn`), the reference the tests compare against.

    `temperature` divides the draft logits (the drafter's sampling distribution) and, if
    `target` is given as logits, the target logits too; pass `target_is_probs=True` with
    already processed target probabilities (top-k/top-p etc.). `target` may be None in
    the greedy modes. Gradients flow into `draft_logits` (and into `target` if it
    requires grad)."""
    _check(draft_logits, target, target_ids, mode)
    if cost_form not in COST_FORMS:
        raise ValueError(f"cost_form must be one of {', '.join(COST_FORMS)}, got {cost_form!r}")
    if mode != "greedy_hard" and not temperature > 0:
        raise ValueError(f"temperature must be > 0 for mode {mode!r}, got {temperature!r}")
    stop_token_ids = [int(s) for s in stop_token_ids]
    bad = [s for s in stop_token_ids if not 0 <= s < draft_logits.shape[-1]]
    if bad:
        raise ValueError(
            f"stop_token_ids {bad} are outside the vocabulary [0, {draft_logits.shape[-1]})"
        )
    dtype = torch.promote_types(draft_logits.dtype, torch.float32)
    stop = _stop_mask(target_ids, stop_token_ids)
    zero = torch.zeros((), dtype=dtype, device=draft_logits.device)

    if mode == "greedy_hard":
        acc = (draft_logits.argmax(-1) == target_ids.long()).to(dtype)
        return acc, torch.where(stop, zero, 1 - acc)

    vocab = draft_logits.shape[-1]
    keep = None
    if stop_token_ids and mode == "sampling" and cost_form == "tv":
        keep = torch.ones(vocab, dtype=torch.bool, device=draft_logits.device)
        keep[torch.as_tensor(stop_token_ids, dtype=torch.long, device=keep.device)] = False
    rows = check_chunk_rows(chunk_rows, vocab)
    fused_rows = fused_chunk_rows(chunk_rows, vocab, draft_logits.device)
    flat_target = target.reshape(-1, vocab) if mode == "sampling" and target is not None else None
    flat = [draft_logits.reshape(-1, vocab), flat_target, target_ids.reshape(-1).long()]
    if (
        fused
        and mode == "sampling"
        and flat_target is not None
        and not (torch.is_grad_enabled() and flat_target.requires_grad)
    ):
        stops = None
        if keep is not None:
            stops = torch.as_tensor(stop_token_ids, dtype=torch.long, device=keep.device)
        outs = fused_sampling_acceptance(
            flat[0],
            flat_target,
            flat[2],
            temperature=temperature,
            target_is_probs=target_is_probs,
            stops=stops,
            want_cost=cost_form == "tv",
            chunk_rows=fused_rows,
        )
    else:
        rows_fn = _RowsFn(mode, dtype, temperature, target_is_probs, cost_form, keep)
        outs = by_row_chunks(rows_fn, flat, rows)
    outs = tuple(o.reshape(target_ids.shape) for o in outs)
    if mode == "greedy_soft":
        return greedy_soft_from_logprobs(outs[0], target_ids, stop_token_ids)
    acc = outs[0]
    if cost_form == "realised":
        return acc, torch.where(stop, zero, 1 - acc)
    return acc, torch.where(stop, zero, outs[1].clamp(max=1.0))


class _RowsFn:
    """The per-row maths of `acceptance_and_cost` on `[rows, V]` chunks (`row_chunks`):
    greedy_soft -> `log q(x)`; sampling -> `A` (and the TV cost unless realised)."""

    def __init__(
        self,
        mode: str,
        dtype: torch.dtype,
        temperature: float,
        target_is_probs: bool,
        cost_form: str,
        keep: Tensor | None,
    ) -> None:
        self.mode, self.dtype, self.temperature = mode, dtype, temperature
        self.target_is_probs, self.cost_form, self.keep = target_is_probs, cost_form, keep

    def __call__(
        self, logits: Tensor, target: Tensor | None, ids: Tensor
    ) -> Tensor | tuple[Tensor, ...]:
        dtype, idx = self.dtype, ids.unsqueeze(-1)
        logq = torch.log_softmax(logits.to(dtype) / self.temperature, dim=-1)
        logq_x = logq.gather(-1, idx).squeeze(-1)
        if self.mode == "greedy_soft":
            return logq_x
        assert target is not None
        if self.target_is_probs:
            p = target.to(dtype)
            logp_x = p.gather(-1, idx).squeeze(-1).clamp_min(torch.finfo(dtype).tiny).log()
        else:
            logp = torch.log_softmax(target.to(dtype) / self.temperature, dim=-1)
            p = logp.exp()
            logp_x = logp.gather(-1, idx).squeeze(-1)
        # min(1, q/p) in log space; p(x) = 0 cannot happen for a token sampled from p.
        acc = torch.exp(torch.clamp(logq_x - logp_x, max=0.0))
        if self.cost_form == "realised":
            return (acc,)
        gap = (p - logq.exp()).clamp_min(0)
        mass = p
        if self.keep is not None:
            gap, mass = gap * self.keep, p * self.keep
        return acc, gap.sum(-1) / mass.sum(-1).clamp_min(torch.finfo(dtype).tiny)


def greedy_soft_from_logprobs(
    logq_x: Tensor, target_ids: Tensor, stop_token_ids: Sequence[int] = ()
) -> tuple[Tensor, Tensor]:
    """Greedy-soft `A = q(x)`, `c = 1 - A` (0 at stop tokens) from `log q(x)` alone.

    Why: against a greedy target only the drafter's probability of the realised token
    matters, so callers that already have `log q(x)` (e.g. from a vocabulary-chunked
    cross-entropy) need not materialise `[..., K, V]` logits, which at a 262k vocabulary
    is gigabytes per batch.
    """
    acc = logq_x.exp()
    stop = _stop_mask(target_ids, stop_token_ids)
    return acc, torch.where(stop, torch.zeros((), dtype=acc.dtype, device=acc.device), 1 - acc)


# ---- the fused sampling-mode pass: the values and gradients of `_RowsFn`, fewer passes
# over [rows, V], an analytic backward (docs/methods.md, "EDR") ----


def _q_and_p(
    logits: Tensor,
    target: Tensor,
    temperature: float,
    target_is_probs: bool,
    dtype: torch.dtype,
    out: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """`(q, log q, p, log p or None)` for one row chunk, computed as the reference does
    (log-softmax, then exp) so that forward and backward see the same numbers; `q` is
    written into `out` if given."""
    z = logits.to(dtype)
    if temperature != 1:  # z / 1 == z exactly: at T = 1 the division is a wasted pass
        z = torch.div(z, temperature, out=out)
    logq = torch.log_softmax(z, dim=-1)
    q = torch.exp(logq, out=out)
    return (q, logq, *_p(target, temperature, target_is_probs, dtype))


def _p(
    target: Tensor, temperature: float, target_is_probs: bool, dtype: torch.dtype
) -> tuple[Tensor, Tensor | None]:
    """`(p, log p or None)` of one row chunk, as the reference computes them."""
    if target_is_probs:
        return target.to(dtype), None
    z = target.to(dtype)
    logp = torch.log_softmax(z if temperature == 1 else z / temperature, dim=-1)
    return logp.exp(), logp


def _acceptance_terms(
    logq: Tensor, p: Tensor, logp: Tensor | None, idx: Tensor, tiny: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`(log q(x), p(x), A, a)` of one row chunk, `A = exp(min(0, log q_x - log p_x))` and
    `a = A 1[log q_x <= log p_x]` (dJ/dlog q(x) per unit dJ/dA, autograd's clamp
    convention), shared by the fused forward and the gradient sampler's scoring pass."""
    logq_x = logq.gather(-1, idx).squeeze(-1)
    p_x = p.gather(-1, idx).squeeze(-1)
    logp_x = p_x.clamp_min(tiny).log() if logp is None else logp.gather(-1, idx).squeeze(-1)
    return logq_x, p_x, *_acceptance_at(logq_x, logp_x)


def _acceptance_at(logq_x: Tensor, logp_x: Tensor) -> tuple[Tensor, Tensor]:
    """`(A, a)` from the labels' `log q(x)` and `log p(x)` (`_acceptance_terms`)."""
    diff = logq_x - logp_x
    acc = torch.exp(diff.clamp(max=0.0))
    zero = torch.zeros((), dtype=acc.dtype, device=acc.device)
    return acc, torch.where(diff <= 0, acc, zero)


class _FusedSampling(torch.autograd.Function):
    """`(A, c)` (or `(A,)` when `want_cost` is False) for `[N, V]` logits and target."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        logits: Tensor,
        target: Tensor,
        ids: Tensor,
        temperature: float,
        target_is_probs: bool,
        stops: Tensor | None,
        want_cost: bool,
        chunk_rows: int,
        keep_q: bool,
    ) -> tuple[Tensor, ...]:
        dtype = torch.promote_types(logits.dtype, torch.float32)
        rows, vocab = logits.shape
        tiny = torch.finfo(dtype).tiny
        new = lambda: torch.empty(rows, dtype=dtype, device=logits.device)  # noqa: E731
        acc, coef = new(), new()  # coef = A * 1[active]: dJ/dlog q(x) per unit dJ/dA
        cost, masses = (new(), new()) if want_cost else (None, None)
        keep = None if stops is None or not want_cost else stops_keep(stops, vocab, dtype)
        q_all = torch.empty((rows, vocab), dtype=dtype, device=logits.device) if keep_q else None
        for lo in range(0, rows, chunk_rows):
            hi = min(lo + chunk_rows, rows)
            idx = ids[lo:hi].unsqueeze(-1)
            q, work, p, logp = _q_and_p(
                logits[lo:hi],
                target[lo:hi],
                temperature,
                target_is_probs,
                dtype,
                None if q_all is None else q_all[lo:hi],
            )
            # work: log q until reused below
            _, _, acc[lo:hi], coef[lo:hi] = _acceptance_terms(work, p, logp, idx, tiny)
            if not want_cost:
                continue
            assert cost is not None and masses is not None
            # the reference's (p * keep).sum(-1) and (gap * keep).sum(-1), bit for bit
            mass = p.sum(-1) if keep is None else torch.mul(p, keep, out=work).sum(-1)
            gap = torch.sub(p, q, out=work).clamp_min_(0)
            if keep is not None:
                gap.index_fill_(1, stops, 0.0)  # == gap * keep: gap is finite
            mass = mass.clamp_min(tiny)
            cost[lo:hi] = gap.sum(-1) / mass
            masses[lo:hi] = mass
        ctx.temperature, ctx.chunk_rows, ctx.want_cost = temperature, chunk_rows, want_cost
        ctx.target_is_probs, ctx.stops = target_is_probs, stops
        ctx.save_for_backward(logits if q_all is None else q_all, target, ids, coef, masses)
        ctx.q_saved, ctx.logits_dtype = q_all is not None, logits.dtype
        return (acc, cost) if want_cost else (acc,)

    @staticmethod
    def backward(ctx, grad_acc: Tensor | None, grad_cost: Tensor | None = None):  # type: ignore[override]
        logits, target, ids, coef, masses = ctx.saved_tensors  # logits: q if q_saved
        rows, vocab = logits.shape
        dtype, temp = coef.dtype, ctx.temperature
        tiny = torch.finfo(dtype).tiny
        grad = torch.empty((rows, vocab), dtype=ctx.logits_dtype, device=logits.device)
        # dJ/dlog q(x), and below dJ/dq, with d(z / T)/dz = 1 / T folded in (no [.., V] pass)
        g_l = torch.zeros_like(coef) if grad_acc is None else grad_acc.to(dtype) * coef / temp
        use_cost = ctx.want_cost and grad_cost is not None
        direct = grad.dtype == dtype  # else: computed in `dtype`, then cast into `grad`
        for lo in range(0, rows, ctx.chunk_rows):
            hi = min(lo + ctx.chunk_rows, rows)
            if ctx.q_saved:
                q, g = logits[lo:hi], torch.empty_like(logits[lo:hi])
                p = _p(target[lo:hi], temp, ctx.target_is_probs, dtype)[0]
            else:
                q, g, p, _ = _q_and_p(
                    logits[lo:hi], target[lo:hi], temp, ctx.target_is_probs, dtype
                )
            gl = g_l[lo:hi]
            out = grad[lo:hi] if direct else g
            if use_cost:  # g = dJ/dq = -gc / M * 1[p - q >= 0, v not in S]
                # divided step by step: M T underflows to 0 when M is clamped to `tiny` and
                # T < 1 (flushed denormals, `threads.flush_denormals`), and -0 / 0 is NaN
                m = masses[lo:hi]
                scale = -grad_cost[lo:hi].to(dtype) / m / temp
                # M clamped (no target mass outside S): c = 0 for every q, so dc/dq = 0
                scale = torch.where(m > tiny, scale, 0.0).unsqueeze(-1)
                g.copy_(torch.ge(p, q)).mul_(scale)  # p >= q <=> p - q >= 0
                if ctx.stops is not None:
                    g.index_fill_(1, ctx.stops, 0.0)
                dot = (q * g).sum(-1)  # <q, dJ/dq>
                torch.mul(g.sub_((dot + gl).unsqueeze(-1)), q, out=out)
            else:
                torch.mul(q, -gl.unsqueeze(-1), out=out)
            out.scatter_add_(1, ids[lo:hi].unsqueeze(-1), gl.unsqueeze(-1))
            if not direct:
                grad[lo:hi] = out
        return grad, None, None, None, None, None, None, None, None


def stops_keep(stops: Tensor, vocab: int, dtype: torch.dtype) -> Tensor:
    """`[V]` 1.0 outside the stop set, 0.0 on it (the reference's `keep` as a factor)."""
    keep = torch.ones(vocab, dtype=dtype, device=stops.device)
    return keep.index_fill_(0, stops, 0.0)


def fused_sampling_acceptance(
    logits: Tensor,
    target: Tensor,
    ids: Tensor,
    *,
    temperature: float,
    target_is_probs: bool,
    stops: Tensor | None,
    want_cost: bool,
    chunk_rows: int,
) -> tuple[Tensor, ...]:
    """`(A, c_tv)` (or `(A,)`) for `[N, V]` logits, target and `[N]` ids, `chunk_rows`
    rows of `[.., V]` work at a time; `c_tv` before the stop-token zeroing and the
    clamp at 1 that `acceptance_and_cost` applies. The target gets no gradient."""
    # keep q (instead of the logits) for backward when backward will run and q is no
    # bigger than the logits: no recomputation, and the same memory (module docstring)
    keep_q = (
        torch.is_grad_enabled()
        and logits.requires_grad
        and logits.dtype == torch.promote_types(logits.dtype, torch.float32)
    )
    return _FusedSampling.apply(
        logits,
        target.detach(),
        ids,
        temperature,
        target_is_probs,
        stops,
        want_cost,
        chunk_rows,
        keep_q,
    )


@torch.no_grad()
def scores_with_gradient_moments(
    logits: Tensor,
    target: Tensor,
    ids: Tensor,
    *,
    temperature: float,
    target_is_probs: bool,
    stops: Tensor | None,
    chunk_rows: int,
    target_index: Tensor | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor, Tensor]:
    """`(A [N], c [N], moments [N, 3])` without gradient: A and the TV cost as
    `fused_sampling_acceptance` computes them (c before the stop-token zeroing and the
    clamp), and per row `||dA/dz||^2`, `||dc/dz||^2` and `<dA/dz, dc/dz>`, z the logits,
    in one pass over the vocabulary (the `gradient` sampler's scoring pass).

    Why: with the TD terms the moments give the norm of each proposal's share of the EDR
    gradient in logit space, `||omega (dc/dz + td dA/dz)||`, which the `gradient`
    round-start sampler uses as PPS sizes (`edr.round_starts.gradient_sizes`). From the
    closed forms of the backward above, with G = 1[p >= q, v not in S], s = <q, G>,
    Q = <q, q>, Q_G = <q^2, G>, a = A 1[log q_x <= log p_x], M the mass outside S:
    dA/dz = a (e_x - q) / T and dc/dz = -q (G - s) / (M T), so
    `||dA/dz||^2 = a^2 (1 - 2 q_x + Q) / T^2`, `||dc/dz||^2 = ((1 - 2 s) Q_G + s^2 Q) /
    (M T)^2` and `<dA/dz, dc/dz> = -a (q_x (G_x - s) - Q_G + s Q) / (M T^2)`. G is taken
    as `(1 + sign(p - q)) / 2` (float passes; boolean masks cost several times more on
    CPU), which is 1/2 only where p = q exactly: a tie changes the sizes, never the
    estimate's mean. `target_index [N]`: row i's target is `target[target_index[i]]` (the
    distinct rows, read a chunk at a time instead of a `[N, V]` copy). `backend`: "auto"
    sums a CPU probability target's rows in one compiled read each (`vocab_sums`), "torch"
    with tensor ops (what other devices and a target given as logits run)."""
    if backend not in ("auto", "torch"):
        raise ValueError(f"backend must be 'auto' or 'torch', got {backend!r}")
    dtype = torch.promote_types(logits.dtype, torch.float32)
    rows, vocab = logits.shape
    tiny = torch.finfo(dtype).tiny
    device = logits.device
    t = temperature
    # per row: M, sum_{v not in S} [p - q]_+, s, Q, Q_G (`vocab_sums`' columns)
    sums = torch.empty((rows, 5), dtype=torch.float64 if device.type == "cpu" else dtype,
                       device=device)  # fmt: skip
    logq_x, p_x, logp_x = (torch.empty(rows, dtype=dtype, device=device) for _ in range(3))
    keep = None if stops is None else stops_keep(stops, vocab, dtype)
    compiled = backend == "auto" and target_is_probs and device.type == "cpu"
    if compiled:  # one compiled read of q and p per row
        # lazy: importing it loads numba and its compiled kernel (seconds)
        from blockdraft.objectives.edr import vocab_sums

        table = target.detach().to(dtype).contiguous()
        index = torch.arange(rows, device=device) if target_index is None else target_index
        index_np = index.contiguous().numpy()
        keep_np = (torch.ones(vocab, dtype=dtype) if keep is None else keep).numpy()
        p_x = table[index, ids]
        logp_x = p_x.clamp_min(tiny).log()
    for lo in range(0, rows, chunk_rows):
        hi = min(lo + chunk_rows, rows)
        idx = ids[lo:hi].unsqueeze(-1)
        if compiled:
            z = logits[lo:hi].detach().to(dtype)
            e, m, total = _shifted_exp(z, t)
            logq_x[lo:hi] = _log_q_at(z, m, total, idx, t).squeeze(-1)
            vocab_sums.acceptance_sums(
                e.numpy(), total.squeeze(-1).numpy(), table.numpy(), index_np[lo:hi], keep_np,
                sums[lo:hi].numpy(),
            )  # fmt: skip
            continue
        if target_index is None:
            rows_p = target[lo:hi]
        else:  # (index_select: advanced indexing takes several times longer on CPU)
            rows_p = target.index_select(0, target_index[lo:hi])
        if target_is_probs:  # one exp pass (q = e / sum e), log q(x) from the logit
            z = logits[lo:hi].to(dtype)
            e, m, total = _shifted_exp(z, t)
            q = e.div_(total)
            logq_x[lo:hi] = _log_q_at(z, m, total, idx, t).squeeze(-1)
            p = rows_p.to(dtype)
            p_x[lo:hi] = p.gather(-1, idx).squeeze(-1)
            logp_x[lo:hi] = p_x[lo:hi].clamp_min(tiny).log()
            work = torch.empty_like(q)
        else:
            q, work, p, logp = _q_and_p(logits[lo:hi], rows_p, t, target_is_probs, dtype)
            logq_x[lo:hi], p_x[lo:hi], *_ = _acceptance_terms(work, p, logp, idx, tiny)
            logp_x[lo:hi] = logp.gather(-1, idx).squeeze(-1)
        gap = torch.sub(p, q, out=work)  # log q's memory (if any) is free now
        # M = <p, keep>: one read of p, exactly 0 where all of p is on S (no copy of p)
        sums[lo:hi, 0] = p.sum(-1) if keep is None else torch.mv(p, keep)
        if stops is not None:
            gap.index_fill_(1, stops, 0.0)  # outside S only (the reference's gap * keep)
        sums[lo:hi, 1] = gap.clamp_min(0).sum(-1)
        sign = gap.sign_()  # 2 G - 1
        if stops is not None:
            sign.index_fill_(1, stops, -1.0)  # G = 0 on S
        qs = sign.mul_(q)  # q (2 G - 1) (sums, not einsum: its batched dot runs as a slow bmm)
        big_q = torch.linalg.vector_norm(q, dim=-1) ** 2
        sums[lo:hi, 2] = (q.sum(-1) + qs.sum(-1)) / 2
        sums[lo:hi, 3] = big_q
        sums[lo:hi, 4] = (big_q + qs.mul_(q).sum(-1)) / 2  # qs now holds q^2 (2 G - 1)
    mass, over, s, big_q, q_g = sums.to(dtype).unbind(-1)
    acc, a = _acceptance_at(logq_x, logp_x)
    q_x = logq_x.exp()
    g_x = (p_x >= q_x).to(dtype)
    if stops is not None:
        g_x = g_x * (~torch.isin(ids, stops)).to(dtype)
    live = mass > tiny  # else no target mass outside S: c = 0 for every q, dc/dz = 0
    mass = mass.clamp_min(tiny)
    moments = _gradient_moments(a, q_x, g_x, s, big_q, q_g, mass, live, t)
    return acc, over / mass, moments


def _gradient_moments(a, q_x, g_x, s, big_q, q_g, mass, live, t) -> Tensor:
    """`[N, 3]` `||dA/dz||^2`, `||dc/dz||^2`, `<dA/dz, dc/dz>` from the per-row terms of
    `scores_with_gradient_moments`' closed forms (M clamped at `tiny`; dc/dz = 0 off
    `live`)."""
    out = torch.empty((*a.shape, 3), dtype=a.dtype, device=a.device)
    out[..., 0] = (a / t) ** 2 * (1 - 2 * q_x + big_q)
    # divided step by step: (M T)^2 underflows to 0 when M is clamped to `tiny` (all
    # target mass on stop tokens), where the numerators are 0
    # (the rounding of s and Q_G, ~1e-8 where they are 0, over M^2 = tiny^2 would be inf)
    dc2 = ((1 - 2 * s) * q_g + s**2 * big_q) / mass / mass / t**2
    da_dc = -a * (q_x * (g_x - s) - q_g + s * big_q) / mass / t**2
    out[..., 1] = torch.where(live, dc2, 0.0)
    out[..., 2] = torch.where(live, da_dc, 0.0)
    return out


def candidate_scores(
    cand_logits: Tensor,
    cand_columns: Tensor,
    p_rows: Tensor,
    p_index: Tensor,
    ids: Tensor,
    *,
    temperature: float,
    stops: Tensor | None,
    moments: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """`(A [N], c [N], moments [N, 3] or None)` of proposals whose distribution lives on k
    candidate columns: the sampling mode's values as `acceptance_and_cost` returns them (c
    clamped at 1, 0 at a stop label) and `scores_with_gradient_moments`' moments (only the
    first at a stop label, as the scoring pass keeps them, never differentiated). A and c
    carry autograd's gradient into `cand_logits` (the fused kernel's conventions at ties).

    Why: a DFlash2 drafter's q is its selector's softmax over the top-k unary candidates
    (-inf elsewhere), so every vocabulary sum of those kernels has k live terms plus one
    number per target row, its mass outside the stop set M = sum_{v not in S} p_v: with C
    the candidates, `sum_{v not in S} [p_v - q_v]_+ = M - sum_{c in C \\ S} min(p_c, q_c)`,
    and s, Q, Q_G sum q over C only. EDR's no-grad scoring pass then reads `[N, k]` numbers
    instead of several `[N, V]` passes. `cand_logits [N, k]` and `cand_columns [N, k]` (the
    columns of `p_rows`), `p_rows [R, W]` the target's distinct probability rows and
    `p_index [N]` each proposal's row, `ids [N]` the labels' columns."""
    dtype = torch.promote_types(cand_logits.dtype, torch.float32)
    z = cand_logits.to(dtype)
    logq = torch.log_softmax(z if temperature == 1 else z / temperature, dim=-1)
    q = logq.exp()
    hit = cand_columns == ids.unsqueeze(-1)  # candidates are distinct: at most one hit
    at = hit.to(torch.uint8).argmax(-1, keepdim=True)
    logq_x = torch.where(hit.any(-1), logq.gather(-1, at).squeeze(-1), float("-inf"))
    big_q = (q * q).sum(-1) if moments else None
    return _scores_on_columns(
        q, cand_columns, logq_x, big_q, p_rows, p_index, ids, temperature, stops, moments
    )


def support_scores(
    logits: Tensor,
    support: Tensor,
    p_rows: Tensor,
    p_index: Tensor,
    ids: Tensor,
    *,
    temperature: float,
    stops: Tensor | None,
    moments: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """`candidate_scores`' `(A, c, moments or None)` for a drafter whose q covers the
    vocabulary (`logits [N, W]`) against target rows that live on few columns: `support
    [R, k]` holds every column where `p_rows [R, W]` is non-zero (a top-k sampling target:
    k of them, plus a draft space's two mass columns). With autograd on, A and c carry
    their gradient into `logits` (no moments then: they are the no-grad scoring pass's).

    Why: off the target's support p = 0, so `[p - q]_+` and `q G` vanish there and the
    same `[N, k]` formulas hold with C = the support; only q's normaliser and Q = <q, q>
    need the whole row: one exp pass and three reductions instead of the several `[N, W]`
    passes of `scores_with_gradient_moments` or `fused_sampling_acceptance`, and no dense
    copy of the target rows (docs/methods.md)."""
    columns = support[p_index]
    if torch.is_grad_enabled() and logits.requires_grad:
        if moments:
            raise ValueError("moments are computed without gradient (the scoring pass)")
        at = torch.cat([ids.unsqueeze(-1), columns], dim=-1)
        logq = _LogSoftmaxAt.apply(logits, at, temperature)
        return _scores_on_columns(
            logq[:, 1:].exp(), columns, logq[:, 0], None, p_rows, p_index, ids, temperature,
            stops, False,
        )  # fmt: skip
    with torch.no_grad():
        z = logits.to(torch.promote_types(logits.dtype, torch.float32))
        e, m, total = _shifted_exp(z, temperature)
        q = e.gather(-1, columns) / total
        logq_x = _log_q_at(z, m, total, ids.unsqueeze(-1), temperature).squeeze(-1)
        big_q = None
        if moments:
            big_q = (torch.linalg.vector_norm(e, dim=-1) / total.squeeze(-1)) ** 2
        return _scores_on_columns(
            q, columns, logq_x, big_q, p_rows, p_index, ids, temperature, stops, moments
        )


def _shifted_exp(z: Tensor, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """`(e, m, total)`: `e = exp((z - m) / T) <= 1` with `m` the row max (0 where a row
    is all -inf: no inf - inf) and `total = sum(e)` `[N, 1]`; one exp pass, `q = e /
    total`."""
    m = z.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, 0.0)
    e = z - m
    if temperature != 1:
        e.mul_(1 / temperature)
    e.exp_()
    return e, m, e.sum(-1, keepdim=True)


def _log_q_at(z: Tensor, m: Tensor, total: Tensor, columns: Tensor, temperature: float) -> Tensor:
    """`log q` at `columns [N, c]` from `_shifted_exp`'s `m` and `total`: from the logit,
    not `log e`, which underflows where q < ~1e-38."""
    return (z.gather(-1, columns) - m) / temperature - total.log()


class _LogSoftmaxAt(torch.autograd.Function):
    """`log softmax(z / T)` at `columns [N, c]` of each row, `z [N, W]`: the forward keeps
    q for the backward, `dz = (g scattered at the columns - q sum(g)) / T`, one pass."""

    @staticmethod
    def forward(ctx, z: Tensor, columns: Tensor, temperature: float) -> Tensor:  # type: ignore[override]
        x = z.to(torch.promote_types(z.dtype, torch.float32))
        e, m, total = _shifted_exp(x, temperature)
        out = _log_q_at(x, m, total, columns, temperature)
        q = e.div_(total)
        ctx.save_for_backward(q, columns)
        ctx.temperature, ctx.z_dtype = temperature, z.dtype
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        q, columns = ctx.saved_tensors
        g = grad.to(q.dtype) / ctx.temperature
        dz = torch.mul(q, -g.sum(-1, keepdim=True))
        dz.scatter_add_(-1, columns, g)
        return dz.to(ctx.z_dtype), None, None


def target_support(p_rows: Tensor, most: int) -> Tensor | None:
    """`[R, k]` columns that hold every non-zero of `p_rows [R, W]` (k <= `most`; columns
    where p = 0 may fill a row up), or None when some row has more than `most` non-zeros."""
    if p_rows.shape[0] == 0 or p_rows.shape[-1] <= most:
        return None
    # counted in float32: exact below 2^24, and a boolean sum is far slower on CPU
    k = int((p_rows > 0).sum(-1, dtype=torch.float32).max())
    if k > most:
        return None
    return torch.topk(p_rows, max(k, 1), dim=-1).indices


def _scores_on_columns(q, columns, logq_x, big_q, p_rows, p_index, ids, t, stops, moments):
    """A, c (and moments) from q on `columns [N, k]`, which hold all of q's mass or all of
    p's (`candidate_scores`, `support_scores`): `sum_{v not in S} [p - q]_+ = M -
    sum_{C \\ S} min(p, q)` either way; log q(x) and Q = <q, q> come from the caller."""
    dtype = q.dtype
    tiny = torch.finfo(dtype).tiny
    p = p_rows.to(dtype)
    p_c = p[p_index.unsqueeze(-1), columns]
    p_x = p[p_index, ids]
    acc, a = _acceptance_at(logq_x, p_x.clamp_min(tiny).log())
    # M of the distinct rows these proposals read (one pass over those rows only)
    rows, inverse = torch.unique(p_index, return_inverse=True)
    read = p.index_select(0, rows)
    row_mass = read.sum(-1)
    if stops is not None and stops.numel():
        row_mass = row_mass - read.index_select(1, stops).sum(-1)
        on_stop, x_stop = torch.isin(columns, stops), torch.isin(ids, stops)
    else:
        on_stop = torch.zeros_like(columns, dtype=torch.bool)
        x_stop = torch.zeros_like(ids, dtype=torch.bool)
    true_mass = row_mass[inverse]
    mass = true_mass.clamp_min(tiny)
    overlap = torch.where(on_stop, 0.0, torch.minimum(p_c, q)).sum(-1)
    cost = (true_mass - overlap).clamp_min(0) / mass
    cost = torch.where(x_stop, 0.0, cost.clamp(max=1.0))
    if not moments:
        return acc, cost, None
    with torch.no_grad():
        live = true_mass > tiny
        q_x = logq_x.exp()
        g_x = ((p_x >= q_x) & ~x_stop).to(dtype)
        sign = torch.where(on_stop, -1.0, torch.sign(p_c - q))  # 2 G - 1 on C, G = 0 off it
        qs = sign * q
        s = ((q + qs) / 2).sum(-1)
        q_g = ((q * q + qs * q) / 2).sum(-1)
        out = _gradient_moments(a, q_x, g_x, s, big_q, q_g, mass, live & ~x_stop, t)
    return acc, cost, out


def sampling_scores_and_moments(
    logits: Tensor,
    p: Tensor,
    ids: Tensor,
    *,
    temperature: float,
    stop_token_ids: Sequence[int] = (),
    p_index: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """`(A, c, moments [..., 3])` of every proposal `ids [...]` against target
    probabilities `p`: `acceptance_and_cost`'s sampling values (c zeroed at stop tokens
    and clamped at 1, as it does) and the logit-gradient moments of
    `scores_with_gradient_moments`, in one pass over the vocabulary. `p_index`: proposal
    i's target row is `p[p_index[i]]` (distinct rows), else `p` is laid out like `logits`."""
    vocab = logits.shape[-1]
    stops = None
    if len(stop_token_ids):
        stops = torch.as_tensor(list(stop_token_ids), dtype=torch.long, device=logits.device)
    acc, cost, moments = scores_with_gradient_moments(
        logits.reshape(-1, vocab),
        p.reshape(-1, vocab),
        ids.reshape(-1),
        temperature=temperature,
        target_is_probs=True,
        stops=stops,
        chunk_rows=fused_chunk_rows(None, vocab, logits.device),
        target_index=None if p_index is None else p_index.reshape(-1),
    )
    acc, cost = acc.view(ids.shape), cost.view(ids.shape).clamp(max=1.0)
    moments = moments.view(*ids.shape, 3)
    if stops is not None:
        stop = torch.isin(ids, stops)
        cost = torch.where(stop, torch.zeros((), dtype=cost.dtype), cost)
        # c is 0 at a stop label whatever the logits: its gradient moments are 0 there too
        keep = torch.tensor([1.0, 0.0, 0.0], dtype=moments.dtype, device=moments.device)
        moments = torch.where(stop.unsqueeze(-1), moments * keep, moments)
    return acc, cost, moments
