"""Target log-probs (kept and chunked modes) and the weighted cross-entropy against plain
full-logits autograd."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from blockdraft.objectives import (
    target_logprobs,
    target_logprobs_and_top,
    token_logprobs,
    weighted_cross_entropy,
)
from blockdraft.objectives.cross_entropy import keeps_probabilities

KEEP, CHUNKED = None, 0  # max_kept_bytes: default budget (small cases fit) / force chunking


def _reference_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """Full logits, full log_softmax, gather: the obvious (memory-hungry) computation."""
    logp = torch.log_softmax(hidden @ weight.T, dim=-1)
    picked = logp.gather(-1, targets.clamp_min(0)[..., None]).squeeze(-1)
    return torch.where(targets >= 0, picked, torch.zeros_like(picked))


def _case(m: int = 13, h: int = 6, v: int = 37, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(m, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64)
    targets = torch.randint(0, v, (m,), generator=g)
    upstream = torch.randn(m, generator=g, dtype=torch.float64)
    return hidden, weight, targets, upstream


@pytest.mark.parametrize(
    "chunk_rows,budget",
    [
        (1, CHUNKED),
        (4, CHUNKED),
        (5, CHUNKED),
        (12, CHUNKED),
        (13, CHUNKED),
        (100, CHUNKED),
        (4, KEEP),
        (None, KEEP),
    ],
)
def test_values_and_gradients_match_full_logits(chunk_rows, budget) -> None:
    hidden, weight, targets, upstream = _case()
    targets[3] = -100  # an unlabelled row: log-prob 0, no gradient
    h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)

    got = target_logprobs(h1, w1, targets, chunk_rows=chunk_rows, max_kept_bytes=budget)
    ref = _reference_logprobs(h2, w2, targets)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    assert got[3] == 0

    g_h1, g_w1 = torch.autograd.grad((got * upstream).sum(), (h1, w1))
    g_h2, g_w2 = torch.autograd.grad((ref * upstream).sum(), (h2, w2))
    torch.testing.assert_close(g_h1, g_h2, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g_w1, g_w2, rtol=1e-10, atol=1e-12)
    assert torch.all(g_h1[3] == 0)


@pytest.mark.parametrize("chunk_rows,budget", [(1, CHUNKED), (5, CHUNKED), (4, KEEP)])
def test_top_k_logits_ride_along_with_their_gradient(chunk_rows, budget) -> None:
    """`target_logprobs_and_top`: log q(target) as before, plus each row's top-k logits and
    columns; both gradients together equal autograd through full logits and torch.topk."""
    hidden, weight, targets, upstream = _case()
    targets[3] = -100
    k = 5
    up_top = torch.randn(13, k, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logq, top, cols = target_logprobs_and_top(
        h1.view(13, 1, -1), w1, targets.view(13, 1), k, chunk_rows=chunk_rows,
        max_kept_bytes=budget,
    )  # fmt: skip
    ref_top, ref_cols = torch.topk(h2 @ w2.T, k, dim=-1)
    ref = _reference_logprobs(h2, w2, targets)
    assert top.shape == (13, 1, k) and cols.shape == (13, 1, k) and not cols.requires_grad
    assert torch.equal(cols.view(13, k), ref_cols)
    torch.testing.assert_close(top.view(13, k), ref_top, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logq.view(13), ref, rtol=1e-12, atol=1e-12)
    loss1 = (logq.view(13) * upstream).sum() + (top.view(13, k) * up_top).sum()
    loss2 = (ref * upstream).sum() + (ref_top * up_top).sum()
    got, want = torch.autograd.grad(loss1, (h1, w1)), torch.autograd.grad(loss2, (h2, w2))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    with torch.no_grad():  # the scoring path returns the same numbers
        again = target_logprobs_and_top(hidden, weight, targets, k)
    torch.testing.assert_close(again[0], ref.detach(), rtol=1e-12, atol=1e-12)
    assert torch.equal(again[2], ref_cols)


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode, None])
def test_no_grad_scoring_matches_full_logits_over_several_chunks(context, monkeypatch) -> None:
    """Scoring passes take the unkept path (cache-sized chunks, no probabilities): the
    same values as the full log-softmax, chunk boundaries and unlabelled rows included."""
    from blockdraft.objectives import cross_entropy

    monkeypatch.setattr(cross_entropy, "NO_GRAD_MIN_ROWS", 4)
    monkeypatch.setattr(cross_entropy, "NO_GRAD_CHUNK_ELEMENTS", 5 * 37)  # 5-row chunks
    hidden, weight, targets, _ = _case(m=13)
    targets[[0, 7, 12]] = -1
    kept = []
    monkeypatch.setattr(cross_entropy, "_forward", lambda *a: kept.append(a) or 1 / 0)
    if context is None:  # grad enabled, but nothing requires it
        got = target_logprobs(hidden.reshape(13, 1, -1), weight, targets.reshape(13, 1))
    else:
        with context():
            got = target_logprobs(hidden.reshape(13, 1, -1), weight, targets.reshape(13, 1))
    assert kept == [] and got.shape == (13, 1)
    torch.testing.assert_close(
        got.reshape(-1), _reference_logprobs(hidden, weight, targets), rtol=1e-12, atol=1e-12
    )
    assert torch.all(got.reshape(-1)[[0, 7, 12]] == 0)


def test_frozen_head_gets_no_gradient_and_leading_dims_are_kept() -> None:
    hidden, weight, targets, upstream = _case(m=12)
    h = hidden.reshape(3, 4, -1).clone().requires_grad_(True)
    got = target_logprobs(h, weight, targets.reshape(3, 4), chunk_rows=5)
    assert got.shape == (3, 4)
    (grad,) = torch.autograd.grad((got.reshape(-1) * upstream).sum(), h)
    h_ref = hidden.clone().requires_grad_(True)
    (grad_ref,) = torch.autograd.grad(
        (_reference_logprobs(h_ref, weight, targets) * upstream).sum(), h_ref
    )
    torch.testing.assert_close(grad.reshape(12, -1), grad_ref, rtol=1e-10, atol=1e-12)


def test_nothing_vocabulary_sized_is_saved_for_backward() -> None:
    """Peak memory O(chunk_rows * V): the backward must recompute logits, not keep [M, V]."""
    m, v = 64, 1000
    hidden, weight, targets, _ = _case(m=m, h=8, v=v)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        target_logprobs(hidden, weight, targets, chunk_rows=8, max_kept_bytes=0).sum().backward()
    assert saved, "the hook saw no saved tensors"
    assert max(saved) <= max(v * 8, m * 8)  # the weight itself [V, H] is the largest input

    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _reference_logprobs(hidden, weight, targets).sum()
    assert max(saved) >= m * v  # the reference does keep full logits: the check can fail


class _RecordMatmuls(TorchDispatchMode):
    """Records the input dtypes of every matmul-like aten op run inside the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "addmm_", "bmm", "matmul"):
            self.calls.append((name, args[0].dtype))
        return func(*args, **(kwargs or {}))


