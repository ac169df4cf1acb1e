"""The screened argmax head is the fp32 argmax, and its error bound covers the screen.

The screen keeps every token whose fp32 logit could still be the largest under its
rounding-error bound, so it must find the exact argmax even on near-ties that a bf16
product alone gets wrong (checked to actually happen here, so the test can fail).
"""

from __future__ import annotations

import pytest
import torch

from blockdraft.kernels import argmax_screen, packed_linear
from blockdraft.kernels.argmax_screen import ScreenedArgmaxHead
from blockdraft.kernels.packed_linear import int8_products_exact


def _near_tie_case(seed: int, outliers: bool):  # type: ignore[no-untyped-def]
    """A head and rows where, for every row, a rival token's logit is within ~1e-4 of the
    best; with `outliers` a few hidden dimensions are ~20x the rest (as in Gemma's final
    hidden states, which is what makes one-pass int8 activations useless)."""
    g = torch.Generator().manual_seed(seed)
    vocab, hidden, rows = 4096, 256, 64
    weight = torch.randn(vocab, hidden, generator=g) * 0.05
    x = torch.randn(rows, hidden, generator=g) * 4
    if outliers:
        x[:, :3] *= 20
    exact_best = (x @ weight.T).argmax(-1)
    rivals = torch.randint(vocab, (rows,), generator=g)
    for r in range(rows):
        direction = x[r] / x[r].norm() ** 2
        logit_best = float(x[r] @ weight[exact_best[r]])
        gap = (1e-4 if r % 2 else -1e-4) * abs(logit_best)
        weight[rivals[r]] = weight[exact_best[r]] + direction * gap
    return weight, x


@pytest.mark.parametrize("kind", ["int8", "int8-refined", "bf16"])
@pytest.mark.parametrize("outliers", [False, True])
def test_screened_argmax_equals_fp32_argmax_on_near_ties(monkeypatch, kind, outliers) -> None:
    """`int8-refined`: every row also takes the int8 screen's second stage."""
    if kind.startswith("int8") and not int8_products_exact():
        pytest.skip("no exact int8 products on this CPU")
    weight, x = _near_tie_case(0, outliers)
    head = ScreenedArgmaxHead(weight, kind=kind.split("-")[0])
    if kind == "int8-refined":
        monkeypatch.setattr(head, "EXACT_LIMIT", 0)
        calls = []
        original = head.screen.refine
        monkeypatch.setattr(head.screen, "refine", lambda h: calls.append(1) or original(h))
    exact = (x @ weight.T).argmax(-1)
    y = head.products(x).y
    assert (y.float().argmax(-1) != exact).any(), "the screen alone never errs: proves nothing"
    assert torch.equal(head.argmax(x), exact)
    if kind == "int8-refined":
        assert calls


@pytest.mark.parametrize("kind", ["int8", "int8-refined", "bf16"])
def test_screen_bound_covers_the_screen_error(kind) -> None:
    """The bound covers |screen - exact logit| (float64) for every token, on rows with an
    outlier dimension and heavy-tailed weight rows; it is not slack by construction
    (dropping the dominant term of an int8 stage breaks it), and the one-pass threshold
    keeps every token the full per-logit test keeps while still screening out almost all
    (the first int8 stage only after `refine`, which tightens it tenfold)."""
    if kind.startswith("int8") and not int8_products_exact():
        pytest.skip("no exact int8 products on this CPU")
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(2048, 640, generator=g)
    weight[:, 7] *= 6  # heavy-tailed rows, as in Gemma's head
    x = torch.randn(8, 640, generator=g) * 30
    x[:, 5] *= 15
    head = ScreenedArgmaxHead(weight, kind=kind.split("-")[0])
    screened = head.screen.refine(x) if kind == "int8-refined" else head.products(x)
    y = screened.y
    err = (y.double() - (x.double() @ weight.double().T)).abs()
    bound = screened.bounds()
    assert (err <= bound).all()
    full = y.float() + bound >= (y.float() - bound).amax(-1, keepdim=True)
    kept = y >= head.thresholds(screened)[:, None]
    assert (kept | ~full).all()
    if kind != "int8":  # the first int8 stage is loose on these rows: that is what refine is for
        assert kept.sum() < 0.01 * kept.numel()
    else:
        assert (head.screen.refine(x).bounds() < 0.1 * bound).all()
    if kind.startswith("int8"):  # the dominant term of each stage is needed
        term = 1 if kind == "int8" else 0  # weight error, resp. activation residual
        screened.coef[term] = torch.zeros_like(screened.coef[term])
        assert not (err <= screened.bounds()).all()


