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
boundary). Forward keeps `q` and the boolean mask `1[p >= q, v not in S]` (5 bytes per
element in float32; the checkpointed reference keeps the logits and `p` alive, 8), so the
drafter's logits and the target probabilities can be freed after the forward. No
gradient flows into the target: callers whose target requires grad use the reference.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


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
        save: bool,
    ) -> tuple[Tensor, ...]:
        dtype = torch.promote_types(logits.dtype, torch.float32)
        rows, vocab = logits.shape
        tiny = torch.finfo(dtype).tiny
        # what backward needs is kept whole; without autograd, one chunk's buffers at a time
        q_all = torch.empty((rows if save else 0, vocab), dtype=dtype, device=logits.device)
        mask = (
            torch.empty((rows, vocab), dtype=torch.bool, device=logits.device)
            if want_cost and save
            else None
        )
        acc = torch.empty(rows, dtype=dtype, device=logits.device)
        coef = torch.empty(rows, dtype=dtype, device=logits.device)  # A * 1[active]
        cost = torch.empty(rows, dtype=dtype, device=logits.device) if want_cost else None
        masses = torch.empty(rows, dtype=dtype, device=logits.device) if want_cost else None
        keep = None if stops is None or not want_cost else stops_keep(stops, vocab, dtype)
        for lo in range(0, rows, chunk_rows):
            hi = min(lo + chunk_rows, rows)
            idx = ids[lo:hi].unsqueeze(-1)
            q = (
                q_all[lo:hi]
                if save
                else torch.empty((hi - lo, vocab), dtype=dtype, device=logits.device)
            )
            torch.div(logits[lo:hi].to(dtype), temperature, out=q)
            work = torch.log_softmax(q, dim=-1)  # the reference's log q, bit for bit
            logq_x = work.gather(-1, idx).squeeze(-1)
            torch.exp(work, out=q)
            if target_is_probs:
                p = target[lo:hi].to(dtype)
                logp_x = p.gather(-1, idx).squeeze(-1).clamp_min(tiny).log()
            else:
                logp = torch.log_softmax(target[lo:hi].to(dtype) / temperature, dim=-1)
                logp_x = logp.gather(-1, idx).squeeze(-1)
                p = logp.exp_()
            diff = logq_x - logp_x
            a = torch.exp(diff.clamp(max=0.0))
            acc[lo:hi] = a
            coef[lo:hi] = torch.where(diff <= 0, a, torch.zeros((), dtype=dtype, device=a.device))
            if not want_cost:
                continue
            assert cost is not None and masses is not None
            if mask is not None:  # where autograd's clamp_min(p - q, 0) passes gradient
                m = torch.ge(p, q, out=mask[lo:hi])
                if keep is not None:
                    m.index_fill_(1, stops, False)
            # the reference's (p * keep).sum(-1), bit for bit
            mass = p.sum(-1) if keep is None else torch.mul(p, keep, out=work).sum(-1)
            gap = torch.sub(p, q, out=work).clamp_min_(0)
            if keep is not None:
                gap.index_fill_(1, stops, 0.0)  # == gap * keep: gap is finite
            tv = gap.sum(-1)
            mass = mass.clamp_min(tiny)
            cost[lo:hi] = tv / mass
            masses[lo:hi] = mass
        ctx.temperature, ctx.chunk_rows, ctx.logits_dtype = temperature, chunk_rows, logits.dtype
        ctx.want_cost = want_cost
        if want_cost:
            ctx.save_for_backward(q_all, mask, coef, masses, ids)
            return acc, cost
        ctx.save_for_backward(q_all, coef, ids)
        return (acc,)

    @staticmethod
    def backward(ctx, grad_acc: Tensor | None, grad_cost: Tensor | None = None):  # type: ignore[override]
        if ctx.want_cost:
            q_all, mask, coef, masses, ids = ctx.saved_tensors
        else:
            q_all, coef, ids = ctx.saved_tensors
            mask = masses = None
        rows, vocab = q_all.shape
        dtype = q_all.dtype
        grad = torch.empty((rows, vocab), dtype=dtype, device=q_all.device)
        g_l = (
            torch.zeros_like(coef) if grad_acc is None else grad_acc.to(dtype) * coef
        )  # dJ/dlog q(x)
        use_cost = ctx.want_cost and grad_cost is not None
        for lo in range(0, rows, ctx.chunk_rows):
            hi = min(lo + ctx.chunk_rows, rows)
            q, g, gl = q_all[lo:hi], grad[lo:hi], g_l[lo:hi]
            if use_cost:
                g.copy_(mask[lo:hi])  # 1[p >= q, v not in S]
                g.mul_((-grad_cost[lo:hi].to(dtype) / masses[lo:hi]).unsqueeze(-1))
                dot = torch.linalg.vecdot(q, g)  # <q, dJ/dq>
                g.sub_((dot + gl).unsqueeze(-1)).mul_(q)
            else:
                torch.mul(q, -gl.unsqueeze(-1), out=g)
            g.scatter_add_(1, ids[lo:hi].unsqueeze(-1), gl.unsqueeze(-1))
        grad.div_(ctx.temperature)
        return grad.to(ctx.logits_dtype), None, None, None, None, None, None, None, None


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
    save = torch.is_grad_enabled() and logits.requires_grad
    return _FusedSampling.apply(
        logits,
        target.detach(),
        ids,
        temperature,
        target_is_probs,
        stops,
        want_cost,
        chunk_rows,
        save,
    )
