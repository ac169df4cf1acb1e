"""The model calls of the decoding loop, each doing only what its caller needs.

Why not `Target.forward` and `drafter.draft_logits`: they are general (every position's
logits, every chosen layer's features, full-vocabulary draft logits), and at batch 1
on a CPU the decoding loop is dominated by exactly that generality. Measured on Gemma
3 270M's shape (262k vocabulary): the LM head costs more than all decoder layers, so a
prefill that computes logits for every prompt position, or a drafter that expands K
rows of draft logits to the full vocabulary, pays for nothing. So:

- `TargetRunner.step` calls the HF model with `logits_to_keep` (only the rows that are
  verified) and asks for hidden states only when a drafter consumes features (the
  n-gram drafter and the autoregressive baseline never do); the cache is cropped in
  place with the API detected once per cache, not by signature inspection per round.
  Targets that are not HF-backed (test doubles with the `Target.forward` signature) go
  through `target.forward` and get the same interface.
- `ScreenedArgmaxHead`: at T = 0 verification needs only the target's argmax at K+1
  positions, and at Gemma's vocabulary an fp32 LM head over 8 rows is compute-bound
  (measured 3x the cost of the 1-row head that an AR step pays, i.e. most of a
  "verification costs 2.8 AR steps" round). It screens with a bfloat16 copy of the head
  (about half the cost), keeps every token whose logit could still be the maximum
  under a rigorous rounding-error bound, and takes the argmax of exact fp32 logits of
  those few candidates (typically 1-20). The result is the argmax of fp32 logits; like
  the 1-row vs 8-row fp32 products themselves, it can differ from another fp32
  summation order only on ties within float rounding (~1e-5 relative).
- `GreedyDraftHead` drafts at T = 0 with an argmax in the drafter's own vocabulary
  (the softcap is monotonic and tokens outside a reduced draft vocabulary have -inf
  logits, so the argmax is the same token `compute_logits(...).argmax()` picks), with
  the head's weight rows gathered once per decode instead of once per round.
"""

from __future__ import annotations

import inspect
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from blockdraft.models.packed_linear import onednn_linear, pack_bf16_onednn, pack_weight
from blockdraft.sampling import processed_probs, sample


@dataclass
class StepOutput:
    """One target forward in the loop: the kept logit rows `[T', V]`, features, cache."""

    logits: torch.Tensor | None  # None when only the argmax was asked for (`tokens`)
    features: torch.Tensor | None  # [1, T, F] when asked for
    cache: Any
    tokens: torch.Tensor | None = None  # [T'] argmax of the kept rows (`argmax=True`)

    def argmax(self) -> list[int]:
        """Greedy token of every kept row (from `tokens` if the head only screened)."""
        best = self.tokens if self.tokens is not None else self.logits.argmax(-1)
        return best.tolist()


