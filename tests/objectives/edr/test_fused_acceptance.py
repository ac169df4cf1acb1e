"""The fused sampling-mode acceptance/TV cost (`edr/acceptance.py`) against the straightforward
autograd formula (`acceptance_and_cost(..., fused=False)`) and an inline formula written
out here: values and gradients, float64, several chunkings, stop tokens, temperatures,
target as logits or as (top-k truncated) probabilities, both cost forms."""

from __future__ import annotations

import pytest
import torch

from blockdraft.objectives.edr import acceptance_and_cost

STOPS = (0, 5)


def _inputs(seed: int, shape=(3, 4), vocab: int = 11, truncate: bool = False):
    gen = torch.Generator().manual_seed(seed)
    draft = torch.randn(*shape, vocab, generator=gen, dtype=torch.float64) * 2.0
    target = torch.randn(*shape, vocab, generator=gen, dtype=torch.float64) * 2.0
    ids = torch.randint(vocab, shape, generator=gen)
    ids[0, 0] = STOPS[0]
    if truncate:  # processed target: top-4 per row, so p has exact zeros; ids in the support
        kth = target.topk(4, dim=-1).values[..., -1:]
        target = torch.softmax(target.masked_fill(target < kth, float("-inf")), -1)
        ids = torch.multinomial(target.reshape(-1, vocab), 1, generator=gen).view(shape)
    # upstream gradients of (A, c) so that both paths of the backward are exercised
    grads = torch.randn(2, *shape, generator=gen, dtype=torch.float64)
    return draft, target, ids, grads


def _inline(draft, target, ids, temperature, target_is_probs, stops, realised):
    """`min(1, q(x)/p(x))` and `sum_{v not in S} [p - q]_+ / sum_{v not in S} p`, whole
    tensors, plain autograd."""
    q = torch.softmax(draft / temperature, -1)
    p = target if target_is_probs else torch.softmax(target / temperature, -1)
    qx = q.gather(-1, ids[..., None])[..., 0]
    px = p.gather(-1, ids[..., None])[..., 0]
    acc = torch.clamp(qx / px, max=1.0)
    stop = torch.isin(ids, torch.tensor(stops))
    if realised:
        return acc, torch.where(stop, torch.zeros(()), 1 - acc)
    keep = torch.ones(draft.shape[-1], dtype=torch.float64)
    keep[list(stops)] = 0
    cost = ((p - q).clamp_min(0) * keep).sum(-1) / (p * keep).sum(-1)
    return acc, torch.where(stop, torch.zeros((), dtype=cost.dtype), cost.clamp(max=1.0))


