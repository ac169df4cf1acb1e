"""A lean batch-1 forward for small Qwen3/Llama targets on a CPU: the same math in fewer ops.

At `tiny`'s size a decoding forward is dispatch, and HF's spends it on generality (masks,
a growing cache, rotary tables per call, one product per projection). This one reads the
HF model's weights and runs each layer as one q/k/v and one gate/up product (weight rows
concatenated), one norm pass over all q and k heads, one rotation, a preallocated K/V
cache written in place and cropped by a length, and a mask sliced from a fixed table:
logits equal HF's to float rounding. Only fp32 CPU models of the plain shape whose decoder
weights are all below MKL's packing size; above it a forward is compute, and the fused copy
would cost memory for nothing. Numbers: docs/decoding.md.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from blockdraft.kernels.packed_linear import MIN_PACKED_ELEMENTS, pack_weight, tensor_version

SUPPORTED = ("Qwen3ForCausalLM", "LlamaForCausalLM")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm `weight * x * rsqrt(mean(x^2) + eps)` as HF's and the drafter's modules
    compute it: in fp32, back to x's dtype (fp32 in, fp32 out, with no casts)."""
    if x.dtype == torch.float32:  # no casts: at `tiny`'s size every op is dispatch
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_tables(
    inv_freq: torch.Tensor, scale: float, n: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos / signed sin `[n, d]` of positions 0..n-1 (rotate-half as a roll)."""
    freqs = torch.arange(n, dtype=torch.float32)[:, None] * inv_freq[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    sin = emb.sin() * scale
    sin[:, : head_dim // 2] = -sin[:, : head_dim // 2]
    return emb.cos() * scale, sin


class LeanCache:
    """Per-layer K/V `[kv_heads, capacity, d]` filled up to `length`; grows by doubling."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int) -> None:
        self.keys = [torch.zeros(kv_heads, capacity, head_dim) for _ in range(layers)]
        self.values = [torch.zeros(kv_heads, capacity, head_dim) for _ in range(layers)]
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1]

    def reserve(self, length: int) -> None:
        if length <= self.capacity:
            return
        size = max(length, 2 * self.capacity)
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                new = old.new_zeros(old.shape[0], size, old.shape[2])
                new[:, : self.length] = old[:, : self.length]
                store[i] = new

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} positions to {length}")
        self.length = length