class TargetRunner:
    """Incremental batch-1 target forwards with the least work per call (see module doc)."""

    def __init__(self, target: Any) -> None:
        self.target = target
        model = getattr(target, "model", None)
        self.hf = isinstance(model, nn.Module) and hasattr(target, "_cache_kwarg")
        self.cache_kwarg = getattr(target, "_cache_kwarg", "cache")
        self.keep_ok = self.hf and "logits_to_keep" in inspect.signature(model.forward).parameters
        self.layer_ids = list(getattr(target, "layer_ids", []))
        self._crop_negative: bool | None = None  # transformers 5: crop(-n); 4.x crop(max_len)
        self.screen = ScreenedArgmaxHead.for_target(target) if self.hf else None

    def use_packed_weights(self) -> None:
        """The target's linears are packed (models/packed_linear.py): keep the bf16 screen
        only if oneDNN packed it too (54 vs 66 ms for 8 Gemma rows), else take the packed
        fp32 head, which beats an unpacked screen (88 ms)."""
        if self.screen is not None and self.screen.packed_low is None:
            self.screen = None

    def step(
        self,
        ids: torch.Tensor,
        cache: Any = None,
        *,
        keep: int = 1,
        features: bool = False,
        croppable: bool = False,
        argmax: bool = False,
    ) -> StepOutput:
        """Forward `ids [1, T]` on top of `cache` (None: prefill) -> last `keep` logit rows.

        `croppable`: the caller will cut rejected suffixes off this cache (sliding-window
        layers must then keep their past until the next crop; HF's assisted generation
        does the same). `argmax`: the caller needs only `StepOutput.argmax()`; several
        rows then go through the screened head when the target has one (logits None)."""
        if not self.hf:
            out = self.target.forward(ids, cache=cache, use_cache=True)
            return StepOutput(out.logits[0, -keep:], out.features if features else None, out.cache)
        kwargs: dict[str, Any] = {"input_ids": ids, "use_cache": True}
        if features:
            kwargs["output_hidden_states"] = True
        if cache is not None:
            kwargs[self.cache_kwarg] = cache
        screened = argmax and keep > 1 and self.screen is not None
        if screened:
            out = self.target.model.get_decoder()(**kwargs)
        else:
            if self.keep_ok:
                kwargs["logits_to_keep"] = keep
            out = self.target.model(**kwargs)
        if cache is None:
            cache = out.get("cache", None) if hasattr(out, "get") else None
            if cache is None:  # transformers 4.x
                cache = out.past_key_values
            if croppable and hasattr(cache, "activate_past_recording"):
                cache.activate_past_recording()
        feats = None
        if features:
            hidden = out.hidden_states
            feats = torch.cat([hidden[i + 1] for i in self.layer_ids], dim=-1)
        if screened:
            tokens = self.screen.argmax(out.last_hidden_state[0, -keep:])
            return StepOutput(None, feats, cache, tokens)
        return StepOutput(out.logits[0, -keep:], feats, cache)

    def crop(self, cache: Any, length: int) -> None:
        """Keep the first `length` positions of `cache`, in place (no-op if already so)."""
        remove = cache.get_seq_length() - length
        if remove < 0:
            raise ValueError(f"cannot crop a cache of {length - remove} positions to {length}")
        if remove == 0:  # never crop(0): a transformers 5 DynamicLayer reads it as "drop all"
            return
        if self._crop_negative is None:
            self._crop_negative = "tokens_to_remove" in inspect.signature(cache.crop).parameters
        cache.crop(-remove if self._crop_negative else length)


