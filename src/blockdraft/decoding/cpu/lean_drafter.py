"""A lean decoding round for a parallel block drafter on a CPU: context and block in one pass.

The loop pays a drafter's dispatch twice per round (`extend_context` for the verified
positions, `draft_hidden` for the next block), yet both project rows with the same layer
weights at contiguous positions (context a..a+m, block a+m+1..). So one pass does both:
per layer one q/k/v product over [new context rows; block rows] (q, k, v and gate, up
each fused into one weight), one norm pass, one rotation; context K/V land in a
preallocated cache and the block's right after them (scratch), and the block attends to
`cache[:anchor + block]` with no mask. `extend_context` only records features;
`draft_hidden` does the work. DFlash2's block-local convolutions wrap the block's rows
around each sublayer as in `ConvDecoderLayer` (context rows never pass through them).
Weights large enough to gain are packed once (kernels/packed_linear.py: MKL for fp32,
oneDNN for bf16). The round computes in the drafter's own dtype, op for op as the module
does (norms in fp32, products and residuals in the drafter's dtype), so its hidden states
equal `BlockDrafter`'s to that dtype's rounding. fp32 or bf16 CPU drafters whose every
layer attends to the whole context and block (no causal or sliding layers) only.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F

from blockdraft.decoding.cpu.lean_target import rms_norm, rope_tables
from blockdraft.drafters.dflash2 import ConvDecoderLayer, grouped_dynamic_conv
from blockdraft.drafters.layers import DecoderLayer
from blockdraft.kernels.packed_linear import (
    MIN_PACKED_ELEMENTS,
    onednn_linear,
    pack_bf16_onednn,
    pack_weight,
)

DTYPES = (torch.float32, torch.bfloat16)  # the drafter dtypes the lean round computes in


class _Product:
    """`x @ W.T` for one `[out, in]` weight: MKL-packed (fp32) or oneDNN-packed (bf16)
    where that gains, else a plain product with the transpose kept contiguous."""

    def __init__(self, weight: torch.Tensor) -> None:
        weight = weight.detach().contiguous()
        self.packed = pack_weight(weight)
        bf16 = weight.dtype == torch.bfloat16 and weight.numel() >= MIN_PACKED_ELEMENTS
        self.onednn = pack_bf16_onednn(weight) if bf16 else None
        packed = self.packed is not None or self.onednn is not None
        self.transposed = None if packed else weight.t().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x)
        if self.onednn is not None:
            return onednn_linear(x, self.onednn)
        return torch.mm(x, self.transposed)


def _conv_weights(conv: torch.nn.Module) -> dict[str, Any]:
    """One `GroupedDynamicConv`'s weights: the projection of its dynamic coefficients
    (both sides of the sublayer) and the base kernels `[2, taps, H]`."""
    return dict(
        projection=_Product(conv.kernel_projection.weight),
        base=conv.base_kernel.detach(),
        taps=conv.kernel_size,
        groups=conv.groups,
    )


def _conv_prepare(conv: dict[str, Any], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`GroupedDynamicConv.prepare` on one block's rows `[B, H]`: (convolved rows, the
    coefficients `finish` uses)."""
    dynamic = conv["projection"](x).view(1, x.shape[0], 2, conv["taps"], conv["groups"])
    out = grouped_dynamic_conv(x[None], dynamic[..., 0, :, :], conv["base"][0], x.shape[0])
    return out[0], dynamic[..., 1, :, :]


def _conv_finish(conv: dict[str, Any], x: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
    return grouped_dynamic_conv(x[None], dynamic, conv["base"][1], x.shape[0])[0]


class LeanDraftState:
    """Context K/V `[kv_heads, capacity, d]` per layer for positions < `length`, plus
    the verified features not yet projected (`pending`, positions length..)."""

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        shape = (kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype) for _ in range(layers)]
        self.done = 0  # positions whose K/V are in the cache
        self.pending: list[torch.Tensor] = []
        self.lookup = None

    @property
    def length(self) -> int:
        return self.done + sum(p.shape[0] for p in self.pending)

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a drafter state of length {self.length} to {length}")
        if length <= self.done:
            self.done, self.pending = length, []
            return
        keep, out = length - self.done, []
        for p in self.pending:
            out.append(p[:keep])
            keep -= out[-1].shape[0]
            if keep == 0:
                break
        self.pending = out

    def reserve(self, length: int) -> None:
        cap = self.keys[0].shape[1]
        if length <= cap:
            return
        size = max(length, 2 * cap)
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                new = old.new_zeros(old.shape[0], size, old.shape[2])
                new[:, : self.done] = old[:, : self.done]
                store[i] = new


