"""Sampling-mode acceptance `A = min(1, q(x)/p(x))` and TV cost with an analytic backward.

Same values and gradients as the straightforward autograd formula in `edr_acceptance`
(`_RowsFn`, kept as the reference the tests compare against), computed with fewer passes
over the `[rows, V]` tensors. Why it is worth a hand-written backward: the reference runs
each row chunk under `torch.utils.checkpoint`, so backward recomputes the whole forward
(temperature division, log-softmax, exp, `p - q`, clamp, stop mask, two sums) and then
back-propagates through every one of those ops; the sampling-EDR step spent more time
there than in any other vocabulary-sized work. The gradient has a closed form: with
`q = softmax(z / T)`, `c = sum_{v not in S} [p_v - q_v]_+ / M` (M = target mass outside
the stop set S) and `A = exp(min(0, log q_x - log p_x))`,

    dc/dq_v = -1[p_v >= q_v, v not in S] / M  =: g_v
    dJ/dz   = (q * (gc * g - <q, gc * g> - gA * a) + gA * a * onehot_x) / T,
              a = A * 1[log q_x <= log p_x]

(the indicator conventions are those of autograd's `clamp`: the gradient passes at the
boundary). Memory stays that of the reference (`training/plan.py` counts the logits, their
gradient and `p`): autograd keeps `p`, per-row scalars and either `q` (float32/float64
logits: `q` is no bigger than the logits, which the caller then frees, so no softmax is
recomputed) or the logits (bf16/fp16 logits: backward recomputes `q` one row chunk at a
time, a softmax rather than the whole formula and its autograd graph). No gradient
flows into the target: a target that requires grad goes through the reference.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


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
    q = torch.div(logits.to(dtype), temperature, out=out)
    logq = torch.log_softmax(q, dim=-1)
    torch.exp(logq, out=q)
    return (q, logq, *_p(target, temperature, target_is_probs, dtype))


def _p(
    target: Tensor, temperature: float, target_is_probs: bool, dtype: torch.dtype
) -> tuple[Tensor, Tensor | None]:
    """`(p, log p or None)` of one row chunk, as the reference computes them."""
    if target_is_probs:
        return target.to(dtype), None
    logp = torch.log_softmax(target.to(dtype) / temperature, dim=-1)
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
    diff = logq_x - logp_x
    acc = torch.exp(diff.clamp(max=0.0))
    zero = torch.zeros((), dtype=acc.dtype, device=acc.device)
    return logq_x, p_x, acc, torch.where(diff <= 0, acc, zero)


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
                scale = (-grad_cost[lo:hi].to(dtype) / (masses[lo:hi] * temp)).unsqueeze(-1)
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
) -> tuple[Tensor, Tensor, Tensor]:
    """`(A [N], c [N], moments [N, 3])` without gradient: A and the TV cost as
    `fused_sampling_acceptance` computes them (c before the stop-token zeroing and the
    clamp), and per row `||dA/dz||^2`, `||dc/dz||^2` and `<dA/dz, dc/dz>`, z the logits,
    in one pass over the vocabulary (the `gradient` sampler's scoring pass).

    Why: with the TD terms the moments give the norm of each proposal's share of the EDR
    gradient in logit space, `||omega (dc/dz + td dA/dz)||`, which the `gradient`
    round-start sampler uses as PPS sizes (`edr_sampling.gradient_sizes`). From the
    closed forms of the backward above, with G = 1[p >= q, v not in S], s = <q, G>,
    Q = <q, q>, Q_G = <q^2, G>, a = A 1[log q_x <= log p_x], M the mass outside S:
    dA/dz = a (e_x - q) / T and dc/dz = -q (G - s) / (M T), so
    `||dA/dz||^2 = a^2 (1 - 2 q_x + Q) / T^2`, `||dc/dz||^2 = ((1 - 2 s) Q_G + s^2 Q) /
    (M T)^2` and `<dA/dz, dc/dz> = -a (q_x (G_x - s) - Q_G + s Q) / (M T^2)`. G is taken
    as `(1 + sign(p - q)) / 2` (float passes; boolean masks cost several times more on
    CPU), which is 1/2 only where p = q exactly: a tie changes the sizes, never the
    estimate's mean."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    rows, vocab = logits.shape
    tiny = torch.finfo(dtype).tiny
    acc, cost = (torch.empty(rows, dtype=dtype, device=logits.device) for _ in range(2))
    out = torch.empty((rows, 3), dtype=dtype, device=logits.device)
    t = temperature
    for lo in range(0, rows, chunk_rows):
        hi = min(lo + chunk_rows, rows)
        idx = ids[lo:hi].unsqueeze(-1)
        q, logq, p, logp = _q_and_p(logits[lo:hi], target[lo:hi], t, target_is_probs, dtype)
        logq_x, p_x, acc[lo:hi], a = _acceptance_terms(logq, p, logp, idx, tiny)
        q_x = logq_x.exp()
        g_x = (p_x >= q_x).to(dtype)
        gap = torch.sub(p, q, out=logq)  # logq's memory is free now
        if stops is not None:
            gap.index_fill_(1, stops, 0.0)  # outside S only (the reference's gap * keep)
            g_x = g_x * (~torch.isin(ids[lo:hi], stops)).to(dtype)
            p = p.index_fill(1, stops, 0.0)
        mass = p.sum(-1).clamp_min(tiny)
        cost[lo:hi] = gap.clamp_min(0).sum(-1) / mass
        sign = gap.sign_()  # 2 G - 1
        if stops is not None:
            sign.index_fill_(1, stops, -1.0)  # G = 0 on S
        qs = sign.mul_(q)  # q (2 G - 1) (sums, not einsum: its batched dot runs as a slow bmm)
        big_q = torch.linalg.vector_norm(q, dim=-1) ** 2
        s = (q.sum(-1) + qs.sum(-1)) / 2
        q_g = (big_q + qs.mul_(q).sum(-1)) / 2  # qs now holds q^2 (2 G - 1)
        out[lo:hi, 0] = (a / t) ** 2 * (1 - 2 * q_x + big_q)
        # divided step by step: (M T)^2 underflows to 0 when M is clamped to `tiny` (all
        # target mass on stop tokens), where the numerators are 0
        out[lo:hi, 1] = ((1 - 2 * s) * q_g + s**2 * big_q) / mass / mass / t**2
        out[lo:hi, 2] = -a * (q_x * (g_x - s) - q_g + s * big_q) / mass / t**2
    return acc, cost, out
