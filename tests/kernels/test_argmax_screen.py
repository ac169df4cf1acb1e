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
