"""The frozen target model, seen through the narrow window a drafter needs.

A drafter needs the token embedding and LM head, hidden states from a few chosen layers,
the target's logits and a KV cache that can be cut back after a rejected suffix. `Target`
wraps any Hugging Face causal LM and exposes exactly those, so nothing else in blockdraft
touches model-specific code.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


def default_layer_ids(num_layers: int, count: int = 5) -> list[int]:
    """Target layers whose outputs feed the drafter: `count` evenly spaced in [1, N-3]
    (DFlash's default; fewer on small targets). The feature of layer i (0-based) is its raw
    output, the input of layer i + 1 that serving engines capture (docs/methods.md,
    "Target features")."""
    lo, hi = 1, num_layers - 3
    if num_layers <= 2:
        return list(range(num_layers))[:count]
    if hi < lo + 2:  # shallow targets (e.g. the 4-layer `tiny`): use every inner layer
        hi = num_layers - 2
    if hi - lo + 1 <= count:
        return list(range(lo, hi + 1))
    return [round(lo + (hi - lo) * i / (count - 1)) for i in range(count)]


@dataclass
class TargetOutput:
    """One target forward: logits `[B,T,V]` (None when not asked for; with
    `logits_to_keep` only the last positions, the first at index `logits_start`), features
    `[B,T,len(layer_ids)*H]`, cache."""

    logits: torch.Tensor | None
    features: torch.Tensor
    cache: Any = None
    logits_start: int = 0


def _cache_kwarg(model: nn.Module) -> str:
    """Name of the KV-cache argument: transformers 5 calls it `cache`, 4.x `past_key_values`."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class Target:
    """A frozen HF causal LM plus its tokenizer, with feature extraction for drafters."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        name: str,
        mask_token_id: int,
        layer_ids: list[int] | None = None,
        stop_token_ids: list[int] | None = None,
    ) -> None:
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name
        self.mask_token_id = int(mask_token_id)
        self.layer_ids = (
            list(layer_ids) if layer_ids is not None else default_layer_ids(self.num_layers)
        )
        bad = [i for i in self.layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"layer ids {bad} out of range for a {self.num_layers}-layer target")
        if stop_token_ids is None:
            stop_token_ids = _stop_ids(model, tokenizer)
        self.stop_token_ids = sorted(set(int(t) for t in stop_token_ids))
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask token id {mask_token_id} outside vocab {self.vocab_size}")
        self._cache_kwarg = _cache_kwarg(model)

    # --- shape facts -------------------------------------------------------------------
    @property
    def config(self) -> Any:
        cfg = self.model.config
        return getattr(cfg, "text_config", None) or cfg

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def context_length(self) -> int | None:
        """Longest sequence (prompt + response) the target was built for
        (`max_position_embeddings`), or None when its config does not say."""
        n = getattr(self.config, "max_position_embeddings", None)
        return int(n) if n else None

    @property
    def feature_size(self) -> int:
        return self.hidden_size * len(self.layer_ids)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    # --- shared modules ----------------------------------------------------------------
    @property
    def embed_tokens(self) -> nn.Module:
        """The target's input embedding (includes any scaling, e.g. Gemma's sqrt(H))."""
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    # --- forward -----------------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        use_cache: bool = False,
        logits_to_keep: int = 0,
        with_logits: bool = True,
    ) -> TargetOutput:
        """Run the target; return logits, concatenated chosen-layer features and cache
        (`use_cache=True` without `cache` starts one; `TargetRunner.crop` cuts it).
        `with_logits=False` skips the LM head: training on rollout tokens needs only the
        features, and at Gemma's 262k vocabulary the head costs more than all its layers.
        """
        if not with_logits:
            if use_cache:
                raise ValueError("with_logits=False is for training forwards (no cache)")
            logits_to_keep = 0
            features = self._features_only(input_ids, attention_mask, position_ids)
            if features is not None:
                return TargetOutput(logits=None, features=features)
        model = self.model if with_logits else self.model.get_decoder()
        layers = self._decoder_layers()
        kwargs: dict[str, Any] = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "output_hidden_states": layers is None,
            "use_cache": use_cache,
        }
        if logits_to_keep:
            kwargs["logits_to_keep"] = logits_to_keep
        if cache is not None:
            kwargs[self._cache_kwarg] = cache
        if layers is None:  # no layer list to hook: HF's states (the top one after the norm)
            out = model(**kwargs)
            features = torch.cat([out.hidden_states[i + 1] for i in self.layer_ids], dim=-1)
        else:
            with self._layer_outputs(layers, stop=False) as kept:
                out = model(**kwargs)
            features = torch.cat([kept[i] for i in self.layer_ids], dim=-1)
        if not with_logits:
            return TargetOutput(logits=None, features=features)
        start = max(0, input_ids.shape[1] - logits_to_keep) if logits_to_keep else 0
        if not use_cache:
            return TargetOutput(logits=out.logits, features=features, logits_start=start)
        new_cache = out.get("cache", None) if hasattr(out, "get") else None
        if new_cache is None:  # transformers 4.x
            new_cache = getattr(out, "past_key_values", None)
        if hasattr(new_cache, "activate_past_recording"):
            # Sliding-window layers (Gemma 3) drop states beyond the window unless told to
            # keep them until the next crop; without this a rejected suffix can't be cut.
            new_cache.activate_past_recording()
        return TargetOutput(
            logits=out.logits, features=features, cache=new_cache, logits_start=start
        )

    def _decoder_layers(self) -> nn.ModuleList | None:
        layers = getattr(self.model.get_decoder(), "layers", None)
        return layers if isinstance(layers, nn.ModuleList) else None

    @contextlib.contextmanager
    def _layer_outputs(self, layers: nn.ModuleList, stop: bool) -> Iterator[dict[int, Any]]:
        """Forward hooks that copy out the feature layers' raw outputs during a forward
        (and, with `stop`, end it after the highest one by raising `_StopForward`)."""
        kept: dict[int, torch.Tensor] = {}
        top = max(self.layer_ids)

        def keep(i: int):  # type: ignore[no-untyped-def]
            def hook(module, args, output):  # type: ignore[no-untyped-def]
                kept[i] = output[0] if isinstance(output, tuple) else output
                if stop and i == top:
                    raise _StopForward

            return hook

        handles = [layers[i].register_forward_hook(keep(i)) for i in sorted(set(self.layer_ids))]
        try:
            yield kept
        finally:
            for h in handles:
                h.remove()

    def _features_only(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """Features without logits, stopping after the highest feature layer: the layers
        above it (DFlash: the top 3) and the LM head never run, and no other layer's state
        is kept. None (the caller runs the full forward) when the decoder has no `layers`."""
        layers = self._decoder_layers()
        if layers is None:
            return None
        with self._layer_outputs(layers, stop=True) as kept, contextlib.suppress(_StopForward):
            self.model.get_decoder()(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
            )
        return torch.cat([kept[i] for i in self.layer_ids], dim=-1)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return self.tokenizer.decode(ids, skip_special_tokens=False)


class _StopForward(Exception):
    """Raised by a forward hook to end a features-only target forward early."""


def _stop_ids(model: nn.Module, tokenizer: Any) -> list[int]:
    """EOS ids from the generation config, model config and tokenizer, whichever exist."""
    ids: list[int] = []
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if eos is None:
            continue
        ids.extend(eos if isinstance(eos, (list, tuple)) else [eos])
    return ids