def test_one_budget_decides_and_both_modes_agree_in_float64() -> None:
    """The kept mode does no logits matmul in backward, the chunked mode recomputes them;
    the byte budget alone picks the mode, and both give the same values and gradients."""
    m, v = 24, 50
    hidden, weight, targets, upstream = _case(m=m, h=5, v=v, seed=3)
    targets[[0, 7]] = -1
    size = m * v * 8  # float64 probabilities
    assert keeps_probabilities(m, v, torch.float64, size)
    assert not keeps_probabilities(m, v, torch.float64, size - 1)
    results = {}
    for name, budget in (("kept", size), ("chunked", size - 1)):
        h = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        logq = target_logprobs(h, w, targets, chunk_rows=7, max_kept_bytes=budget)
        with _RecordMatmuls() as rec:
            (logq * upstream).sum().backward()
        results[name] = (logq.detach(), h.grad, w.grad, len(rec.calls))
    kept, chunked = results["kept"], results["chunked"]
    torch.testing.assert_close(kept[0], chunked[0], rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(kept[1], chunked[1], rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(kept[2], chunked[2], rtol=1e-12, atol=1e-13)
    assert kept[3] == 2  # grad_hidden and grad_weight from the kept probabilities
    assert chunked[3] == 3 * 4  # 4 chunks of 7 rows: recompute + grad_hidden + grad_weight
    ref = _reference_logprobs(hidden, weight, targets)
    torch.testing.assert_close(kept[0], ref, rtol=1e-12, atol=1e-12)


def test_kept_mode_survives_a_second_backward() -> None:
    hidden, weight, targets, upstream = _case(m=9, v=11, seed=4)
    h = hidden.clone().requires_grad_(True)
    logq = target_logprobs(h, weight, targets)
    (g1,) = torch.autograd.grad((logq * upstream).sum(), h, retain_graph=True)
    (g2,) = torch.autograd.grad((logq * upstream).sum(), h)  # kept buffer already consumed
    torch.testing.assert_close(g1, g2, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("budget", [KEEP, CHUNKED])
def test_backward_runs_under_the_forwards_autocast_state(budget) -> None:
    """bf16 autocast on CPU: the backward's matmuls are bf16 like the forward's (backward is
    called outside the autocast region, as training loops do), and the values match
    full-logits autograd under the same autocast."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(20, 16, generator=g)
    weight = torch.randn(40, 16, generator=g) / 4
    targets = torch.randint(0, 40, (20,), generator=g)
    targets[2] = -1
    h1, h2 = hidden.clone().requires_grad_(True), hidden.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = target_logprobs(h1, weight, targets, chunk_rows=6, max_kept_bytes=budget)
        ref = token_logprobs(torch.nn.functional.linear(h2, weight), targets)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    with _RecordMatmuls() as rec:
        got.sum().backward()
    assert rec.calls and all(dtype == torch.bfloat16 for _, dtype in rec.calls), rec.calls
    ref.sum().backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=2e-2, atol=2e-3)
    # Without autocast the same backward is fp32: the check above can fail.
    h3 = hidden.clone().requires_grad_(True)
    plain = target_logprobs(h3, weight, targets, chunk_rows=6, max_kept_bytes=budget)
    with _RecordMatmuls() as rec:
        plain.sum().backward()
    assert all(dtype == torch.float32 for _, dtype in rec.calls)


def test_token_logprobs_matches_log_softmax_and_ignores_negative_targets() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 5, 23, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 23, (4, 5), generator=g)
    targets[1, 4] = -1
    got = token_logprobs(logits, targets)
    ref = torch.log_softmax(logits, -1).gather(-1, targets.clamp_min(0)[..., None]).squeeze(-1)
    torch.testing.assert_close(got[targets >= 0], ref[targets >= 0], rtol=1e-12, atol=1e-12)
    assert got[1, 4] == 0
    (grad,) = torch.autograd.grad(got.sum(), logits)
    assert torch.all(grad[1, 4] == 0)


def test_weighted_cross_entropy_formula_mask_and_detached_weights() -> None:
    g = torch.Generator().manual_seed(2)
    logq = -torch.rand(6, 4, generator=g, dtype=torch.float64) * 3
    logq.requires_grad_(True)
    weights = torch.rand(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(6, 4, generator=g) > 0.3
    loss = weighted_cross_entropy(logq, weights, mask)
    w, lq = weights.detach().tolist(), logq.detach().tolist()
    real = [(i, j) for i in range(6) for j in range(4) if mask[i, j]]
    manual = sum(w[i][j] * -lq[i][j] for i, j in real) / sum(w[i][j] for i, j in real)
    assert abs(float(loss.detach()) - manual) < 1e-12
    loss.backward()
    assert weights.grad is None  # weights are not a gradient path
    expected = (
        torch.where(mask, -weights.detach(), torch.zeros_like(logq))
        / (weights.detach() * mask).sum()
    )
    torch.testing.assert_close(logq.grad, expected)


def test_weighted_cross_entropy_survives_infinite_masked_entries_and_zero_weight() -> None:
    logq = torch.tensor([[-1.0, float("-inf")]], requires_grad=True)
    mask = torch.tensor([[True, False]])
    loss = weighted_cross_entropy(logq, torch.tensor([2.0, 5.0]), mask)  # [K] weights broadcast
    assert float(loss.detach()) == pytest.approx(1.0)
    loss.backward()
    assert torch.isfinite(logq.grad).all()
    zero = weighted_cross_entropy(logq.detach(), torch.zeros(2), mask)
    assert float(zero) == 0.0


def test_bad_inputs_raise_clear_errors() -> None:
    hidden, weight, targets, _ = _case()
    with pytest.raises(ValueError, match="out of range"):
        target_logprobs(hidden, weight, torch.full_like(targets, 37))
    with pytest.raises(ValueError, match="hidden size"):
        target_logprobs(hidden[:, :5], weight, targets)
    with pytest.raises(ValueError, match="targets shape"):
        target_logprobs(hidden, weight, targets[:5])
    with pytest.raises(ValueError, match="chunk_rows"):
        target_logprobs(hidden, weight, targets, chunk_rows=0)
    with pytest.raises(ValueError, match="dtype"):
        target_logprobs(hidden.float(), weight, targets)
    with pytest.raises(ValueError, match="integer"):
        token_logprobs(torch.randn(3, 5), torch.zeros(3))
    with pytest.raises(ValueError, match="broadcast"):
        weighted_cross_entropy(torch.zeros(2, 3), torch.ones(4))