class LeanDrafter:
    """The lean round of one `BlockDrafter` or `DFlash2Drafter` (module doc); `of(drafter)`
    caches it."""

    def __init__(self, drafter: Any) -> None:
        c = drafter.config
        self.config = c
        self.dtype = drafter.dtype
        self.heads, self.kv_heads, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        self.eps = c.rms_norm_eps
        self.inter = c.intermediate_size
        self.block = c.block_size
        self.fc = _Product(drafter.fc.weight)
        self.hidden_norm = drafter.hidden_norm.weight.detach()
        self.norm = drafter.norm.weight.detach()
        # the target's embedding, not the drafter (cached weakly keyed by it): a plain
        # table is indexed directly, a scaled one (Gemma) goes through its module
        embed = drafter._need_target().embed
        plain = type(embed) is torch.nn.Embedding and embed.weight.dtype == self.dtype
        self.embed_table = embed.weight.detach() if plain else None
        self.embed_module = None if plain else embed
        self.block_ids = torch.full((self.block,), c.mask_token_id, dtype=torch.long)
        self.inv_freq, self.scale = drafter.inv_freq.float(), drafter.rope_scale
        self.layers = []
        for layer in drafter.layers:
            a, mlp = layer.self_attn, layer.mlp
            qk = None
            if c.qk_norm:
                qk = torch.cat(
                    [
                        a.q_norm.weight.expand(self.heads, -1),
                        a.k_norm.weight.expand(self.kv_heads, -1),
                    ]
                ).detach()
            conv = isinstance(layer, ConvDecoderLayer)
            self.layers.append(
                dict(
                    ln1=layer.input_layernorm.weight.detach(),
                    ln2=layer.post_attention_layernorm.weight.detach(),
                    qkv=_Product(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])),
                    qk=qk,
                    o=_Product(a.o_proj.weight),
                    gu=_Product(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
                    down=_Product(mlp.down_proj.weight),
                    attention_conv=_conv_weights(layer.attention_conv) if conv else None,
                    mlp_conv=_conv_weights(layer.mlp_conv) if conv else None,
                )
            )
        self._tables(1024)

    @staticmethod
    def supports(drafter: Any) -> bool:
        """An fp32 or bf16 CPU drafter of plain (DFlash) or convolution (DFlash2) decoder layers,
        each attending to all of its context and block, without biases (lookup inputs:
        the block's slots read `state.lookup`, as `BlockDrafter.draft_hidden` does)."""
        c = getattr(drafter, "config", None)
        layers = getattr(drafter, "layers", None)
        if c is None or layers is None:
            return False
        return (
            not c.attention_bias
            and all(type(layer) in (DecoderLayer, ConvDecoderLayer) for layer in layers)
            and all(c.layer_attention(i) == (False, None) for i in range(len(layers)))
            and getattr(drafter, "dtype", None) in DTYPES
            and all(
                p.dtype == drafter.dtype and p.device.type == "cpu" for p in drafter.parameters()
            )
        )

    @classmethod
    def of(cls, drafter: Any) -> LeanDrafter | None:
        """The lean round of `drafter`, rebuilt when a weight changes in place; None where
        `supports` says no."""
        if not cls.supports(drafter):
            return None
        key = tuple(p._version for p in drafter.parameters())
        cached = _CACHE.get(drafter)
        if cached is None or cached[0] != key:
            cached = (key, cls(drafter))
            _CACHE[drafter] = cached
        return cached[1]

    def _tables(self, n: int) -> None:
        cos, sin = rope_tables(self.inv_freq, self.scale, n, self.head_dim)
        # the module's tables: computed in fp32, then rounded to the drafter's dtype
        self.cos, self.sin = cos.to(self.dtype), sin.to(self.dtype)

    def new_state(self) -> LeanDraftState:
        return LeanDraftState(len(self.layers), self.kv_heads, self.head_dim, 256, self.dtype)

    def extend_context(self, state: LeanDraftState, features: torch.Tensor, start: int) -> None:
        if start != state.length:
            raise ValueError(
                f"context must grow contiguously: state holds {state.length} positions, "
                f"got start_position {start} (crop the state first)"
            )
        state.pending.append(features.reshape(-1, features.shape[-1]))

    @torch.no_grad()
    def draft_hidden(
        self, state: LeanDraftState, anchor_id: int, anchor_position: int
    ) -> torch.Tensor:
        """Final-normed hidden `[K, H]` of the block at `anchor_position` (= state.length)."""
        if state.length != anchor_position:
            raise ValueError(
                f"drafter state holds {state.length} context positions; the lean round needs "
                f"exactly the anchor's {anchor_position}"
            )
        start, B = state.done, self.block
        ctx = None
        if state.pending:
            feats = state.pending[0] if len(state.pending) == 1 else torch.cat(state.pending)
            ctx = rms_norm(self.fc(feats.to(self.dtype)), self.hidden_norm, self.eps)
        t = 0 if ctx is None else ctx.shape[0]
        end = anchor_position + B
        if end > self.cos.shape[0]:
            self._tables(max(end, 2 * self.cos.shape[0]))
        state.reserve(end)
        cos, sin = self.cos[start:end, None], self.sin[start:end, None]
        self.block_ids[0] = int(anchor_id)
        if self.config.lookup_inputs:  # slots 1.. read lookup's proposal, else the mask
            self.block_ids[1:] = self.config.mask_token_id
            if state.lookup is None:
                raise ValueError(
                    "this drafter reads prompt lookup's proposals (lookup_inputs): set "
                    "state.lookup to the lookup over the verified text before drafting"
                )
            if state.lookup:
                self.block_ids[1 : 1 + len(state.lookup)] = torch.tensor(state.lookup)
        if self.embed_table is not None:
            x = self.embed_table[self.block_ids]
        else:
            x = self.embed_module(self.block_ids).to(self.dtype)
        h, kvh, d = self.heads, self.kv_heads, self.head_dim
        for i, w in enumerate(self.layers):
            aconv, mconv = w["attention_conv"], w["mlp_conv"]
            hb = rms_norm(x, w["ln1"], self.eps)
            if aconv is not None:
                hb, dynamic = _conv_prepare(aconv, hb)
            rows = hb if ctx is None else torch.cat([ctx, hb])
            qkv = w["qkv"](rows)
            qk = qkv[:, : (h + kvh) * d].view(t + B, h + kvh, d)
            if w["qk"] is not None:
                qk = rms_norm(qk, w["qk"], self.eps)
            qk = (qk * cos + qk.roll(d // 2, -1) * sin).transpose(0, 1)  # [h+kvh, t+B, d]
            state.keys[i][:, start:end] = qk[h:]
            state.values[i][:, start:end] = (
                qkv[:, (h + kvh) * d :].view(t + B, kvh, d).transpose(0, 1)
            )
            att = F.scaled_dot_product_attention(
                qk[None, :h, t:],
                state.keys[i][None, :, :end],
                state.values[i][None, :, :end],
                enable_gqa=h != kvh,
            )
            out = w["o"](att[0].transpose(0, 1).reshape(B, h * d))
            x = x + (out if aconv is None else _conv_finish(aconv, out, dynamic))
            hm = rms_norm(x, w["ln2"], self.eps)
            if mconv is not None:
                hm, dynamic = _conv_prepare(mconv, hm)
            gu = w["gu"](hm)
            out = w["down"](F.silu(gu[:, : self.inter]) * gu[:, self.inter :])
            x = x + (out if mconv is None else _conv_finish(mconv, out, dynamic))
        state.done, state.pending = anchor_position, []
        return rms_norm(x[1:], self.norm, self.eps)


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
