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
- `GreedyDraftHead` drafts at T = 0 with an argmax in the drafter's own vocabulary
  (the softcap is monotonic and tokens outside a reduced draft vocabulary have -inf
  logits, so the argmax is the same token `compute_logits(...).argmax()` picks), with
  the head's weight rows gathered once per decode instead of once per round.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class StepOutput:
    """One target forward in the loop: the kept logit rows `[T', V]`, features, cache."""

    logits: torch.Tensor
    features: torch.Tensor | None  # [1, T, F] when asked for
    cache: Any


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

    def step(
        self,
        ids: torch.Tensor,
        cache: Any = None,
        *,
        keep: int = 1,
        features: bool = False,
        croppable: bool = False,
    ) -> StepOutput:
        """Forward `ids [1, T]` on top of `cache` (None: prefill) -> last `keep` logit rows.

        `croppable`: the caller will cut rejected suffixes off this cache (sliding-window
        layers must then keep their past until the next crop; HF's assisted generation
        does the same)."""
        if not self.hf:
            out = self.target.forward(ids, cache=cache, use_cache=True)
            return StepOutput(out.logits[0, -keep:], out.features if features else None, out.cache)
        kwargs: dict[str, Any] = {"input_ids": ids, "use_cache": True}
        if features:
            kwargs["output_hidden_states"] = True
        if self.keep_ok:
            kwargs["logits_to_keep"] = keep
        if cache is not None:
            kwargs[self.cache_kwarg] = cache
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
        self.drafter = drafter
        self.weight = drafter.head_weight.detach().to(dtype=drafter.dtype)  # [V_draft, H]
        ids = drafter.draft_ids
        self.ids = ids.to(self.weight.device) if ids is not None else None

    @staticmethod
    def applies(drafter: Any) -> bool:
        """True for a parallel BlockDrafter (a semi-AR one drafts slot by slot)."""
        from blockdraft.models.drafter import BlockDrafter

        return isinstance(drafter, BlockDrafter) and getattr(drafter, "markov_head", None) is None

    def propose(self, state: Any, anchor_id: int, anchor_position: int) -> torch.Tensor:
        """Greedy proposals `[K]` (target ids)."""
        hidden = self.drafter.draft_hidden(state, anchor_id, anchor_position)  # [K, H]
        best = torch.nn.functional.linear(hidden, self.weight).argmax(-1)
        return best if self.ids is None else self.ids[best]
