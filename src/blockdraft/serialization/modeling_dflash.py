"""DFlash block draft model for `transformers` (`trust_remote_code`), self-contained.

`blockdraft export` copies this file into the export directory and points
`config.json["auto_map"]["AutoModel"]` at `DFlashDraftModel` (or `DFlash2DraftModel`:
block-local convolutions and the candidate selector, `propose`), so `from_pretrained(dir,
trust_remote_code=True)` builds the drafter without blockdraft installed (torch and
transformers only); otherwise transformers would quietly build a plain `Qwen3Model` and
drop `fc` / `hidden_norm`. It computes blockdraft's drafter (tested; sliding/causal layers
masked as z-lab's loader does) with z-lab/dflash's calling convention: the caller embeds
the block with the target's embedding and passes the context's features (docs/export.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


class DFlashRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def _rope_parameters(config: Qwen3Config) -> dict:
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None) or {}
    if params.get("rope_type", "default") == "default" and scaling:
        params.update(scaling)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def _inverse_frequencies(config: Qwen3Config, head_dim: int) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies (float32, computed on CPU, never stored as weights)."""
    params = _rope_parameters(config)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        exponent = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
        return (1.0 / float(params["rope_theta"]) ** exponent).float(), 1.0
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(scale)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class DFlashAttention(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or h // self.num_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.q_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)

    def _kv(self, x, cos, sin):
        shape = (*x.shape[:-1], self.num_kv_heads, self.head_dim)
        k = self.k_norm(self.k_proj(x).view(shape)).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        return _apply_rope(k, cos, sin), v

    def forward(self, x, context, cos, sin, mask):
        """x `[B, Q, H]` block; context `[B, C, H]`; cos/sin `[B, C+Q, d]`; mask or None."""
        c = context.shape[1]
        q = self.q_proj(x).view(*x.shape[:-1], self.num_heads, self.head_dim)
        q = _apply_rope(self.q_norm(q).transpose(1, 2), cos[:, c:], sin[:, c:])
        k_ctx, v_ctx = self._kv(context, cos[:, :c], sin[:, :c])
        k_blk, v_blk = self._kv(x, cos[:, c:], sin[:, c:])
        k, v = torch.cat([k_ctx, k_blk], dim=2), torch.cat([v_ctx, v_blk], dim=2)
        if self.num_kv_heads != self.num_heads:
            rep = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).flatten(-2))


class DFlashMLP(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)

    def forward(self, x, context, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), context, cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def _layer_mask(config, index, positions, c):
    """Boolean `[B, 1, Q, C+Q]` mask of layer `index` (None: the block sees everything)."""
    types = getattr(config, "layer_types", None) or []
    sliding = index < len(types) and types[index] == "sliding_attention"
    flag = getattr(config, "is_causal", None)
    causal = sliding if flag is None else bool(flag)
    window = getattr(config, "sliding_window", None) if sliding else None
    if not causal and window is None:
        return None
    query, key = positions[:, c:, None], positions[:, None, :]
    ok = torch.ones(query.shape[0], query.shape[1], key.shape[2], dtype=torch.bool,
                    device=positions.device)  # fmt: skip
    if causal:
        ok = ok & (key <= query)
    if window is not None:
        ok = ok & (query - key < window)
        if not causal:
            ok = ok & (key - query < window)
    return ok[:, None]


def _conv_rows(x, dynamic, base):
    """`out[t] = sum_o (base[o] + dynamic[t, o]) x[t - o]` over the block's rows; dynamic
    `[B, Q, taps, G]` is one coefficient per group of channels."""
    b, q, h = x.shape
    taps, groups = dynamic.shape[-2], dynamic.shape[-1]
    rows = x.view(b, q, groups, h // groups)
    out = torch.zeros_like(rows)
    for o in range(taps):
        shifted = rows if o == 0 else F.pad(rows[:, : q - o], (0, 0, 0, 0, o, 0))
        kernel = base[o].view(groups, h // groups).to(x.dtype)
        out = out + (kernel + dynamic[:, :, o, :, None]) * shifted
    return out.view(b, q, h)


class DFlashGroupedConv(nn.Module):
    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.groups = kernel_size, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def prepare(self, x):
        d = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        return _conv_rows(x, d[..., 0, :, :], self.base_kernel[0]), d[..., 1, :, :]

    def finish(self, x, d):
        return _conv_rows(x, d, self.base_kernel[1])


class DFlash2DecoderLayer(DFlashDecoderLayer):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        dflash = dict(getattr(config, "dflash_config", None) or {})
        taps, group = int(dflash["conv_kernel_size"]), int(dflash["conv_group_size"])
        self.attention_conv = DFlashGroupedConv(config.hidden_size, taps, group)
        self.mlp_conv = DFlashGroupedConv(config.hidden_size, taps, group)

    def forward(self, x, context, cos, sin, mask):
        h, d = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(h, context, cos, sin, mask), d)
        h, d = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), d)


