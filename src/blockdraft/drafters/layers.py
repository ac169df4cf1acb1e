"""Building blocks of the DFlash drafter: RMSNorm, RoPE, context-injected attention, MLP.

The decoder layer is a Qwen3-style pre-norm block whose attention differs from a causal
LM's in one way: keys/values are `[k_proj(ctx); k_proj(block)]` (the projected target
features, then the block) and queries come from the block only. A layer's context K/V
depend only on the context, so they are computed once (training: all T positions,
shared by every block; inference: once per verified position, cached) and handed in.
Parameter names are those of the public DFlash checkpoints, so a state_dict loads in
SGLang, vLLM and z-lab/dflash unchanged (docs/export.md).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from blockdraft.drafters.block_attention import BlockAttention


class RMSNorm(nn.Module):
    """`weight * x / rms(x)`, computed in float32 like HF Llama/Qwen3 (weight init 1)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


# --- rotary position embedding -----------------------------------------------------------
_DYNAMIC_ROPE = {"dynamic", "longrope"}


def rope_inverse_frequencies(
    head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None, hf_config: Any = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and cos/sin scale of the drafter's RoPE.

    Plain RoPE is computed here; scaled variants (llama3, linear, yarn) reuse
    transformers' reference init functions on the drafter's own HF config, so a Llama-3.1
    target's drafter rotates exactly as the target (and the serving engines) do. Types
    whose frequencies depend on the running sequence length are refused: a drafter must
    rotate a position identically no matter how long the context is.
    """
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if rope_type == "default":
        exponent = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
        return (1.0 / rope_theta**exponent).float(), 1.0
    if rope_type in _DYNAMIC_ROPE:
        raise ValueError(
            f"rope type {rope_type!r} is sequence-length dependent; not supported by the drafter"
        )
    # lazy: transformers takes seconds to import; only non-default RoPE needs it
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS or hf_config is None:
        raise ValueError(f"unknown rope type {rope_type!r}")
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scale)


def rope_cos_sin(
    inv_freq: torch.Tensor, scale: float, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin `[..., L, head_dim]` for integer positions `[..., L]` (half-split layout)."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x [B, heads, L, d]` by position; cos/sin are `[B, L, d]` (neox/HF layout)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


# --- attention --------------------------------------------------------------------------
class ContextAttention(nn.Module):
    """Block queries attending to `[context K/V; block K/V]` with the same projections."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        qk_norm: bool,
        bias: bool,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads {num_heads} not divisible by "
                f"num_key_value_heads {num_kv_heads}"
            )
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        # Qwen3-style per-head norms; Identity keeps a no-qk-norm drafter's state_dict clean.
        self.q_norm: nn.Module = RMSNorm(head_dim, eps) if qk_norm else nn.Identity()
        self.k_norm: nn.Module = RMSNorm(head_dim, eps) if qk_norm else nn.Identity()

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(*x.shape[:-1], n, self.head_dim)

    def key_value(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Normed, rotated keys and values `[B, kv_heads, L, d]` of `x [B, L, H]`."""
        k = self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)).transpose(1, 2)
        v = self._heads(self.v_proj(x), self.num_kv_heads).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | BlockAttention | None,
    ) -> torch.Tensor:
        """`x [B, L, H]` block states; `ctx_k/ctx_v [B, kv_heads, T, d]`.

        mask: None (one block, sees all of ctx), a boolean `[B, 1, L, T+L]`, or the
        `BlockAttention` layout of `forward_blocks`, which then does the attending.
        """
        q = self.q_norm(self._heads(self.q_proj(x), self.num_heads)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k, v = self.key_value(x, cos, sin)
        if isinstance(mask, BlockAttention):
            return self.o_proj(mask.attend(q, k, v, ctx_k, ctx_v).transpose(1, 2).flatten(-2))
        k = torch.cat([ctx_k, k], dim=2)
        v = torch.cat([ctx_v, v], dim=2)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads
        )
        return self.o_proj(out.transpose(1, 2).flatten(-2))


class GatedMLP(nn.Module):
    """`down(silu(gate(x)) * up(x))`, the Llama/Qwen3 MLP."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention over [context; block], then the gated MLP."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        qk_norm: bool,
        bias: bool,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.self_attn = ContextAttention(
            hidden_size, num_heads, num_kv_heads, head_dim, eps, qk_norm, bias
        )
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = GatedMLP(hidden_size, intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | BlockAttention | None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx_k, ctx_v, cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))
