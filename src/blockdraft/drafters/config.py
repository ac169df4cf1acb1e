"""`DrafterConfig`: what fixes a drafter's shapes and its contract with its target.

Kept apart from the model code so that checkpoints, the trainer's config and the CLI can
read and validate drafter configs without building a model. `for_target` copies the
attention geometry from a Qwen3 / Llama / Gemma 3 target config;
`check_target_compatible` is the one place that decides whether a drafter fits a target.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

ARCHS = ("dflash", "semi_ar")


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
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DrafterConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown drafter config key(s) {unknown}")
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