class DFlashCandidateSelector(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        dflash = dict(getattr(config, "dflash_config", None) or {})
        rank, self.top_k = int(dflash["selector_rank"]), int(dflash["selector_top_k"])
        self.predecessor_codebook = nn.Parameter(torch.zeros(config.vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(config.vocab_size, rank))
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)

    def forward(self, hidden, logits, anchor_ids):
        """Greedy path `[B, K]` through the top-k candidates of `logits [B, K, V]`."""
        unary, candidates = torch.topk(logits, self.top_k, dim=-1)
        mod = self.hidden_projection(hidden)
        prev, path = anchor_ids, []
        for k in range(hidden.shape[1]):
            pred = self.predecessor_codebook[prev].to(mod.dtype) * mod[:, k]
            succ = self.successor_codebook[candidates[:, k]].to(mod.dtype)
            scores = unary[:, k] + (succ @ pred.unsqueeze(-1)).squeeze(-1).to(unary.dtype)
            prev = candidates[:, k].gather(-1, scores.argmax(-1, keepdim=True))[:, 0]
            path.append(prev)
        return torch.stack(path, dim=1)


class DFlashDraftModel(PreTrainedModel):
    """The DFlash drafter (see the module docstring); `forward` returns hidden states."""

    config_class = Qwen3Config
    base_model_prefix = "dflash"
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        dflash = dict(getattr(config, "dflash_config", None) or {})
        self.target_layer_ids = list(dflash.get("target_layer_ids") or [])
        self.block_size = int(dflash.get("block_size", getattr(config, "block_size", 16)))
        self.mask_token_id = dflash.get("mask_token_id")
        target_h = getattr(config, "target_hidden_size", None) or config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * target_h, config.hidden_size, bias=False)
        self.hidden_norm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(
            DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        draft_vocab = getattr(config, "draft_vocab_size", None)
        if draft_vocab is not None and draft_vocab != config.vocab_size:
            # reduced draft vocabulary (vLLM layout): target id = i + d2t[i]
            self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
            self.lm_head = nn.Linear(config.hidden_size, draft_vocab, bias=False)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, DFlashRMSNorm):
            nn.init.ones_(module.weight)

    def forward(
        self,
        noise_embedding: torch.Tensor,
        target_hidden: torch.Tensor,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states `[B, Q, H]` of a block.

        noise_embedding `[B, Q, H]`: the target's embedding of `[anchor, mask x (Q-1)]`
        (times `dflash_config.input_embedding_scale` for targets that scale embeddings);
        target_hidden `[B, C, n * H_t]`: the target features of the C context positions
        before the anchor (outputs of decoder layers `target_layer_ids`, concatenated);
        position_ids `[B, C + Q]`: positions of context then block (default `0..C+Q-1`).
        Slot k >= 1 proposes the token k positions after the anchor: logits are the
        target's LM head applied to `hidden[:, 1:]`.
        """
        b, q, _ = noise_embedding.shape
        c = target_hidden.shape[1]
        dtype = self.fc.weight.dtype
        if position_ids is None:
            position_ids = torch.arange(c + q, device=noise_embedding.device).expand(b, -1)
        head_dim = self.layers[0].self_attn.head_dim if len(self.layers) else 1
        inv_freq, scale = _inverse_frequencies(self.config, head_dim)
        freqs = position_ids.float()[..., None] * inv_freq.to(position_ids.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
        context = self.hidden_norm(self.fc(target_hidden.to(dtype)))
        x = noise_embedding.to(dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, context, cos, sin, _layer_mask(self.config, i, position_ids, c))
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
        """The target head's logits times `output_multiplier`, then softcapped (if set)."""
        dflash = dict(getattr(self.config, "dflash_config", None) or {})
        logits = F.linear(hidden, head_weight.to(hidden.dtype))
        logits = logits * float(dflash.get("output_multiplier", 1.0))
        cap = dflash.get("final_logit_softcapping")
        return torch.tanh(logits / float(cap)) * float(cap) if cap else logits


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash2: conv decoder layers and the candidate selector (module docstring)."""

    _no_split_modules = ["DFlash2DecoderLayer"]

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        self.layers = nn.ModuleList(
            DFlash2DecoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.candidate_selector = DFlashCandidateSelector(config)
        self.post_init()

    def propose(self, hidden, anchor_ids, head_weight):
        """Greedy proposals `[B, K]` from `hidden[:, 1:]` of `forward` and the anchors `[B]`."""
        return self.candidate_selector(hidden, self.compute_logits(hidden, head_weight), anchor_ids)