@dataclass
class _Layer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv: torch.Tensor  # [H, (heads + 2 kv_heads) d], transposed for torch.mm
    qk_norm: torch.Tensor | None  # [heads + kv_heads, d]
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class LeanTarget:
    """The lean forward of one HF model (see module doc); `of(model, layer_ids)` or None."""

    def __init__(self, model: Any, layer_ids: list[int]) -> None:
        cfg = model.config
        inner = model.model
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.eps = cfg.rms_norm_eps
        self.inter = cfg.intermediate_size
        self.layer_ids = list(layer_ids)
        self.embed = inner.embed_tokens.weight.detach()
        self.norm = inner.norm.weight.detach()
        head = model.get_output_embeddings().weight.detach()
        self.head_t = head.t().contiguous()
        self.head_packed = pack_weight(head)  # several rows: MKL's packed product
        self.inv_freq = inner.rotary_emb.inv_freq.float()
        self.rope_scale = float(getattr(inner.rotary_emb, "attention_scaling", 1.0))
        self.layers = [self._layer(layer) for layer in inner.layers]
        self.calls = 0  # forwards run (bench/decode.py counts them)
        self._tables(1024)

    def _layer(self, layer: Any) -> _Layer:
        a, mlp = layer.self_attn, layer.mlp
        qk = None
        if hasattr(a, "q_norm"):
            qk = torch.cat(
                [a.q_norm.weight.expand(self.heads, -1), a.k_norm.weight.expand(self.kv_heads, -1)]
            )
        qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        return _Layer(
            ln1=layer.input_layernorm.weight.detach(),
            ln2=layer.post_attention_layernorm.weight.detach(),
            qkv=qkv.detach().t().contiguous(),
            qk_norm=None if qk is None else qk.detach().contiguous(),
            o=a.o_proj.weight.detach().t().contiguous(),
            gate_up=gate_up.detach().t().contiguous(),
            down=mlp.down_proj.weight.detach().t().contiguous(),
        )

    @staticmethod
    def supports(model: Any) -> bool:
        """Whether `model` has the shape this forward computes exactly (module doc)."""
        cfg = getattr(model, "config", None)
        if type(model).__name__ not in SUPPORTED or cfg is None:
            return False
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        params = list(model.parameters())
        layers = list(model.model.layers.parameters())
        layer_types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
        return (
            all(p.numel() < MIN_PACKED_ELEMENTS for p in layers)
            and all(p.dtype == torch.float32 and p.device.type == "cpu" for p in params)
            and rope.get("rope_type", "default") == "default"
            and not getattr(cfg, "attention_bias", False)
            and not getattr(cfg, "mlp_bias", False)
            and getattr(cfg, "hidden_act", "silu") == "silu"
            and layer_types == {"full_attention"}
        )

    @classmethod
    def of(cls, model: Any, layer_ids: list[int]) -> LeanTarget | None:
        """The lean forward of `model`, built once and rebuilt when a weight changes in
        place (tensor versions); None where `supports` says no."""
        if not cls.supports(model):
            return None
        key = (tuple(layer_ids), tuple(tensor_version(p) for p in model.parameters()))
        cached = _LEAN.get(model)
        if cached is None or cached[0] != key:
            cached = (key, cls(model, layer_ids))
            _LEAN[model] = cached
        return cached[1]

    def _tables(self, n: int) -> None:
        """cos / signed sin `[n, d]` (rotate-half as a roll) and the causal mask `[n, n]`."""
        self.cos, self.sin = rope_tables(self.inv_freq, self.rope_scale, n, self.head_dim)
        self.mask = torch.ones(n, n, dtype=torch.bool).tril()

    def new_cache(self, length: int = 0) -> LeanCache:
        return LeanCache(len(self.layers), self.kv_heads, self.head_dim, max(256, 2 * length))

    def forward(
        self, ids: torch.Tensor, cache: LeanCache, features: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`ids [T]` at positions `cache.length..` -> (final-normed hidden `[T, H]`, the
        chosen layers' raw outputs `[T, F]` as `Target.forward` gives them, or None)."""
        T, start = ids.shape[0], cache.length
        end = start + T
        self.calls += 1
        if end > self.cos.shape[0]:
            self._tables(max(end, 2 * self.cos.shape[0]))
        cache.reserve(end)
        cos, sin = self.cos[start:end, None], self.sin[start:end, None]
        mask = self.mask[start:end, :end] if T > 1 else None
        h, d, kvh, eps = self.heads, self.head_dim, self.kv_heads, self.eps
        x = self.embed[ids]
        kept: dict[int, torch.Tensor] = {}
        for i, w in enumerate(self.layers):
            qkv = torch.mm(rms_norm(x, w.ln1, eps), w.qkv)
            qk = qkv[:, : (h + kvh) * d].view(T, h + kvh, d)
            if w.qk_norm is not None:
                qk = rms_norm(qk, w.qk_norm, eps)
            # HF: x * cos + cat(-x2, x1) * sin; the sign lives in `sin`, the swap is a roll
            qk = (qk * cos + qk.roll(d // 2, -1) * sin).transpose(0, 1)  # [h + kvh, T, d]
            cache.keys[i][:, start:end] = qk[h:]
            cache.values[i][:, start:end] = qkv[:, (h + kvh) * d :].view(T, kvh, d).transpose(0, 1)
            att = F.scaled_dot_product_attention(
                qk[None, :h],
                cache.keys[i][None, :, :end],
                cache.values[i][None, :, :end],
                attn_mask=mask,
                enable_gqa=h != kvh,
            )
            x = x + torch.mm(att[0].transpose(0, 1).reshape(T, h * d), w.o)
            gu = torch.mm(rms_norm(x, w.ln2, eps), w.gate_up)
            x = x + torch.mm(F.silu(gu[:, : self.inter]) * gu[:, self.inter :], w.down)
            if features and i in self.layer_ids:
                kept[i] = x
        cache.length = end
        final = rms_norm(x, self.norm, eps)
        if not features:
            return final, None
        return final, torch.cat([kept[i] for i in self.layer_ids], dim=-1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[T, V]` logits of final-normed hidden rows."""
        if hidden.shape[0] > 1 and self.head_packed is not None:
            return self.head_packed(hidden)
        return torch.mm(hidden, self.head_t)


_LEAN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
