"""`DrafterConfig`: what fixes a drafter's shapes and its contract with its target.

Kept apart from the model code so that checkpoints, the trainer's config and the CLI can
read and validate drafter configs without building a model. `for_target` copies the
attention geometry from a Qwen3 / Llama / Gemma 3 target config;
`check_target_compatible` is the one place that decides whether a drafter fits a target.
The DFlash2 keys (convolutions, candidate selector) and the attention variants published
drafters use (sliding-window / causal layers, an output multiplier) live here too: they
fix shapes and behaviour exactly as the others do.
"""

from __future__ import annotations

import types
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

ARCHS = ("dflash", "semi_ar", "dflash2")
LAYER_TYPES = ("full_attention", "sliding_attention")
# Keys a stored config must carry although the class has a default for them: a default
# here would silently give another drafter (a block size of 16 for one trained with 4, a
# RoPE base or norm epsilon the weights were not trained with).
STORED_KEYS = ("block_size", "num_hidden_layers", "arch", "rms_norm_eps", "rope_theta")


class ConfigKeyError(ValueError):
    """A stored drafter config lacks a key or holds a value of the wrong type; the message
    starts with the key, so a caller can prefix where the config came from."""


@dataclass
class DrafterConfig:
    """Everything that fixes a drafter's shapes and its contract with the target."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int
    target_hidden_size: int
    target_name: str = ""
    num_hidden_layers: int = 1
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # non-default RoPE params, HF style
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    # Public DFlash drafters (Qwen3 *and* Llama-3.1 targets) always have q/k norm and
    # every serving engine applies it, so True is the servable default for all families.
    qk_norm: bool = True
    draft_vocab_size: int | None = None  # None = full target vocabulary
    arch: str = "dflash"
    markov_rank: int = 0  # semi_ar only
    final_logit_softcapping: float | None = None
    # The scale the target's embedding module applies (Gemma: sqrt(H)); informational,
    # written to the serving config for loaders that embed with the raw table.
    input_embedding_scale: float = 1.0
    # Slots 1..K read prompt lookup's proposals instead of the mask token
    # (drafters/lookup_inputs.py); not expressible in the DFlash serving format.
    lookup_inputs: bool = False
    # z-lab's logit scale, applied before the softcap: logits = cap(multiplier * h W^T)
    output_multiplier: float = 1.0
    # Per-layer attention as in HF configs: None = every layer "full_attention". A
    # "sliding_attention" layer sees keys at most `sliding_window - 1` positions away (no
    # limit if None, as transformers leaves it without use_sliding_window); `is_causal`
    # None = sliding layers causal, full ones not (z-lab's rule), else all layers causal
    # (True) or bidirectional (False) inside the block.
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    is_causal: bool | None = None
    # dflash2 only: grouped dynamic causal convolutions around attention and MLP, and the
    # candidate selector (drafters/dflash2.py)
    conv_kernel_size: int = 0
    conv_group_size: int = 16
    selector_rank: int = 0
    selector_top_k: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if self.arch not in ARCHS:
            raise ValueError(f"unknown drafter arch {self.arch!r}: use one of {ARCHS}")
        if not 1 <= self.num_hidden_layers <= 8:
            raise ValueError(f"num_hidden_layers must be in 1..8, got {self.num_hidden_layers}")
        if self.block_size < 2:
            raise ValueError(
                f"block_size must be >= 2 (anchor + at least one proposal), got {self.block_size}"
            )
        if self.hidden_size != self.target_hidden_size:
            raise ValueError(
                f"drafter hidden_size {self.hidden_size} must equal "
                f"target_hidden_size {self.target_hidden_size}"
            )
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must not be empty")
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size {self.draft_vocab_size} must be in [1, {self.vocab_size}]"
            )
        if self.lookup_inputs and self.arch != "dflash":
            raise ValueError("lookup_inputs needs the parallel (dflash) drafter arch")
        if self.arch == "semi_ar" and self.markov_rank < 1:
            raise ValueError("a semi_ar drafter needs markov_rank >= 1")
        if self.layer_types is not None:
            self.layer_types = [str(t) for t in self.layer_types]
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(
                    f"layer_types has {len(self.layer_types)} entries for "
                    f"{self.num_hidden_layers} layers"
                )
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad:
                raise ValueError(f"unknown layer_types {bad}: use {LAYER_TYPES}")
        if "sliding_attention" not in (self.layer_types or []):
            self.sliding_window = None  # meaningless without sliding layers: one spelling
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        if not self.output_multiplier > 0:
            raise ValueError(f"output_multiplier must be > 0, got {self.output_multiplier}")
        if self.arch == "dflash2":
            self._check_dflash2()

    def _check_dflash2(self) -> None:
        if self.conv_kernel_size < 1:
            raise ValueError("a dflash2 drafter needs conv_kernel_size >= 1")
        if self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
            raise ValueError(
                f"conv_group_size {self.conv_group_size} must divide hidden_size {self.hidden_size}"
            )
        columns = self.draft_vocab_size or self.vocab_size
        if self.selector_rank < 1 or not 1 <= self.selector_top_k <= columns:
            raise ValueError(
                "a dflash2 drafter needs selector_rank >= 1 and selector_top_k in "
                f"[1, {columns}], got {self.selector_rank} and {self.selector_top_k}"
            )

    def layer_attention(self, index: int) -> tuple[bool, int | None]:
        """(causal inside the block, sliding window or None) of decoder layer `index`."""
        kind = self.layer_types[index] if self.layer_types else "full_attention"
        sliding = kind == "sliding_attention"
        causal = sliding if self.is_causal is None else bool(self.is_causal)
        window = self.sliding_window if sliding else None
        return causal, (None if window is None else int(window))

    @property
    def num_proposals(self) -> int:
        """K: proposals per block (slot 0 is the anchor)."""
        return self.block_size - 1

    @property
    def feature_size(self) -> int:
        return len(self.target_layer_ids) * self.target_hidden_size

    @classmethod
    def for_target(
        cls,
        target: Any,
        num_layers: int = 1,
        block_size: int = 16,
        *,
        arch: str = "dflash",
        markov_rank: int = 64,
        draft_vocab_size: int | None = None,
        qk_norm: bool = True,
        intermediate_size: int | None = None,
        lookup_inputs: bool = False,
        conv_kernel_size: int = 2,
        conv_group_size: int = 16,
        selector_rank: int = 256,
        selector_top_k: int = 16,
    ) -> DrafterConfig:
        """A drafter with the target's attention geometry (Qwen3 / Llama / Gemma 3 configs)."""
        c = target.config
        heads = int(c.num_attention_heads)
        theta, scaling = _rope_from_hf(c)
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=int(intermediate_size or c.intermediate_size),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(c, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(c, "head_dim", None) or target.hidden_size // heads),
            vocab_size=target.vocab_size,
            mask_token_id=target.mask_token_id,
            target_layer_ids=list(target.layer_ids),
            num_target_layers=target.num_layers,
            target_hidden_size=target.hidden_size,
            target_name=target.name,
            num_hidden_layers=num_layers,
            block_size=block_size,
            rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(getattr(c, "max_position_embeddings", 32768)),
            attention_bias=bool(getattr(c, "attention_bias", False)),
            qk_norm=qk_norm,
            draft_vocab_size=draft_vocab_size,
            arch=arch,
            markov_rank=markov_rank if arch == "semi_ar" else 0,
            final_logit_softcapping=getattr(c, "final_logit_softcapping", None),
            input_embedding_scale=float(getattr(target.embed_tokens, "embed_scale", 1.0)),
            lookup_inputs=lookup_inputs,
            **(
                {
                    "conv_kernel_size": conv_kernel_size,
                    "conv_group_size": conv_group_size,
                    "selector_rank": selector_rank,
                    "selector_top_k": selector_top_k,
                }
                if arch == "dflash2"
                else {}
            ),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DrafterConfig:
        """A config read back from storage, checked key by key before anything is built:
        unknown keys, a missing required key (`STORED_KEYS` and those without a default)
        and a value of the wrong type (`block_size: 4.5`, `rms_norm_eps: "1e-6"`) raise
        `ConfigKeyError` naming the key; nothing is converted or defaulted silently."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown drafter config key(s) {unknown}")
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            if f.name not in data:
                if f.name in STORED_KEYS or (f.default is MISSING and f.default_factory is MISSING):
                    raise ConfigKeyError(f"{f.name}: missing (no default is assumed for it)")
                continue
            expected = _type_name(hints[f.name], data[f.name])
            if expected is not None:
                raise ConfigKeyError(f"{f.name}: expected {expected}, got {data[f.name]!r}")
        return cls(**data)

    def hf_rope_config(self) -> Any:
        """A transformers Qwen3Config carrying this RoPE, for transformers' rope init functions."""
        # lazy: transformers takes seconds to import; only non-default RoPE needs it
        from transformers import Qwen3Config

        params = {
            "rope_theta": self.rope_theta,
            "rope_type": "default",
            **(self.rope_scaling or {}),
        }
        return Qwen3Config(
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters=params,
        )


_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _type_name(kind: Any, value: Any) -> str | None:
    """None if `value` is a `kind` as JSON spells it, else what was expected (in words).

    JSON has one number type, so an integer is accepted where a float is expected; a bool
    is never a number and a float never an integer (4.5 must not become block size 4)."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        problems = [_type_name(a, value) for a in inner]
        if any(p is None for p in problems):
            return None
        null = " or null" if len(inner) < len(args) else ""
        return " or ".join(p for p in problems if p) + null
    if kind is Any:
        return None
    if origin is list:
        entry = args[0] if args else Any
        if isinstance(value, list) and all(_type_name(entry, v) is None for v in value):
            return None
        return f"a list whose entries are each {_type_name(entry, object()) or 'a value'}"
    if origin is dict:
        return None if isinstance(value, dict) else "a mapping"
    if kind is bool:
        return None if isinstance(value, bool) else _NAMES[bool]
    if kind is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else _NAMES[int]
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else _NAMES[float]
    if kind is str:
        return None if isinstance(value, str) else _NAMES[str]
    return None


def _rope_from_hf(c: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, non-default scaling params) from a transformers 4.x or 5.x config."""
    params = getattr(c, "rope_parameters", None)
    if isinstance(params, dict) and "full_attention" in params:  # Gemma 3: per layer type
        params = params["full_attention"]
    if not isinstance(params, dict):
        params = dict(getattr(c, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(c, "rope_theta", 10000.0))
    params = dict(params)
    theta = float(params.pop("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    return theta, (params if rope_type != "default" else None)


def check_target_compatible(config: DrafterConfig, target: Any) -> None:
    """Raise a one-line error naming the first key on which drafter and target disagree."""
    pairs = [
        ("target_hidden_size", config.target_hidden_size, target.hidden_size),
        ("vocab_size", config.vocab_size, target.vocab_size),
        ("target_layer_ids", list(config.target_layer_ids), list(target.layer_ids)),
        ("num_target_layers", config.num_target_layers, target.num_layers),
        ("mask_token_id", config.mask_token_id, target.mask_token_id),
    ]
    for key, mine, theirs in pairs:
        if mine != theirs:
            raise ValueError(
                f"drafter was made for another target: {key} is {mine} in the drafter "
                f"but {theirs} in target {target.name!r}"
            )
