"""Exact fp32 argmax of a large LM head over a few rows, through a cheap screen.

Why: at T = 0 verification needs only the target's argmax at K+1 positions, and at a 262k
vocabulary the fp32 head over 8 rows costs more than all the decoder layers. A cheaper
product (the *screen*: `Int8Screen` on oneDNN's VNNI kernels, else `Bf16Screen`) gives
every logit with a rigorous error bound `E_v = a ||W_v|| + b e_v + c |y_v|`; only tokens
whose bound reaches the screen's maximum can be the fp32 argmax, and those few get exact
fp32 logits, so the result is the fp32 argmax. A sampler with a top-k cutoff likewise
needs only the tokens that can be among the k largest (`top_k_logits`). A one-time probe
keeps the int8 screen off where this CPU's integer sums are not exact. Bounds and costs:
docs/decoding.md.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from blockdraft.kernels.packed_linear import (
    int8_products_exact,
    onednn_int8_linear,
    onednn_linear,
    pack_bf16_onednn,
    pack_int8_onednn,
)

U32 = 2.0**-24  # fp32 unit roundoff
ROUNDING_SLACK = 1e-5  # >> the few fp32 roundings in forming thresholds and bounds


def fp32_dot_error(hidden_size: int) -> float:
    """gamma_n: `|fl(x . w) - x . w| <= gamma_n sum|x_i w_i|` for fp32 dot products of
    n terms in any summation order (Higham, Thm 3.1), plus a hair for the final rounding."""
    n = hidden_size + 1
    return n * U32 / (1 - n * U32) + 1e-7


@dataclass
class Screened:
    """A screen's logits `y [T, V]` and their error bound, `E = sum_k coef[k] (x) vectors[k]
    + rel (x) |y|` (outer products of per-row coefficients `[T]` and per-token norms `[V]`),
    which covers `|y_v - fp32 logit_v|` for every row and token."""

    y: torch.Tensor
    coef: list[torch.Tensor]
    vectors: list[torch.Tensor]
    maxima: list[float]
    rel: torch.Tensor

    def bounds(self) -> torch.Tensor:
        """The full `[T, V]` bound (tests; the loop never builds it)."""
        out = self.rel[:, None] * self.y.float().abs()
        for c, v in zip(self.coef, self.vectors, strict=True):
            out = out + c[:, None] * v[None, :]
        return out

    def bound_at(self, row: int, ids: torch.Tensor | slice, values: torch.Tensor) -> torch.Tensor:
        """`values + E` for tokens `ids` of one row (values: their screen logits, as float;
        fused multiply-adds, since on a crowded row this runs over the whole vocabulary)."""
        out = values if not self.rel[row] else values + self.rel[row] * values.abs()
        for c, v in zip(self.coef, self.vectors, strict=True):
            out = torch.addcmul(out, v[ids], c[row])
        return out

    def spread(self) -> torch.Tensor:
        """`[T]` the bound's token-independent part at its largest: `sum_k coef max(vec_k)`."""
        return sum(c * m for c, m in zip(self.coef, self.maxima, strict=True))  # type: ignore[return-value]


def _norms(*vectors: torch.Tensor) -> tuple[list[torch.Tensor], list[float]]:
    return list(vectors), [float(v.max()) if v.numel() else 0.0 for v in vectors]


class Bf16Screen:
    """`y = bf16(x) @ bf16(W).T` with `E_v = (2u + u^2 + gamma)||x|| ||W_v|| + 1.01 u |y_v|`
    (u = 2^-8; products by bf16 rounding of x and W, fp32 accumulation, bf16 output)."""

    U = 2.0**-8

    def __init__(self, weight: torch.Tensor, row_norm: torch.Tensor) -> None:
        self.low = weight.to(torch.bfloat16)
        self.packed_low = pack_bf16_onednn(self.low)
        self.gamma = fp32_dot_error(weight.shape[1])
        self.vectors, self.maxima = _norms(row_norm)

    @property
    def fast(self) -> bool:
        """True when oneDNN packed the bf16 weight (else an fp32 packed head is cheaper)."""
        return self.packed_low is not None

    def products(self, hidden: torch.Tensor) -> Screened:
        low = hidden.to(torch.bfloat16)
        if self.packed_low is not None and low.device.type == "cpu":
            y = onednn_linear(low, self.packed_low)
        else:
            y = torch.nn.functional.linear(low, self.low)
        u = self.U
        a = (2 * u + u * u + self.gamma) * hidden.norm(dim=-1)
        return Screened(y, [a], self.vectors, self.maxima, torch.full_like(a, 1.01 * u))

    @staticmethod
    def lower(threshold: torch.Tensor) -> torch.Tensor:
        """A bf16 threshold no larger than the fp32 one (rounding cannot raise it)."""
        return (threshold - threshold.abs() * 2.0**-7 - 1e-6).to(torch.bfloat16)


def _quantise_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: `(q [V, H] int8, scale [V])` with `W ~ scale q`."""
    amax = weight.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


class Int8Screen:
    """Int8 products on oneDNN's VNNI kernels (module doc), in up to two stages.

    The weight is kept as two int8 passes, `W ~ W1 + W2` (`W1 = s q1` per row, `W2 = t q2`
    its quantised residual), and `x ~ x1 + x2` likewise (two int8 passes per call, since
    Gemma's hidden states carry outliers). `products` computes `(x1 + x2) . W1` in one
    16-row call; its bound has the weight term `(||x1|| + ||x2||) e1_v`, `e1_v = ||W_v -
    W1_v||`, which is 1-5% of `||W_v||` on Gemma's head: enough for hidden states of real
    text (a handful of candidates), too loose for some (e.g. random tokens). `refine` adds
    `(x1 + x2) . W2` for such rows (a second call), leaving `(||x1|| + ||x2||) e_v` (e_v =
    `||W_v - W1_v - W2_v||`, ~1/100 of e1_v). Both by Cauchy-Schwarz on the difference,
    plus `gamma ||x|| ||W_v||` for the fp32 logits it is compared with and a few unit
    roundoffs for the screen's own float operations; integer sums are exact (< 2^24)."""

    CHUNK = 16384  # weight rows quantised at a time (bounded temporary memory)

    def __init__(self, weight: torch.Tensor, row_norm: torch.Tensor) -> None:
        rows = weight.shape[0]
        q1 = torch.empty_like(weight, dtype=torch.int8)
        q2 = torch.empty_like(weight, dtype=torch.int8)
        self.scale1, self.scale2 = torch.empty(rows), torch.empty(rows)
        e1, e2 = torch.empty(rows), torch.empty(rows)
        for start in range(0, rows, self.CHUNK):
            part = slice(start, start + self.CHUNK)
            w = weight[part].float()
            q1[part], self.scale1[part] = _quantise_rows(w)
            first = w - q1[part].float() * self.scale1[part, None]
            q2[part], self.scale2[part] = _quantise_rows(first)
            second = first - q2[part].float() * self.scale2[part, None]
            # each norm computed in fp32 from fp32-rounded parts: + 3u ||W_v||, x (1 + 1e-3)
            slack = 3 * U32 * row_norm[part]
            e1[part] = first.norm(dim=1) * (1 + 1e-3) + slack
            e2[part] = second.norm(dim=1) * (1 + 1e-3) + slack
        self.first = _norms(row_norm, e1)
        self.second = _norms(row_norm, e2)
        self.packed1, self.packed2 = pack_int8_onednn(q1), pack_int8_onednn(q2)
        self.gamma = fp32_dot_error(weight.shape[1])

    @classmethod
    def build(cls, weight: torch.Tensor, row_norm: torch.Tensor) -> Int8Screen | None:
        """The int8 screen where this CPU computes int8 products exactly, else None."""
        if weight.device.type != "cpu" or not int8_products_exact():
            return None
        screen = cls(weight, row_norm)
        return screen if screen.packed1 is not None and screen.packed2 is not None else None

    @property
    def fast(self) -> bool:
        return True

    @staticmethod
    def _passes(hidden: torch.Tensor) -> tuple[torch.Tensor, list[float], list[torch.Tensor]]:
        """`x ~ s1 q1 + s2 q2` -> (uint8 `[q1; q2] + 128`, [s1, s2], norms `[||x1||, ||x2||,
        ||x - x1 - x2||]`, each `[T]`)."""
        s1 = float(hidden.abs().max()) / 127 or 1.0
        x1 = torch.round(hidden / s1) * s1
        residual = hidden - x1
        s2 = float(residual.abs().max()) / 127 or 1.0
        x2 = torch.round(residual / s2) * s2
        stacked = torch.cat([x1 / s1, x2 / s2]).round_().add_(128).to(torch.uint8)
        norms = [x1.norm(dim=-1), x2.norm(dim=-1), (residual - x2).norm(dim=-1)]
        return stacked, [s1, s2], norms

    def products(self, hidden: torch.Tensor) -> Screened:
        return self._screen(hidden, refined=False)

    def refine(self, hidden: torch.Tensor) -> Screened:
        """Second stage for rows whose first-stage candidates are too many (class doc)."""
        return self._screen(hidden, refined=True)

    def _screen(self, hidden: torch.Tensor, refined: bool) -> Screened:
        """`(x1 + x2) . W1`, plus `(x1 + x2) . W2` when `refined`, with its bound."""
        rows = hidden.shape[0]
        stacked, (s1, s2), (x1, x2, left) = self._passes(hidden)
        acc = onednn_int8_linear(stacked, self.packed1, self.scale1)  # [2T, V]
        if refined:
            acc += onednn_int8_linear(stacked, self.packed2, self.scale2)
        y = acc[:rows].mul_(s1).add_(acc[rows:], alpha=s2)
        a, b = self._common(hidden, left, x1, x2)
        vectors, maxima = self.second if refined else self.first
        return Screened(y, [a, b], vectors, maxima, torch.zeros_like(a))

    def _common(
        self, hidden: torch.Tensor, left: torch.Tensor, x1: torch.Tensor, x2: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Coefficients of `||W_v||` and of the weight error norm (class doc): activation
        residual, fp32 logits' own error, the residual's rounding (<= 4u||x||), and <= 5
        roundings of each partial product, whose sizes sum to at most `(||x1|| + ||x2||)
        (||W_v|| + 2 e1_v + e2_v)` with `e1_v <= sqrt(H)/254 ||W_v||` (int8 rounding)."""
        margin = 1 + 1e-3
        rounding = 5 * U32 * (x1 + x2)
        a = (
            left * margin
            + (self.gamma + 4 * U32) * hidden.norm(dim=-1)
            + rounding * (1 + hidden.shape[1] ** 0.5 / 127)
        )
        b = (x1 + x2) * margin + rounding
        return a, b

    @staticmethod
    def lower(threshold: torch.Tensor) -> torch.Tensor:
        return threshold - threshold.abs() * 1e-6 - 1e-6


class ScreenedArgmaxHead:
    """Exact fp32 argmax of `hidden @ W.T` for several rows via a screen (module doc)."""

    MIN_HEAD = 1 << 24  # vocab x hidden below this (tiny: 0.5M) the fp32 head is cheap
    EXACT_LIMIT = 2048  # candidates per row re-checked in fp32 before refining instead
    MAX_TOP_K = 1024  # top-k cutoffs `top_k_logits` serves (larger ones: the full head)

    def __init__(self, weight: torch.Tensor, kind: str = "auto") -> None:
        if kind not in ("auto", "int8", "bf16"):
            raise ValueError(f"screen kind must be auto, int8 or bf16, got {kind!r}")
        self.weight = weight.detach()
        self.row_norm = self.weight.float().norm(dim=1) * (1 + 1e-3)
        self.screen: Int8Screen | Bf16Screen | None = None
        if kind != "bf16":
            self.screen = Int8Screen.build(self.weight, self.row_norm)
            if self.screen is None and kind == "int8":
                raise RuntimeError("int8 products are not exact on this CPU/build")
        if self.screen is None:
            self.screen = Bf16Screen(self.weight, self.row_norm)

    @classmethod
    def for_target(cls, target: Any) -> ScreenedArgmaxHead | None:
        """The (cached) screen of an HF target's LM head, or None where it cannot help:
        small heads, non-fp32 heads, heads with a bias, or a softcap (monotone, but
        kept off the fast path for simplicity)."""
        model = target.model
        head = model.get_output_embeddings()
        cfg = getattr(model.config, "text_config", None) or model.config
        if (
            not isinstance(head, nn.Linear)
            or head.bias is not None
            or head.weight.dtype != torch.float32
            or head.weight.numel() < cls.MIN_HEAD
            or getattr(cfg, "final_logit_softcapping", None)
            or not hasattr(model, "get_decoder")
        ):
            return None
        if model not in _HEADS:
            _HEADS[model] = cls(head.weight)
        return _HEADS[model]

    @property
    def fast(self) -> bool:
        """True when the screen beats a packed fp32 head (int8, or oneDNN-packed bf16)."""
        return self.screen.fast

    def products(self, hidden: torch.Tensor) -> Screened:
        """The screen of `hidden [T, H]` with its error bound."""
        return self.screen.products(hidden.float())

    def thresholds(self, screened: Screened, k: int = 1) -> torch.Tensor:
        """`[T]` lower bounds on the screen value of any token whose fp32 logit can be the
        largest (`k` = 1), or among the k largest: with `y_k` the k-th largest screen
        value, the k tokens at or above it have fp32 logits >= `y_k - E`, so a token below
        `y_k - 2E` cannot reach them; `E_m <= spread + rel |top|` for the argmax and
        `E_v <= spread + rel max|y|` for any token: a few reductions, no `[T, V]` bound."""
        y, rel = screened.y, screened.rel
        top, low = y.amax(dim=-1).float(), y.amin(dim=-1).float()
        big = torch.maximum(top.abs(), low.abs())
        if k > 1:
            top = torch.topk(y, k, dim=-1).values[:, -1].float()
        slack = 2 * screened.spread() + rel * ((top.abs() if k == 1 else big) + big)
        # fp32 rounding of this subtraction: a few units of its operands' size
        threshold = top - slack - ROUNDING_SLACK * (top.abs() + slack)
        return self.screen.lower(threshold)

    def candidates(self, screened: Screened, threshold: torch.Tensor, row: int) -> torch.Tensor:
        """Tokens of `row` whose fp32 logit can be the largest: the one-pass superset,
        trimmed with each token's own bound against the screen argmax's (over the whole
        row when the superset is a large part of it: no gathers then)."""
        ids = (screened.y[row] >= threshold[row]).nonzero().flatten()
        if ids.numel() <= 1:
            return ids
        whole = ids.numel() > screened.y.shape[1] // 8
        values = screened.y[row].float() if whole else screened.y[row, ids].float()
        upper = screened.bound_at(row, slice(None) if whole else ids, values)
        best = int(values.argmax())
        top, top_upper = values[best], upper[best]
        floor = top - (top_upper - top) - ROUNDING_SLACK * (top.abs() + top_upper.abs())
        floor = self.screen.lower(floor).float()  # y_m - E_m, rounded down
        keep = (upper >= floor).nonzero().flatten()
        return keep if whole else ids[keep]

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[T, H]` final hidden states -> `[T]` argmax of their fp32 logits."""
        hidden = hidden.float()
        screened = self.products(hidden)
        threshold = self.thresholds(screened)
        picks = [self.candidates(screened, threshold, r) for r in range(hidden.shape[0])]
        crowded = [r for r, ids in enumerate(picks) if ids.numel() > self.EXACT_LIMIT]
        if crowded and isinstance(self.screen, Int8Screen):
            finer = self.screen.refine(hidden[crowded])
            finer_threshold = self.thresholds(finer)
            for i, r in enumerate(crowded):
                picks[r] = self.candidates(finer, finer_threshold, i)
        out = torch.empty(hidden.shape[0], dtype=torch.long)
        for r, ids in enumerate(picks):
            exact = self.weight.index_select(0, ids) @ hidden[r]
            out[r] = ids[int(exact.argmax())]
        return out

    def top_k_logits(
        self, hidden: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`([T, V] float32, columns)`: the fp32 logit of every token that can be among its
        row's `k` largest, -inf for the rest, and the sorted finite columns (None when a
        row came whole), so a top-k cutoff of at most `k` keeps the same tokens as the
        full logits. For k > 1 the int8 screen starts at its second stage (tokens are
        dense near the k-th largest); a row still that loose gets its whole fp32 row."""
        hidden = hidden.float()
        two_stage = k > 1 and isinstance(self.screen, Int8Screen)
        screened = self.screen.refine(hidden) if two_stage else self.products(hidden)
        threshold = self.thresholds(screened, k)
        out = torch.full((hidden.shape[0], self.weight.shape[0]), float("-inf"))
        picks, whole = [], False
        for r in range(hidden.shape[0]):
            ids = (screened.y[r] >= threshold[r]).nonzero().flatten()
            if ids.numel() > self.EXACT_LIMIT:
                out[r], whole = self.weight @ hidden[r], True
            else:
                out[r, ids] = self.weight.index_select(0, ids) @ hidden[r]
                picks.append(ids)
        return out, None if whole else torch.unique(torch.cat(picks))


_HEADS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