def _value_and_grad(fn, draft, grads):
    draft = draft.clone().requires_grad_(True)
    acc, cost = fn(draft)
    ((acc * grads[0]).sum() + (cost * grads[1]).sum()).backward()
    return acc.detach(), cost.detach(), draft.grad


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("target_is_probs", [False, True])
@pytest.mark.parametrize("stops", [(), STOPS])
@pytest.mark.parametrize("cost_form", ["tv", "realised"])
@pytest.mark.parametrize("chunk_rows", [None, 1, 5])
def test_fused_equals_reference_values_and_gradients(
    temperature, target_is_probs, stops, cost_form, chunk_rows
) -> None:
    draft, target, ids, grads = _inputs(7, truncate=target_is_probs)

    def run(fused: bool):
        return lambda d: acceptance_and_cost(
            d,
            target,
            ids,
            temperature=temperature,
            target_is_probs=target_is_probs,
            stop_token_ids=stops,
            cost_form=cost_form,
            chunk_rows=chunk_rows,
            fused=fused,
        )

    fused = _value_and_grad(run(True), draft, grads)
    reference = _value_and_grad(run(False), draft, grads)
    inline = _value_and_grad(
        lambda d: _inline(d, target, ids, temperature, target_is_probs, stops, cost_form != "tv"),
        draft,
        grads,
    )
    for got, ref, alt in zip(fused, reference, inline, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(got, alt, rtol=1e-10, atol=1e-12)
    assert fused[2].abs().sum() > 0  # the comparison is not between two zero gradients


def test_fused_gradcheck() -> None:
    """Finite differences on the fused function itself (float64, both outputs)."""
    draft, target, ids, _ = _inputs(3, shape=(2, 3), vocab=6)

    def fn(d):
        return acceptance_and_cost(
            d, target, ids, temperature=0.8, stop_token_ids=(1,), chunk_rows=2, fused=True
        )

    assert torch.autograd.gradcheck(fn, (draft.clone().requires_grad_(True),))


def test_fused_float32_and_no_grad() -> None:
    """float32 logits: float32 outputs and gradient; without autograd the same values."""
    draft, target, ids, grads = _inputs(11, shape=(5, 3), vocab=40)
    d32, t32 = draft.float(), torch.softmax(target.float(), -1)

    def run(d, fused):
        return acceptance_and_cost(
            d, t32, ids, target_is_probs=True, temperature=0.7, stop_token_ids=STOPS, fused=fused
        )

    got = _value_and_grad(lambda d: run(d, True), d32, grads.float())
    ref = _value_and_grad(lambda d: run(d, False), d32, grads.float())
    assert got[2].dtype == torch.float32
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-7)
    with torch.no_grad():
        acc, cost = run(d32, True)
    torch.testing.assert_close(acc, got[0], rtol=0, atol=0)
    torch.testing.assert_close(cost, got[1], rtol=0, atol=0)


def test_target_with_gradient_uses_reference() -> None:
    """The fused path gives the target no gradient, so a target that requires grad goes
    through the autograd formula and still gets its gradient."""
    draft, target, ids, grads = _inputs(5)
    results = []
    for fn in (
        lambda d, t: acceptance_and_cost(d, t, ids, temperature=0.9, stop_token_ids=STOPS),
        lambda d, t: _inline(d, t, ids, 0.9, False, STOPS, realised=False),
    ):
        d, t = draft.clone().requires_grad_(True), target.clone().requires_grad_(True)
        acc, cost = fn(d, t)
        ((acc * grads[0]).sum() + (cost * grads[1]).sum()).backward()
        assert t.grad is not None
        results.append((acc.detach(), cost.detach(), d.grad, t.grad))
    for ours, ref in zip(*results, strict=True):
        torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)
    assert results[0][3].abs().sum() > 0


