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
- Small Qwen3 / Llama targets on CPU skip the HF forward altogether: `LeanTarget`
  (decoding/cpu/lean_target.py) computes the same layers in fewer operations, with its
  own preallocated cache; the autoregressive baseline and the speculative loop both
  use it, so their ratio stays a fair one.
- `ScreenedArgmaxHead` (decoding/cpu/argmax_screen.py): at T = 0 verification needs only
  the target's argmax at K+1 positions, and at Gemma's vocabulary an fp32 LM head over 8
  rows costs more than the decoder layers. It screens with an int8 (or bf16) product,
  keeps every token whose fp32 logit could still be the maximum under a rigorous error
  bound, and takes the exact fp32 argmax of those few.
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

from blockdraft.decoding.cpu.argmax_screen import ScreenedArgmaxHead
from blockdraft.decoding.cpu.lean_target import LeanCache, LeanTarget
from blockdraft.decoding.cpu.packed_linear import pack_weight
from blockdraft.drafters.dflash import BlockDrafter
from blockdraft.drafters.ngram import NgramTable
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

    def __init__(self, target: Any, lean: bool = True) -> None:
        """`lean=False`: always the HF forward (bench/decode.py times both)."""
        self.target = target
        model = getattr(target, "model", None)
        self.hf = isinstance(model, nn.Module) and hasattr(target, "_cache_kwarg")
        self.cache_kwarg = getattr(target, "_cache_kwarg", "cache")
        self.keep_ok = self.hf and "logits_to_keep" in inspect.signature(model.forward).parameters
        self.layer_ids = list(getattr(target, "layer_ids", []))
        self._crop_negative: bool | None = None  # transformers 5: crop(-n); 4.x crop(max_len)
        self.lean = LeanTarget.of(model, self.layer_ids) if self.hf and lean else None
        use_screen = self.hf and self.lean is None
        self.screen = ScreenedArgmaxHead.for_target(target) if use_screen else None

    def use_packed_weights(self) -> None:
        """The target's linears are packed (decoding/cpu/packed_linear.py): keep the screen only
        if it is a fast one (int8 29 ms, oneDNN-packed bf16 54 ms for 8 Gemma rows), else
        take the packed fp32 head (66 ms), which beats an unpacked bf16 screen (88 ms)."""
        if self.screen is not None and not self.screen.fast:
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
        if self.lean is not None:
            if cache is None:
                cache = self.lean.new_cache(ids.shape[1])
            hidden, feats = self.lean.forward(ids[0], cache, features)
            logits = self.lean.logits(hidden[-keep:])
            return StepOutput(logits, None if feats is None else feats[None], cache)
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
        if isinstance(cache, LeanCache):
            cache.crop(length)
            return
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
        # K rows: packed fp32 where the build can (cheapest, decoding/cpu/packed_linear.py), else
        # the screen (int8 or bf16) for a large head (compute-bound at K rows)
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


# --- per-round helpers of the speculative loop (online.py) ------------------------------
def proposals_per_round(drafter: Any) -> int:
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


def pick_token(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, gen) -> int:
    """One token from one row of logits: argmax at T = 0 (no distribution built)."""
    if temperature == 0:
        return int(logits.argmax())
    return int(sample(processed_probs(logits, temperature, top_p, top_k), gen))


def is_ngram(drafter: Any) -> bool:
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
            self.index = NgramTable(drafter.config)
        except (ImportError, AttributeError):
            self.index = None

    def propose(self, tokens: list[int]) -> list[int]:
        if self.index is None:
            return list(self.drafter.propose(tokens))[: proposals_per_round(self.drafter)]
        self.index.advance(tokens, len(tokens))
        return self.index.propose(tokens, len(tokens))


class DecodeClock:
    """Accumulates seconds per phase of a round (`lap(name)` charges time since last lap)."""

    def __init__(self, seconds: dict[str, float]) -> None:
        self.seconds = seconds
        self.t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self.t
        self.t = now


def one_hot_like(tokens: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """q of deterministic proposals `[k] -> [k, V]` (only for block verification)."""
    q = torch.zeros((tokens.shape[0], like.shape[-1]), dtype=like.dtype, device=like.device)
    return q.scatter_(-1, tokens.view(-1, 1), 1.0)
