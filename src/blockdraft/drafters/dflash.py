"""The DFlash parallel block drafter: `BlockDrafter` and `DrafterState`.

One forward turns a block `[x_n, MASK x K]` into K proposals: Qwen3-style decoder layers
at the target's width (like the public DFlash drafters, so engines load what is trained
here) into which the target's features of positions `< n` (projected by `fc`, normed) are
injected as keys/values, with bidirectional attention inside the block and the target's
frozen embedding and LM head (never saved). `forward_blocks` (training and scoring: every
block of a sequence in one pass) and the context KV cache of `DrafterState` (one block at
a time) agree exactly. Interface and conventions: docs/architecture.md ("drafters"); the
math: docs/methods.md, "The drafter".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from blockdraft.drafters.block_attention import (
    ATTENTION_IMPLS,
    BlockAttention,
    block_attention_mask,
    default_attention_impl,
    one_block_mask,
)
from blockdraft.drafters.config import ARCHS, DrafterConfig, check_target_compatible
from blockdraft.drafters.draft_vocab import d2t_offsets, draft_ids_from_d2t
from blockdraft.drafters.layers import DecoderLayer, RMSNorm, rope_cos_sin, rope_inverse_frequencies
from blockdraft.drafters.lookup_inputs import lookup_block_inputs
from blockdraft.sampling import sample  # inverse CDF, generator on any device

__all__ = [
    "ARCHS",
    "ATTENTION_IMPLS",
    "BlockDrafter",
    "DrafterConfig",
    "DrafterState",
    "block_attention_mask",
    "check_target_compatible",
    "sample_from_logits",
]


def sample_from_logits(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of `logits [..., V]`; return (tokens, q they were drawn from).

    temperature 0 is greedy: the token is the argmax and q is the one-hot point mass on
    it (the distribution actually used, so lossless verification stays exact).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(-1)
        q = torch.zeros_like(logits).scatter_(-1, tokens.unsqueeze(-1), 1.0)
        return tokens, q

    q = torch.softmax(logits / temperature, dim=-1)
    return sample(q, generator), q


@dataclass
class DrafterState:
    """Per-layer context K/V `[1, kv_heads, length, head_dim]` of verified positions 0..length-1."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    # lookup_inputs drafters: prompt lookup's proposal over the verified text for the next
    # block; the decoding loop sets it every round (drafters/lookup_inputs.py)
    lookup: list[int] | None = None

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[2])

    def crop(self, length: int) -> None:
        """Keep the context of the first `length` positions (drop a rejected suffix)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a drafter state of length {self.length} to {length}")
        self.keys = [k[:, :, :length] for k in self.keys]
        self.values = [v[:, :, :length] for v in self.values]


class _Shared:
    """Holds the target's frozen embedding and head without registering them as submodules,
    and the target itself (what a saved checkpoint records it was made for)."""

    def __init__(self, embed: nn.Module, head: nn.Module, target: Any = None) -> None:
        self.embed, self.head, self.target = embed, head, target


class BlockDrafter(nn.Module):
    """DFlash block drafter. Call `bind_target(target)` before use."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = c = config
        self.fc = nn.Linear(c.feature_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(self._decoder_layer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        hf_rope = c.hf_rope_config() if c.rope_scaling else None
        # A plain float32 tensor, not a buffer: `.to(bfloat16)` must not round the frequencies.
        self.inv_freq, self.rope_scale = rope_inverse_frequencies(
            c.head_dim, c.rope_theta, c.rope_scaling, hf_rope
        )
        if c.draft_vocab_size is not None:
            # EAGLE-3/vLLM layout: d2t[i] = target_id(i) - i; filled by set_draft_vocab or load.
            self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self._shared: _Shared | None = None
        self._head_rows: tuple[tuple, torch.Tensor] | None = None  # head_weight's rows, keyed
        # How forward_blocks attends: "auto" (per device) or one of ATTENTION_IMPLS; a
        # runtime choice (all are exact), not part of the config or checkpoint.
        self.attention = "auto"
        self.apply(self._init_weights)

    @staticmethod
    def _decoder_layer(c: DrafterConfig) -> nn.Module:
        """One decoder layer (DFlash2 adds its convolutions around the sublayers)."""
        return DecoderLayer(
            c.hidden_size,
            c.intermediate_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.rms_norm_eps,
            c.qk_norm,
            c.attention_bias,
        )

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    # --- the shared target modules ---------------------------------------------------------
    def bind_target(self, target: Any) -> BlockDrafter:
        """Share the target's frozen embedding and LM head (never saved with the drafter)."""
        check_target_compatible(self.config, target)
        self._shared = _Shared(target.embed_tokens, target.lm_head, target)
        return self

    @property
    def bound_target(self) -> Any:
        """The target `bind_target` bound (None before)."""
        return None if self._shared is None else self._shared.target

    def _need_target(self) -> _Shared:
        if self._shared is None:
            raise RuntimeError("drafter has no target: call drafter.bind_target(target) first")
        return self._shared

    def copy_target_layers(self, target: Any) -> None:
        """Start each drafter layer as a copy of one of the target's top layers (drafter
        layer i <- target layer L - N + i). Why: those layers already turn hidden states
        into next-token predictions, so the drafter starts from them rather than from
        noise. Every projection must find a target parameter of the same name and shape (a
        Llama/Qwen-style decoder layer), else a ValueError names it; the drafter's own
        query/key norms stay as initialised where the target has none (Llama)."""
        source = getattr(target.model.get_decoder(), "layers", None)
        n = len(self.layers)
        if source is None or len(source) < n:
            raise ValueError("drafter.init_layers_from_target: the target has too few layers")
        for mine, theirs in zip(self.layers, list(source)[-n:], strict=True):
            wanted, found = mine.state_dict(), theirs.state_dict()
            for name, tensor in wanted.items():
                if name not in found and name.endswith(("q_norm.weight", "k_norm.weight")):
                    continue
                if name not in found or found[name].shape != tensor.shape:
                    shape = tuple(found[name].shape) if name in found else "missing"
                    raise ValueError(
                        f"drafter.init_layers_from_target: the target layer's {name} is "
                        f"{shape}, the drafter's {tuple(tensor.shape)}"
                    )
                wanted[name] = found[name].detach().to(tensor.dtype)
            mine.load_state_dict(wanted)

    def set_draft_vocab(self, draft_ids: torch.Tensor) -> None:
        """Install the reduced vocabulary (target ids, see draft_vocab.most_frequent_tokens)."""
        if (
            self.config.draft_vocab_size is None
            or draft_ids.numel() != self.config.draft_vocab_size
        ):
            raise ValueError(
                f"draft vocab of {draft_ids.numel()} ids does not match "
                f"draft_vocab_size {self.config.draft_vocab_size}"
            )
        self.d2t.copy_(d2t_offsets(draft_ids.to(self.d2t.device)))

    @property
    def draft_ids(self) -> torch.Tensor | None:
        """Target ids of the draft vocabulary in draft-id order, or None for the full vocab."""
        return draft_ids_from_d2t(self.d2t) if self.config.draft_vocab_size is not None else None

    @property
    def shared_head_weight(self) -> torch.Tensor:
        """The target's full `[V, H]` LM-head weight the drafter shares (never saved)."""
        return self._need_target().head.weight

    @property
    def head_weight(self) -> torch.Tensor:
        """`[V_draft, H]` LM-head rows the drafter scores (target ids -> rows via draft_ids).
        The gathered rows are kept until the head or the draft vocabulary changes: a drafter
        that drafts slot by slot asks for them every round, and the gather out of a large
        vocabulary was a visible part of its draft (research/gemma.md). A
        frozen head only: a trainable one gets a fresh, differentiable gather."""
        weight = self._need_target().head.weight
        if self.config.draft_vocab_size is None:
            return weight
        if weight.requires_grad and torch.is_grad_enabled():
            return weight.index_select(0, self.draft_ids.to(weight.device))
        key = (weight.data_ptr(), weight._version, self.d2t.data_ptr(), self.d2t._version)
        if self._head_rows is None or self._head_rows[0] != key:
            # never an inference tensor: rows first gathered in an inference-mode pass (EDR's
            # scoring) also serve the training forward, which saves them for backward
            with torch.inference_mode(False), torch.no_grad():
                rows = weight.index_select(0, self.draft_ids.to(weight.device))
            self._head_rows = (key, rows)
        return self._head_rows[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._need_target().embed(ids).to(self.dtype)

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """`hidden_norm(fc(features))`: target features `[..., F]` -> drafter context `[..., H]`."""
        if features.shape[-1] != self.fc.in_features:
            raise ValueError(
                f"target features have size {features.shape[-1]}, "
                f"the drafter expects {self.fc.in_features} "
                f"({len(self.config.target_layer_ids)} layers x {self.config.target_hidden_size})"
            )
        return self.hidden_norm(self.fc(features.to(self.dtype)))

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:  # follows the drafter after .to(device)
            self.inv_freq = self.inv_freq.to(positions.device)
        return rope_cos_sin(self.inv_freq, self.rope_scale, positions, self.dtype)

    # --- training: many blocks per sequence in one pass -------------------------------------
    def forward_blocks(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        anchors: torch.Tensor,
        attention: str | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states `[B, A, K, H]` of slots 1..K of every block.

        features `[B, T, F]`, input_ids `[B, T]`, anchors `[B, A]` sequence indices of the
        anchors (-1 = padding; its outputs are finite but meaningless). `attention`: how
        blocks attend (`block_attention.py`: dense | tiled | flex, all exact); None =
        `self.attention`, whose default "auto" picks per device.
        """
        B, T = input_ids.shape
        if features.shape[:2] != (B, T) or anchors.dim() != 2 or anchors.shape[0] != B:
            raise ValueError(
                f"shape mismatch: features {tuple(features.shape)}, "
                f"input_ids {tuple(input_ids.shape)}, "
                f"anchors {tuple(anchors.shape)}"
            )
        if anchors.numel() and (anchors.max() >= T or anchors.min() < -1):
            raise ValueError(f"anchors must be in [0, {T}) or -1 for padding")
        Kb, A = self.config.block_size, anchors.shape[1]
        ctx = self.project_context(features)
        ctx_cos, ctx_sin = self._rope(torch.arange(T, device=ctx.device).expand(B, T))

        start = anchors.clamp(min=0)
        block_ids = torch.full(
            (B, A, Kb), self.config.mask_token_id, dtype=torch.long, device=input_ids.device
        )
        block_ids[:, :, 0] = torch.where(
            anchors >= 0, input_ids.gather(1, start), self.config.mask_token_id
        )
        if self.config.lookup_inputs:
            looked_up = lookup_block_inputs(input_ids, anchors, Kb - 1)
            block_ids[:, :, 1:] = torch.where(looked_up >= 0, looked_up, self.config.mask_token_id)
        x = self.embed(block_ids).view(B, A * Kb, -1)
        positions = (start[:, :, None] + torch.arange(Kb, device=start.device)).view(B, A * Kb)
        cos, sin = self._rope(positions)
        impl = attention or self.attention
        if impl == "auto":
            impl = default_attention_impl(x.device)
        masks: dict[tuple[bool, int | None], BlockAttention] = {}  # one per layer kind

        for i, layer in enumerate(self.layers):
            kind = self.config.layer_attention(i)
            if kind not in masks:
                masks[kind] = BlockAttention(
                    anchors, T, Kb, impl, dtype=x.dtype, causal=kind[0], window=kind[1]
                )
            ctx_k, ctx_v = layer.self_attn.key_value(ctx, ctx_cos, ctx_sin)
            x = layer(x, ctx_k, ctx_v, cos, sin, masks[kind])
        # slot 0 predicts nothing: dropped first, so the LM head gets contiguous rows (not a bmm)
        return self.norm(x.view(B, A, Kb, -1)[:, :, 1:])

    forward = forward_blocks

    # --- logits ----------------------------------------------------------------------------
    def _prev_token_bias(self, prev_tokens: torch.Tensor | None) -> torch.Tensor | None:
        """Draft-space logit bias from the previous token; none for the parallel drafter."""
        return None

    def _finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Softcap (if the target has one) and expand draft-vocab logits to target space."""
        return self.to_target_vocab(self._softcap(logits))

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        """z-lab's logit transform: times `output_multiplier`, then the softcap if any."""
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    def to_target_vocab(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """`[..., V_draft]` -> `[..., V]` target-vocab logits, -inf outside the draft vocab."""
        ids = self.draft_ids
        if ids is None:
            return draft_logits
        shape = (*draft_logits.shape[:-1], self.config.vocab_size)
        full = draft_logits.new_full(shape, float("-inf"))
        return full.index_copy(-1, ids.to(draft_logits.device), draft_logits)

    def compute_draft_logits(
        self, hidden: torch.Tensor, prev_tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits `[..., K, V_draft]` in the drafter's own vocabulary (column j = target id
        `draft_ids[j]`): argmax, softmax, top-k/p and q(x) equal `compute_logits`' (tokens
        outside have -inf there) at 4k columns instead of 262k for the Gemma drafter.
        prev_tokens `[..., K]`: the token at slot k-1 (semi-AR and DFlash2 drafters)."""
        return self.slot_logits(hidden, prev_tokens, self.base_logits(hidden))

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The part of `compute_draft_logits` that does not depend on the previous token
        (here the head's product): a drafter that drafts slot by slot computes it once per
        block, one `[K, H] x [H, V_draft]` product instead of K one-row ones. In the wider
        of the drafter's and the shared head's dtypes: a bf16 drafter beside an fp32 target
        gets fp32 logits, whose near-ties do not hinge on bf16's 8-bit mantissa (so the
        loop's argmax and the evaluator's agree; docs/decoding.md, "Device and dtype")."""
        weight = self.head_weight
        dtype = torch.promote_types(hidden.dtype, weight.dtype)
        return torch.nn.functional.linear(
            hidden.to(dtype), weight.to(device=hidden.device, dtype=dtype)
        )

    def slot_logits(
        self, hidden: torch.Tensor, prev_tokens: torch.Tensor | None, base: torch.Tensor
    ) -> torch.Tensor:
        """`compute_draft_logits` from its `base_logits`."""
        bias = self._prev_token_bias(prev_tokens)
        if bias is not None:
            base = base + bias.to(base.dtype)
        return self._softcap(base)

    def compute_logits(
        self, hidden: torch.Tensor, prev_tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits `[..., K, V]` in *target* vocab space (-inf outside a reduced draft vocab)."""
        return self.to_target_vocab(self.compute_draft_logits(hidden, prev_tokens))

    # --- inference: one block at a time against a context cache ------------------------------
    def new_state(self) -> DrafterState:
        c, dev = self.config, self.fc.weight.device
        shape = (1, c.num_key_value_heads, 0, c.head_dim)
        keys = [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in self.layers]
        values = [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in self.layers]
        return DrafterState(keys, values)

    @torch.no_grad()
    def extend_context(
        self, state: DrafterState, features_new: torch.Tensor, start_position: int
    ) -> None:
        """Append context K/V for verified positions `start_position ..` (features `[1, t, F]`)."""
        if features_new.dim() == 2:
            features_new = features_new.unsqueeze(0)
        if features_new.shape[0] != 1:
            raise ValueError(
                f"extend_context takes one sequence, got batch {features_new.shape[0]}"
            )
        if start_position != state.length:
            raise ValueError(
                f"context must grow contiguously: state holds {state.length} positions, "
                f"got start_position {start_position} (crop the state first)"
            )
        t = features_new.shape[1]
        ctx = self.project_context(features_new)
        cos, sin = self._rope(
            torch.arange(start_position, start_position + t, device=ctx.device)[None]
        )
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.key_value(ctx, cos, sin)
            state.keys[i] = torch.cat([state.keys[i], k], dim=2)
            state.values[i] = torch.cat([state.values[i], v], dim=2)

    @torch.no_grad()
    def draft_hidden(
        self, state: DrafterState, anchor_id: int, anchor_position: int
    ) -> torch.Tensor:
        """Final-normed hidden `[K, H]` of slots 1..K for the block anchored at `anchor_position`.

        The block sees context positions `< anchor_position`; the state must hold at least
        those (extra cached positions are ignored).
        """
        if state.length < anchor_position:
            raise ValueError(
                f"drafter state holds {state.length} context positions but the anchor at "
                f"{anchor_position} needs {anchor_position}"
            )
        c, dev = self.config, self.fc.weight.device
        ids = torch.full((1, c.block_size), c.mask_token_id, dtype=torch.long, device=dev)
        ids[0, 0] = int(anchor_id)
        if c.lookup_inputs:
            if state.lookup is None:
                raise ValueError(
                    "this drafter reads prompt lookup's proposals (lookup_inputs): set "
                    "state.lookup to the lookup over the verified text before drafting"
                )
            if state.lookup:
                ids[0, 1 : 1 + len(state.lookup)] = torch.tensor(state.lookup, device=dev)
        x = self.embed(ids)
        cos, sin = self._rope(
            torch.arange(anchor_position, anchor_position + c.block_size, device=dev)[None]
        )
        for i, layer in enumerate(self.layers):
            k, v = state.keys[i][:, :, :anchor_position], state.values[i][:, :, :anchor_position]
            causal, window = c.layer_attention(i)
            mask = one_block_mask(anchor_position, c.block_size, causal, window, dev)
            x = layer(x, k, v, cos, sin, mask)
        return self.norm(x)[0, 1:]

    @torch.no_grad()
    def draft_logits(
        self, state: DrafterState, anchor_id: int, anchor_position: int
    ) -> torch.Tensor:
        """Parallel logits `[K, V]` of one block (no previous-token correction)."""
        return self.compute_logits(self.draft_hidden(state, anchor_id, anchor_position))

    @torch.no_grad()
    def sample_block(
        self,
        state: DrafterState,
        anchor_id: int,
        anchor_position: int,
        temperature: float,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Propose K tokens; return (tokens `[K]`, q `[K, V]` they were drawn from).

        temperature 0: argmax tokens, q one-hot; temperature T > 0: q = softmax(logits / T).
        """
        return sample_from_logits(
            self.draft_logits(state, anchor_id, anchor_position), temperature, generator
        )