@pytest.mark.parametrize("target_is_probs", [False, True])
def test_backward_with_kept_q_equals_recomputed_q(target_is_probs: bool) -> None:
    """The two memory layouts of the fused backward (q kept from forward for float32/64
    logits, q recomputed from the logits for bf16/fp16) give the same gradient."""
    from blockdraft.objectives.edr.acceptance import _FusedSampling

    draft, target, ids, grads = _inputs(13, shape=(6, 2), vocab=9, truncate=target_is_probs)
    stops = torch.tensor([0, 5])
    results = []
    for keep_q in (True, False):
        d = draft.reshape(-1, 9).clone().requires_grad_(True)
        acc, cost = _FusedSampling.apply(
            d, target.reshape(-1, 9), ids.reshape(-1), 0.8, target_is_probs, stops, True, 4, keep_q
        )
        ((acc * grads[0].reshape(-1)).sum() + (cost * grads[1].reshape(-1)).sum()).backward()
        results.append((acc.detach(), cost.detach(), d.grad))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_match_reference(dtype: torch.dtype) -> None:
    """bf16/fp16 logits (recompute path): float32 outputs and a gradient in the logits'
    dtype, equal to the reference's up to that dtype's rounding."""
    draft, target, ids, grads = _inputs(17, shape=(5, 3), vocab=30, truncate=True)
    low, probs = draft.to(dtype), target.float()

    def run(d, fused):
        return acceptance_and_cost(
            d, probs, ids, target_is_probs=True, temperature=0.7, stop_token_ids=STOPS, fused=fused
        )

    got = _value_and_grad(lambda d: run(d, True), low, grads.float())
    ref = _value_and_grad(lambda d: run(d, False), low, grads.float())
    assert got[0].dtype == torch.float32 and got[2].dtype == dtype
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got[2].float(), ref[2].float(), rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize(
    ("target_is_probs", "backend"), [(True, "auto"), (True, "torch"), (False, "auto")]
)
@pytest.mark.parametrize("stops", [None, [2, 5]])
def test_scores_with_gradient_moments_equal_autograd_of_the_reference(
    target_is_probs, backend, stops
) -> None:
    """`scores_with_gradient_moments` against the straightforward formula (`_RowsFn`,
    unfused, no stop zeroing or clamp): A and c, and per row `||dA/dz||^2`, `||dc/dz||^2`
    and `<dA/dz, dc/dz>` against autograd (rows are independent, so the gradient of a sum
    over rows gives every row's own gradient). Float64, a temperature, a truncated target
    (one row with all its mass on a stop token); a probability target on CPU both through
    the compiled sums ("auto") and the tensor ops ("torch", what a GPU runs)."""
    from blockdraft.objectives.edr.acceptance import (
        _RowsFn,
        scores_with_gradient_moments,
        stops_keep,
    )

    g = torch.Generator().manual_seed(11)
    rows, vocab, temp = 13, 9, 0.7
    logits = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 2
    target_logits = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 2
    probs = torch.softmax(target_logits / temp, -1)
    probs = torch.where(probs < 0.03, torch.zeros_like(probs), probs)
    probs[6] = 0.0
    probs[6, 5] = 1.0
    probs = probs / probs.sum(-1, keepdim=True)
    target = probs if target_is_probs else target_logits
    ids = torch.multinomial(probs, 1, generator=g).squeeze(-1)
    stop_ids = None if stops is None else torch.tensor(stops)
    acc, cost, got = scores_with_gradient_moments(
        logits, target, ids, temperature=temp, target_is_probs=target_is_probs,
        stops=stop_ids, chunk_rows=4, backend=backend,
    )  # fmt: skip
    keep = None if stop_ids is None else stops_keep(stop_ids, vocab, torch.float64).bool()
    fn = _RowsFn("sampling", torch.float64, temp, target_is_probs, "tv", keep)
    x = logits.clone().requires_grad_(True)
    ref_acc, ref_cost = fn(x, target, ids)
    torch.testing.assert_close(acc, ref_acc.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cost, ref_cost.detach(), rtol=1e-12, atol=1e-12)
    (d_acc,) = torch.autograd.grad(ref_acc.sum(), x, retain_graph=True)
    (d_cost,) = torch.autograd.grad(ref_cost.sum(), x)
    expected = torch.stack(
        [(d_acc**2).sum(-1), (d_cost**2).sum(-1), (d_acc * d_cost).sum(-1)], dim=-1
    )
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    assert bool((expected[:, 0] > 0).any()) and bool((expected[:, 2] != 0).any())
    # the target as distinct rows and each proposal's index into them: the same numbers
    distinct, index = torch.unique(target, dim=0, return_inverse=True)
    shuffled = torch.randperm(distinct.shape[0], generator=g)
    rows_in, index_in = distinct[shuffled], torch.argsort(shuffled)[index]
    again = scores_with_gradient_moments(
        logits, rows_in, ids, temperature=temp, target_is_probs=target_is_probs,
        stops=stop_ids, chunk_rows=4, target_index=index_in, backend=backend,
    )  # fmt: skip
    for a, b in zip(again, (acc, cost, got), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_all_mass_on_stop_tokens_with_flushed_denormals(temperature) -> None:
    """A target that puts all its mass on a stop token (top-p keeps only EOS) has M = 0 outside
    the stop set, clamped to float32's `tiny`; training flushes denormals
    (`threads.flush_denormals`), so `tiny * T` at T < 1 is 0 and a backward that divides by
    `M T` gets -0 / 0 = NaN. The fused gradient stays finite and equals the reference."""
    gen = torch.Generator().manual_seed(4)
    vocab = 9
    draft = torch.randn(3, vocab, generator=gen)
    draft[2, 7:] = float("-inf")  # a draft space's mass columns: q = 0 exactly
    target = torch.softmax(torch.randn(3, vocab, generator=gen), -1)
    target[0] = 0.0
    target[0, 5] = 1.0  # all on the stop token
    target[2, :7] = 0.0
    target[2, 7:] = torch.tensor([0.25, 0.75])
    ids = torch.tensor([5, 2, 8])
    grads = torch.randn(2, 3, generator=gen)
    old = torch.set_flush_denormal(True)
    try:
        out = {
            fused: _value_and_grad(
                lambda d, fused=fused: acceptance_and_cost(
                    d,
                    target,
                    ids,
                    temperature=temperature,
                    target_is_probs=True,
                    stop_token_ids=(5,),
                    fused=fused,
                ),  # fmt: skip
                draft,
                grads,
            )
            for fused in (True, False)
        }
    finally:
        torch.set_flush_denormal(False)
    assert old  # the test means something only where denormals can be flushed
    assert torch.isfinite(out[True][2]).all()
    for got, ref in zip(out[True], out[False], strict=True):
        torch.testing.assert_close(got, ref)
    assert out[True][2][1].abs().sum() > 0


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_gradient_moments_where_all_mass_is_on_stop_tokens(backend) -> None:
    """float32 at Gemma-like widths, denormals flushed as in training: where the target's mass
    outside the stop set is 0, c is 0 for every q, so `||dc/dz||^2` and `<dA/dz, dc/dz>` are 0
    (the roundings of s and Q_G over M^2 = tiny^2 gave inf and 1e24 sizes); every moment of
    every row equals autograd's of the formula in float64."""
    from blockdraft.objectives.edr.acceptance import scores_with_gradient_moments

    gen = torch.Generator().manual_seed(5)
    rows, vocab, temp = 6, 4096, 0.7
    logits = torch.randn(rows, vocab, generator=gen)
    probs = torch.zeros(rows, vocab)
    probs[:3, 1] = 1.0  # all on the stop token 1
    probs[3:, :64] = torch.softmax(torch.randn(3, 64, generator=gen), -1)  # mass outside S
    ids = torch.tensor([1, 1, 1, 7, 9, 7])
    stops = torch.tensor([1, 106])
    old = torch.set_flush_denormal(True)
    try:
        _, _, got = scores_with_gradient_moments(
            logits, probs, ids, temperature=temp, target_is_probs=True, stops=stops,
            chunk_rows=2, backend=backend,
        )  # fmt: skip
    finally:
        torch.set_flush_denormal(False)
    assert old
    assert torch.isfinite(got).all()
    assert torch.equal(got[:3, 1:], torch.zeros(3, 2))
    x = logits.double().requires_grad_(True)
    p = probs.double()
    q = torch.softmax(x / temp, -1)
    at = torch.arange(rows)
    acc = torch.clamp(q[at, ids] / p[at, ids], max=1.0)
    keep = torch.ones(vocab, dtype=torch.float64).index_fill_(0, stops, 0.0)
    mass = (p * keep).sum(-1)
    cost = ((p - q).clamp_min(0) * keep).sum(-1) / mass.clamp_min(1e-300)
    cost = torch.where(mass > 0, cost, torch.zeros_like(cost))  # c = 0 for every q there
    (d_acc,) = torch.autograd.grad(acc.sum(), x, retain_graph=True)
    (d_cost,) = torch.autograd.grad(cost.sum(), x)
    want = torch.stack([(d_acc**2).sum(-1), (d_cost**2).sum(-1), (d_acc * d_cost).sum(-1)], dim=-1)
    torch.testing.assert_close(got.double(), want, rtol=1e-3, atol=1e-9)
    assert bool((want[3:, 1] > 1e-6).all())


def _dense_scores(x, p, ids, temperature, stops):
    """The whole-vocabulary formula in float64, differentiable in the logits `x` (-inf
    allowed): A = min(1, q_x / p_x), c = sum_{v not in S} [p_v - q_v]_+ / M (clamped at 1,
    0 at a stop label), and autograd's three logit-gradient moments (only the first at a
    stop label, as the scoring pass keeps them)."""
    n, vocab = x.shape
    q = torch.softmax(x / temperature, -1)
    at = torch.arange(n)
    acc = torch.clamp(q[at, ids] / p[at, ids], max=1.0)
    keep = torch.ones(vocab, dtype=torch.float64)
    if stops is not None:
        keep[stops] = 0.0
    mass = (p * keep).sum(-1)
    cost = ((p - q).clamp_min(0) * keep).sum(-1) / mass.clamp_min(1e-300)
    cost = torch.where(mass > 0, cost, torch.zeros_like(cost))
    (d_acc,) = torch.autograd.grad(acc.sum(), x, retain_graph=True)
    (d_cost,) = torch.autograd.grad(cost.sum(), x, retain_graph=True)
    d_acc, d_cost = d_acc.nan_to_num(0.0), d_cost.nan_to_num(0.0)  # -inf columns: no gradient
    moments = torch.stack([(d_acc**2).sum(-1), (d_cost**2).sum(-1), (d_acc * d_cost).sum(-1)], -1)
    stop = torch.isin(ids, torch.tensor(stops)) if stops else torch.zeros(n, dtype=torch.bool)
    cost = torch.where(stop, 0.0, cost.clamp(max=1.0))
    moments = torch.where(stop.unsqueeze(-1), moments * torch.tensor([1.0, 0.0, 0.0]), moments)
    return acc, cost, moments


def _sparse_target(gen, distinct, vocab, floor):
    """Distinct target rows with zeros (below `floor`), row 3 all on token 5 (a stop)."""
    p_rows = torch.softmax(torch.randn(distinct, vocab, generator=gen, dtype=torch.float64) * 2, -1)
    p_rows = torch.where(p_rows < floor, torch.zeros_like(p_rows), p_rows)
    p_rows[3] = 0.0
    p_rows[3, 5] = 1.0
    return p_rows / p_rows.sum(-1, keepdim=True)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("stops", [None, [2, 5]])
def test_candidate_scores_equal_autograd_of_the_dense_formula(temperature, stops) -> None:
    """`candidate_scores` (q on k candidate columns, -inf elsewhere: a DFlash2 selector's)
    against the whole-vocabulary formula (`_dense_scores`), values, moments and the gradient
    into the candidates' logits. Rows share target rows (`p_index`), labels fall outside
    the candidates, a candidate sits on a stop column, one target row has all its mass on
    a stop token."""
    from blockdraft.objectives.edr.acceptance import candidate_scores

    gen = torch.Generator().manual_seed(7)
    n, k, vocab, distinct = 40, 4, 11, 9
    p_rows = _sparse_target(gen, distinct, vocab, 0.02)
    p_index = torch.randint(0, distinct, (n,), generator=gen)
    cand = torch.stack([torch.randperm(vocab, generator=gen)[:k] for _ in range(n)])
    cand[0, 0] = 2  # a candidate on a stop column
    cand_logits = torch.randn(n, k, generator=gen, dtype=torch.float64) * 2
    ids = torch.multinomial(p_rows[p_index], 1, generator=gen).squeeze(-1)
    # labels among the candidates where the target can draw them, the rest mostly outside
    drawable = p_rows[p_index[:12], cand[:12, 1]] > 0
    ids[:12] = torch.where(drawable, cand[:12, 1], ids[:12])
    stop_t = None if stops is None else torch.tensor(stops)
    leaf = cand_logits.clone().requires_grad_(True)
    acc, cost, got = candidate_scores(
        leaf, cand, p_rows, p_index, ids, temperature=temperature, stops=stop_t, moments=True
    )
    w_acc, w_cost = torch.randn(2, n, generator=gen, dtype=torch.float64)
    (grad,) = torch.autograd.grad((w_acc * acc + w_cost * cost).sum(), leaf)

    dense = torch.full((n, vocab), float("-inf"), dtype=torch.float64)
    x = dense.scatter(-1, cand, cand_logits).requires_grad_(True)
    want_acc, want_cost, want = _dense_scores(x, p_rows[p_index], ids, temperature, stops)
    torch.testing.assert_close(acc.detach(), want_acc.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cost.detach(), want_cost.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # the gradient of a weighted sum into the candidates' logits (the gradient pass's)
    (dense_grad,) = torch.autograd.grad((w_acc * want_acc + w_cost * want_cost).sum(), x)
    torch.testing.assert_close(grad, dense_grad.gather(-1, cand), rtol=1e-10, atol=1e-12)
    assert bool((grad != 0).any()) and int(drawable.sum()) >= 4
    assert bool((want_acc > 0).any()) and bool((want_acc == 0).any())
    assert bool((want[:, 1] > 0).any()) and bool((want[:, 2] != 0).any())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("stops", [None, [2, 5]])
def test_support_scores_equal_the_dense_formula(temperature, stops) -> None:
    """`support_scores` (q over the whole vocabulary, p on a few columns: a top-k target)
    against the whole-vocabulary formula: A, c and moments; `target_support` finds every
    non-zero of p (rows with fewer fill up with zeros) and declines rows with more. Two
    columns hold -inf logits (a draft space's mass columns), a label falls on one."""
    from blockdraft.objectives.edr.acceptance import support_scores, target_support

    gen = torch.Generator().manual_seed(8)
    n, vocab, distinct = 40, 13, 9
    p_rows = _sparse_target(gen, distinct, vocab, 0.06)
    support = target_support(p_rows, most=8)
    nonzeros = int((p_rows > 0).sum(-1).max())
    assert support is not None and support.shape == (distinct, nonzeros) and nonzeros < vocab
    assert target_support(p_rows, most=nonzeros - 1) is None
    p_index = torch.randint(0, distinct, (n,), generator=gen)
    logits = torch.randn(n, vocab, generator=gen, dtype=torch.float64) * 2
    logits[:, -2:] = float("-inf")
    ids = torch.multinomial(p_rows[p_index], 1, generator=gen).squeeze(-1)
    p_rows[p_index[0], vocab - 1] += 0.5  # a label on a -inf column: A = 0
    p_rows[p_index[0]] /= p_rows[p_index[0]].sum()
    ids[0] = vocab - 1
    support = target_support(p_rows, most=8)
    stop_t = None if stops is None else torch.tensor(stops)
    acc, cost, got = support_scores(
        logits, support, p_rows, p_index, ids, temperature=temperature, stops=stop_t,
        moments=True,
    )  # fmt: skip
    x = logits.clone().requires_grad_(True)
    want_acc, want_cost, want = _dense_scores(x, p_rows[p_index], ids, temperature, stops)
    torch.testing.assert_close(acc, want_acc.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cost, want_cost.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert float(acc[0]) == 0.0 and bool((want_acc > 0).any())
    assert bool((want[:, 1] > 0).any()) and bool((want[:, 2] != 0).any())
    # with autograd on: the same A and c, and their gradient in the logits is autograd's
    # of the dense formula (weights on A and c as EDR's gradient pass gives them)
    z = logits.clone().requires_grad_(True)
    acc_g, cost_g, none = support_scores(
        z, support, p_rows, p_index, ids, temperature=temperature, stops=stop_t, moments=False
    )
    assert none is None
    torch.testing.assert_close(acc_g.detach(), want_acc.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cost_g.detach(), want_cost.detach(), rtol=1e-12, atol=1e-12)
    w_acc, w_cost = (
        torch.rand(n, generator=gen, dtype=torch.float64),
        -torch.rand(n, generator=gen, dtype=torch.float64),
    )
    (grad,) = torch.autograd.grad((w_acc * acc_g + w_cost * cost_g).sum(), z)
    (dense_grad,) = torch.autograd.grad((w_acc * want_acc + w_cost * want_cost).sum(), x)
    finite = torch.isfinite(logits)
    torch.testing.assert_close(grad[finite], dense_grad[finite], rtol=1e-9, atol=1e-12)
    assert bool((grad[~finite] == 0).all()) and float(grad.abs().sum()) > 0
    with pytest.raises(ValueError, match="moments"):
        support_scores(
            z, support, p_rows, p_index, ids, temperature=temperature, stops=stop_t, moments=True
        )


@pytest.mark.parametrize("flush", [False, True])
def test_support_scores_when_q_of_the_label_underflows(flush) -> None:
    """float32 logits whose label has q(x) ~ 1e-40 (below float32's normal range, 0 where
    denormals are flushed, as training runs) against a target with p(x) = 1e-37: A =
    q(x) / p(x) ~ 1e-3 must come out as float64 computes it, in the scoring pass and with
    autograd on (log q(x) from the logit where q(x) underflows)."""
    from blockdraft.objectives.edr.acceptance import support_scores

    logits = torch.tensor(
        [[0.0, -92.1, -50.0, -50.0, -50.0, -50.0], [0.0, -1.0, -2.0, -3.0, -4.0, -5.0]]
    )
    p_rows = torch.tensor([[1.0 - 1e-37, 1e-37, 0, 0, 0, 0], [0.5, 0.5, 0, 0, 0, 0]])
    support = torch.tensor([[0, 1], [0, 1]])
    p_index, ids = torch.tensor([0, 1]), torch.tensor([1, 1])
    q64 = torch.softmax(logits.double(), -1)
    want = torch.clamp(q64[[0, 1], ids] / p_rows.double()[[0, 1], ids], max=1.0)
    assert 1e-4 < float(want[0]) < 1e-2  # q(x) ~ 1e-40: not a normal float32
    flushing = float(torch.tensor([1e-30]) * 1e-10) == 0.0  # this process's setting
    torch.set_flush_denormal(flush)
    try:
        for z in (logits, logits.clone().requires_grad_(True)):
            acc, _, _ = support_scores(
                z, support, p_rows, p_index, ids, temperature=1.0, stops=None, moments=False
            )
            torch.testing.assert_close(acc.detach().double(), want, rtol=1e-4, atol=0.0)
    finally:
        torch.set_flush_denormal(flushing)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_compiled_moments_match_the_tensor_ops_on_training_inputs(temperature) -> None:
    """The compiled sums (`vocab_sums`, CPU) against the tensor-op backend on what training
    hands the scoring pass: bf16 logits under autocast, a draft space's -inf mass columns,
    a row with one live column, a target row all on one token, distinct target rows read
    through `target_index`, with and without stop tokens: float32 roundings apart."""
    from blockdraft.objectives.edr.acceptance import scores_with_gradient_moments

    g = torch.Generator().manual_seed(1)
    rows, vocab, distinct = 300, 1000, 50
    logits = torch.randn(rows, vocab, generator=g) * 4
    logits[:, -2:] = float("-inf")
    logits[5] = float("-inf")
    logits[5, 3] = 0.0
    probs = torch.softmax(torch.randn(distinct, vocab, generator=g) * 3, -1)
    probs[7] = 0.0
    probs[7, 2] = 1.0
    index = torch.randint(0, distinct, (rows,), generator=g)
    ids = torch.randint(0, vocab - 2, (rows,), generator=g)
    for stops in (None, torch.tensor([2, 9])):
        kw = dict(temperature=temperature, target_is_probs=True, stops=stops, chunk_rows=64)
        got = scores_with_gradient_moments(logits.bfloat16(), probs, ids, target_index=index, **kw)
        want = scores_with_gradient_moments(
            logits.bfloat16(), probs, ids, target_index=index, backend="torch", **kw
        )
        for a, b in zip(got, want, strict=True):
            assert a.dtype == torch.float32 and torch.isfinite(a).all()
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
