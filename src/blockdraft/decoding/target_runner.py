"""The target calls of the decoding loop, each doing only what its caller needs.

`Target.forward` is general (every position's logits, every chosen layer's features); at
batch 1 on a CPU the loop is dominated by exactly that generality, and at a 262k
vocabulary the LM head costs more than all decoder layers. So `TargetRunner.step` keeps
only the verified rows' logits, asks for hidden states only when a drafter reads them,
crops the cache in place (API detected once per cache), and on a CPU takes the verified
rows' argmax at T = 0, or under a top-k cutoff the logits of the tokens that can pass it,
through the exact int8 screen (`kernels/argmax_screen.py`); small Qwen3 / Llama targets on a
CPU run the lean forward instead (`decoding/cpu/lean_target.py`), in the AR baseline too,
so the two loops stay comparable. Numbers: docs/decoding.md.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from blockdraft.decoding.cpu.lean_target import LeanCache, LeanTarget
from blockdraft.kernels import cpu_kernels_apply
from blockdraft.kernels.argmax_screen import ScreenedArgmaxHead
from blockdraft.kernels.row_argmax import row_argmax
from blockdraft.sampling import processed_probs, sample


@dataclass
class StepOutput:
    """One target forward in the loop: the kept logit rows `[T', V]`, features, cache."""

    logits: torch.Tensor | None  # None when only the argmax was asked for (`tokens`)
    features: torch.Tensor | None  # [1, T, F] when asked for
    cache: Any
    tokens: torch.Tensor | None = None  # [T'] argmax of the kept rows (`argmax=True`)
    columns: torch.Tensor | None = None  # the only columns `logits` can be finite in (sorted)

    def argmax(self) -> list[int]:
        """Greedy token of every kept row (from `tokens` if the head only screened)."""
        best = self.tokens if self.tokens is not None else row_argmax(self.logits)
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
        on_cpu = self.hf and cpu_kernels_apply(target.device)
        self.lean = LeanTarget.of(model, self.layer_ids) if on_cpu and lean else None
        use_screen = on_cpu and self.lean is None
        self.screen = ScreenedArgmaxHead.for_target(target) if use_screen else None

    def use_packed_weights(self) -> None:
        """The target's linears are packed (kernels/packed_linear.py): keep the screen only
        if it is a fast one (int8, or oneDNN-packed bf16), else the packed fp32 head beats
        it (timings: docs/decoding.md)."""
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
        top_k: int = 0,
    ) -> StepOutput:
        """Forward `ids [1, T]` on top of `cache` (None: prefill) -> last `keep` logit rows.

        `croppable`: the caller will cut rejected suffixes off this cache (sliding-window
        layers must then keep their past until the next crop; HF's assisted generation
        does the same). `argmax`: the caller needs only `StepOutput.argmax()`; several
        rows then go through the screened head when the target has one (logits None).
        `top_k`: the caller samples under a top-k cutoff of at most this many tokens (0:
        none); several rows then come from the screened head, -inf for every token that
        cannot pass the cutoff (`ScreenedArgmaxHead.top_k_logits`)."""
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
        sampled_top_k = 0 < top_k <= ScreenedArgmaxHead.MAX_TOP_K
        screened = (argmax or sampled_top_k) and keep > 1 and self.screen is not None
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
        if screened and argmax:
            tokens = self.screen.argmax(out.last_hidden_state[0, -keep:])
            return StepOutput(None, feats, cache, tokens)
        if screened:
            logits, columns = self.screen.top_k_logits(out.last_hidden_state[0, -keep:], top_k)
            return StepOutput(logits, feats, cache, columns=columns)
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


def pick_token(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, gen) -> int:
    """One token from one row of logits: argmax at T = 0 (no distribution built)."""
    if temperature == 0:
        return int(row_argmax(logits))
    return int(sample(processed_probs(logits, temperature, top_p, top_k), gen))


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