class GreedyDraftHead:
    """T = 0 drafting for a parallel `BlockDrafter`: argmax over its own vocabulary."""

    def __init__(self, drafter: Any) -> None:
        # no reference to the drafter itself: instances are cached weakly keyed by it
        self.weight = drafter.head_weight.detach().to(dtype=drafter.dtype)  # [V_draft, H]
        ids = drafter.draft_ids
        self.ids = ids.to(self.weight.device) if ids is not None else None
        # K rows: packed fp32 where the build can (cheapest, models/packed_linear.py), else
        # a bf16 screen for a large head (compute-bound at K rows)
        self.packed = pack_weight(self.weight)
        big = (
            self.weight.dtype == torch.float32
            and self.weight.numel() >= ScreenedArgmaxHead.MIN_HEAD
        )
        screen = big and self.packed is None
        self.screen = ScreenedArgmaxHead(self.weight) if screen else None

    @classmethod
    def of(cls, drafter: Any) -> GreedyDraftHead:
        """The drafter's head, reused across prompts while its weight sources are unchanged
        (tensor versions: an in-place update, e.g. `set_draft_vocab`, rebuilds it)."""
        shared = drafter._need_target().head.weight
        d2t = getattr(drafter, "d2t", None)
        key = (id(shared), shared._version, None if d2t is None else (id(d2t), d2t._version))
        cached = _SCREENS.get(drafter)
        if cached is None or cached[0] != key:
            cached = (key, cls(drafter))
            _SCREENS[drafter] = cached
        return cached[1]

    @staticmethod
    def applies(drafter: Any) -> bool:
        """True for a parallel BlockDrafter (a semi-AR one drafts slot by slot)."""
        from blockdraft.models.drafter import BlockDrafter

        return isinstance(drafter, BlockDrafter) and getattr(drafter, "markov_head", None) is None

    def pick(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy proposals `[K]` (target ids) from `drafter.draft_hidden(...)` `[K, H]`."""
        if self.screen is not None:
            best = self.screen.argmax(hidden)
        elif self.packed is not None:
            best = self.packed(hidden).argmax(-1)
        else:
            best = torch.nn.functional.linear(hidden, self.weight).argmax(-1)
        return best if self.ids is None else self.ids[best]


_SCREENS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class ScreenedArgmaxHead:
    """Exact fp32 argmax of `hidden @ W.T` for several rows via a bf16 screen (module doc).

    Error bound per logit v of row x (u = 2^-8, bf16's unit roundoff): rounding x and W
    to bf16 moves each product by at most `(2u + u^2)|x_i||W_vi|`, fp32 accumulation of
    640-4096 terms by less than `1e-4 * sum|x_i||W_vi|`, and the bf16 output by
    `u |screen_v|`; `sum|x_i||W_vi| <= ||x|| ||W_v||` (Cauchy-Schwarz). So
    `E_v = a ||W_v|| + b |screen_v|` with `a = (2u + u^2 + 1e-4) ||x||`, `b = 1.01 u`,
    and a token can be the fp32 argmax only if `screen_v + E_v >= screen_m - E_m` for the
    screen's own argmax m, hence only if `screen_v >= screen_m - E_m - max_v E_v`
    (`thresholds`): one comparison pass over the screen, no `[T, V]` bound tensor. The
    few tokens that pass (1-4 per row on Gemma) get exact fp32 logits.

    The bf16 product uses a weight packed once by oneDNN where this build has it
    (`torch.ops.mkldnn._linear_pointwise`: 46 ms for 8 rows of Gemma's 262k x 640 head on
    one thread, against 67 ms for `F.linear` in bf16 and 63 ms for packed fp32).
    """

    MIN_HEAD = 1 << 24  # vocab x hidden below this (tiny: 0.5M) the fp32 head is cheap
    U = 2.0**-8

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.detach()
        self.low = self.weight.to(torch.bfloat16)
        self.packed_low = pack_bf16_onednn(self.low)
        self.row_norm = self.weight.norm(dim=1)
        self.max_row_norm = float(self.row_norm.max()) if self.row_norm.numel() else 0.0

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
        if model not in _SCREENS:
            _SCREENS[model] = cls(head.weight)
        return _SCREENS[model]

    def screen(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[T, V]` bf16 product (oneDNN-packed where available, else `F.linear`)."""
        low = hidden.to(torch.bfloat16)
        if self.packed_low is not None and low.device.type == "cpu":
            return onednn_linear(low, self.packed_low)
        return torch.nn.functional.linear(low, self.low)

    def bounds(self, hidden: torch.Tensor, screen: torch.Tensor) -> torch.Tensor:
        """Per-logit error bound `E [T, V]` of the bf16 screen (class doc; for tests)."""
        u = self.U
        norms = hidden.float().norm(dim=-1, keepdim=True)
        return (2 * u + u * u + 1e-4) * norms * self.row_norm + (u * 1.01) * screen.float().abs()

    def thresholds(self, hidden: torch.Tensor, screen: torch.Tensor) -> torch.Tensor:
        """`[T]` bf16 lower bounds on the screen value of any possible fp32 argmax.

        From the class doc with `E_m <= a max||W|| + b |top|` and `E_v <= a max||W|| +
        b max|screen|`: two cheap reductions (no argmax index, no `[T, V]` bound), then
        lowered by 2^-7 relative + 1e-6 so that rounding to bf16 cannot raise it."""
        u = self.U
        a = (2 * u + u * u + 1e-4) * hidden.float().norm(dim=-1) * self.max_row_norm
        b = 1.01 * u
        top, low = screen.amax(dim=-1).float(), screen.amin(dim=-1).float()
        threshold = top - 2 * a - b * (top.abs() + torch.maximum(top.abs(), low.abs()))
        return (threshold - threshold.abs() * 2.0**-7 - 1e-6).to(torch.bfloat16)

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[T, H]` final hidden states -> `[T]` argmax of their fp32 logits."""
        hidden = hidden.float()
        screen = self.screen(hidden)
        threshold = self.thresholds(hidden, screen)
        out = torch.empty(hidden.shape[0], dtype=torch.long)
        for r in range(hidden.shape[0]):
            ids = (screen[r] >= threshold[r]).nonzero().flatten()
            exact = self.weight.index_select(0, ids) @ hidden[r]
            out[r] = ids[int(exact.argmax())]
        return out


# --- per-round helpers of the speculative loop (online.py) ------------------------------
def _num_proposals(drafter: Any) -> int:
    cfg = getattr(drafter, "config", None)
    k = getattr(cfg, "num_proposals", None) if cfg is not None else None
    return int(k if k is not None else drafter.num_proposals)


def _is_sequential(drafter: Any) -> bool:
    """True for drafters whose slot k depends on the token drafted at k-1 (semi-AR)."""
    flag = getattr(drafter, "sequential", None)
    if flag is not None:
        return bool(flag)
    cfg = getattr(drafter, "config", None)
    return getattr(cfg, "arch", "dflash") == "semi_ar"


def draft_block(
    drafter: Any,
    state: Any,
    anchor_id: int,
    anchor_position: int,
    temperature: float,
    top_p: float,
    top_k: int,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Propose K tokens -> (tokens [K], q [K,V] they were drawn from; None at T = 0).

    q is the processed drafter distribution (what lossless verification needs); at T = 0
    the argmax is all that matters, so no distribution is built."""
    greedy = temperature == 0
    ids = getattr(drafter, "draft_ids", None)
    if not _is_sequential(drafter) and ids is not None and not greedy:
        # a reduced vocabulary: process and sample its K x V_draft logits (Gemma: 4k
        # columns, not 262k of which all but 4k are -inf), then place q in target space
        hidden = drafter.draft_hidden(state, anchor_id, anchor_position)
        q_draft = processed_probs(drafter.compute_draft_logits(hidden), temperature, top_p, top_k)
        ids = ids.to(q_draft.device)
        q = q_draft.new_zeros((q_draft.shape[0], int(drafter.config.vocab_size)))
        return ids[sample(q_draft, generator)], q.index_copy_(-1, ids, q_draft)
    if not _is_sequential(drafter):
        logits = drafter.draft_logits(state, anchor_id, anchor_position)
        if greedy:
            return logits.argmax(-1), None
        q = processed_probs(logits, temperature, top_p, top_k)
        return sample(q, generator), q
    hidden = drafter.draft_hidden(state, anchor_id, anchor_position)  # [K, H]
    prev = torch.tensor([int(anchor_id)], device=hidden.device)
    tokens, qs = [], []
    for k in range(hidden.shape[0]):
        logits = drafter.compute_logits(hidden[k : k + 1], prev)[0]
        if greedy:
            tok = logits.argmax(-1)
        else:
            q = processed_probs(logits, temperature, top_p, top_k)
            tok = sample(q, generator)
            qs.append(q)
        tokens.append(tok)
        prev = tok.reshape(1).to(hidden.device)
    return torch.stack(tokens), (torch.stack(qs) if qs else None)


def _pick(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, gen) -> int:
    """One token from one row of logits: argmax at T = 0 (no distribution built)."""
    if temperature == 0:
        return int(logits.argmax())
    return int(sample(processed_probs(logits, temperature, top_p, top_k), gen))


def _is_ngram(drafter: Any) -> bool:
    return callable(getattr(drafter, "propose", None)) and not hasattr(drafter, "new_state")


class NgramIndex:
    """An n-gram drafter's lookup table grown with the verified text, one round at a time.

    `drafter.propose(tokens)` rebuilds the table from the whole text (O(length) per
    round); the verified text only ever grows, so the loop keeps one table and adds the
    new tokens' n-grams (O(accepted) per round). Falls back to `propose` for drafters
    without the incremental table."""

    def __init__(self, drafter: Any) -> None:
        self.drafter = drafter
        try:
            from blockdraft.models.ngram import NgramTable

            self.index = NgramTable(drafter.config)
        except (ImportError, AttributeError):
            self.index = None

    def propose(self, tokens: list[int]) -> list[int]:
        if self.index is None:
            return list(self.drafter.propose(tokens))[: _num_proposals(self.drafter)]
        self.index.advance(tokens, len(tokens))
        return self.index.propose(tokens, len(tokens))


class _Clock:
    """Accumulates seconds per phase of a round (`lap(name)` charges time since last lap)."""

    def __init__(self, seconds: dict[str, float]) -> None:
        self.seconds = seconds
        self.t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self.t
        self.t = now


def _one_hot(tokens: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """q of deterministic proposals `[k] -> [k, V]` (only for block verification)."""
    q = torch.zeros((tokens.shape[0], like.shape[-1]), dtype=like.dtype, device=like.device)
    return q.scatter_(-1, tokens.view(-1, 1), 1.0)