def test_int8_probe_rejects_a_saturating_kernel(monkeypatch) -> None:
    """A kernel that sums u8 x s8 in saturating int16 pairs (pre-VNNI CPUs) or applies the
    zero point in fp32 fails the probe, and the head then screens in bf16."""
    real = packed_linear.onednn_int8_linear

    def saturating(x, packed, scales):  # type: ignore[no-untyped-def]
        out = real(x, packed, scales)
        pairs = x.float().amax() * 127 * 2  # vpmaddubsw: raw u8 x s8, two at a time
        return out if pairs <= 32767 else out.clamp(-(2**15), 2**15)

    def fp32_zero_point(x, packed, scales):  # type: ignore[no-untyped-def]
        out = real(x, packed, scales)
        return (out / scales).round().add(1.0) * scales  # off by one integer

    for fake in (saturating, fp32_zero_point):
        monkeypatch.setattr(packed_linear, "onednn_int8_linear", fake)
        packed_linear.int8_products_exact.cache_clear()
        try:
            assert not packed_linear.int8_products_exact()
            assert not argmax_screen.int8_products_exact()
        finally:
            packed_linear.int8_products_exact.cache_clear()
    monkeypatch.setattr(argmax_screen, "int8_products_exact", lambda: False)
    head = ScreenedArgmaxHead(torch.randn(64, 32))
    assert isinstance(head.screen, argmax_screen.Bf16Screen)
    with pytest.raises(RuntimeError, match="int8 products"):
        ScreenedArgmaxHead(torch.randn(64, 32), kind="int8")


def _kth_near_tie_case(k: int, seed: int):  # type: ignore[no-untyped-def]
    """Rows where a rival token's fp32 logit is within ~1e-4 of the row's k-th largest
    (above or below), so the screen alone often puts the wrong token at the cutoff."""
    g = torch.Generator().manual_seed(seed)
    vocab, hidden, rows = 4096, 256, 32
    weight = torch.randn(vocab, hidden, generator=g) * 0.05
    x = torch.randn(rows, hidden, generator=g) * 4
    x[:, :3] *= 20  # outlier dimensions, as Gemma's final hidden states have
    kth = torch.topk(x @ weight.T, k, dim=-1).indices[:, -1]
    rivals = torch.randperm(vocab, generator=g)[:rows]
    for r in range(rows):
        direction = x[r] / x[r].norm() ** 2
        logit = float(x[r] @ weight[kth[r]])
        weight[rivals[r]] = weight[kth[r]] + direction * (1e-4 if r % 2 else -1e-4) * abs(logit)
    return weight, x


@pytest.mark.parametrize("kind", ["int8", "bf16", "int8-whole-rows"])
@pytest.mark.parametrize("k", [1, 5, 20])
def test_top_k_logits_keep_what_a_top_k_sampler_keeps(monkeypatch, kind, k) -> None:
    """`top_k_logits` rows: every token the exact fp32 top-k keeps is there with its fp32
    logit (one dot product's rounding), the rest is -inf, so `processed_probs` under a top-k
    cutoff of at most k gives the full head's distribution; the screen alone does not.
    `int8-whole-rows`: every row counts as too loose and gets its whole fp32 row."""
    from blockdraft.sampling import processed_probs

    if kind.startswith("int8") and not int8_products_exact():
        pytest.skip("no exact int8 products on this CPU")
    weight, x = _kth_near_tie_case(k, seed=k)
    head = ScreenedArgmaxHead(weight, kind=kind.split("-")[0])
    if kind == "int8-whole-rows":
        monkeypatch.setattr(head, "EXACT_LIMIT", 0)
    exact = x @ weight.T
    got, columns = head.top_k_logits(x, k)
    kept = exact >= torch.topk(exact, k, dim=-1).values[:, -1:]
    finite = torch.isfinite(got)
    if kind == "int8-whole-rows":
        assert columns is None
    else:
        assert torch.equal(columns, finite.any(0).nonzero().flatten())
    assert (finite | ~kept).all() and finite.sum(-1).min() >= k
    torch.testing.assert_close(got[finite], exact[finite], rtol=1e-5, atol=1e-5)
    if kind != "int8-whole-rows":
        assert finite.sum() < 0.05 * finite.numel()  # a screen, not the full head
    for cutoff in sorted({1, k}):
        for top_p in (1.0, 0.9):
            want = processed_probs(exact, 0.7, top_p, cutoff)
            have = processed_probs(got, 0.7, top_p, cutoff)
            assert torch.equal(have > 0, want > 0)
            torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-6)  # logits ~1e2
    y = head.products(x).y.float()
    alone = y >= torch.topk(y, k, dim=-1).values[:, -1:]
    assert not torch.equal(alone, kept), "the screen alone never errs: proves nothing"
