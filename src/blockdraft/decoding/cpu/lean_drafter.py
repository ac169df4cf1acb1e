"""A lean decoding round for a small parallel block drafter on a CPU: context and block in one pass.

The loop pays a small drafter's dispatch twice per round (`extend_context` for the
verified positions, `draft_hidden` for the next block), yet both project rows with the
same layer weights at contiguous positions (context a..a+m, block a+m+1..). So one pass
does both: per layer one q/k/v product over [new context rows; block rows], one norm pass,
one rotation; context K/V land in a preallocated cache and the block's right after them
(scratch), and the block attends to `cache[:anchor + block]` with no mask. `extend_context`
only records features; `draft_hidden` does the work. Hidden states equal `BlockDrafter`'s
to float rounding. fp32 CPU drafters with every weight below MKL's packing size only.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F

from blockdraft.kernels.packed_linear import MIN_PACKED_ELEMENTS


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class LeanDraftState:
    """Context K/V `[kv_heads, capacity, d]` per layer for positions < `length`, plus
    the verified features not yet projected (`pending`, positions length..)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int) -> None:
        self.keys = [torch.zeros(kv_heads, capacity, head_dim) for _ in range(layers)]
        self.values = [torch.zeros(kv_heads, capacity, head_dim) for _ in range(layers)]
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
    """The lean round of one `BlockDrafter` (module doc); `of(drafter)` caches it."""

    def __init__(self, drafter: Any) -> None:
        c = drafter.config
        self.config = c
        self.heads, self.kv_heads, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        self.eps = c.rms_norm_eps
        self.inter = c.intermediate_size
        self.block = c.block_size
        self.fc = drafter.fc.weight.detach().t().contiguous()
        self.hidden_norm = drafter.hidden_norm.weight.detach()
        self.norm = drafter.norm.weight.detach()
        # the target's embedding, not the drafter (cached weakly keyed by it): a plain
        # table is indexed directly, a scaled one (Gemma) goes through its module
        embed = drafter._need_target().embed
        plain = type(embed) is torch.nn.Embedding and embed.weight.dtype == torch.float32
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
            self.layers.append(
                dict(
                    ln1=layer.input_layernorm.weight.detach(),
                    ln2=layer.post_attention_layernorm.weight.detach(),
                    qkv=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
                    .detach()
                    .t()
                    .contiguous(),
                    qk=qk,
                    o=a.o_proj.weight.detach().t().contiguous(),
                    gu=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
                    .detach()
                    .t()
                    .contiguous(),
                    down=mlp.down_proj.weight.detach().t().contiguous(),
                )
            )
        self._tables(1024)

    @staticmethod
    def supports(drafter: Any) -> bool:
        """A plain fp32 CPU drafter whose every weight is below the packing size."""
        c = getattr(drafter, "config", None)
        params = list(drafter.parameters())
        return (
            c is not None
            and not c.attention_bias
            and not c.lookup_inputs
            and all(p.dtype == torch.float32 and p.device.type == "cpu" for p in params)
            and all(p.numel() < MIN_PACKED_ELEMENTS for p in params)
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
        freqs = torch.arange(n, dtype=torch.float32)[:, None] * self.inv_freq[None]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos() * self.scale
        sin = emb.sin() * self.scale
        sin[:, : self.head_dim // 2] = -sin[:, : self.head_dim // 2]
        self.sin = sin

    def new_state(self) -> LeanDraftState:
        return LeanDraftState(len(self.layers), self.kv_heads, self.head_dim, 256)

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
            ctx = _rms(torch.mm(feats, self.fc), self.hidden_norm, self.eps)
        t = 0 if ctx is None else ctx.shape[0]
        end = anchor_position + B
        if end > self.cos.shape[0]:
            self._tables(max(end, 2 * self.cos.shape[0]))
        state.reserve(end)
        cos, sin = self.cos[start:end, None], self.sin[start:end, None]
        self.block_ids[0] = int(anchor_id)  # slots 1.. stay the mask token
        if self.embed_table is not None:
            x = self.embed_table[self.block_ids]
        else:
            x = self.embed_module(self.block_ids).to(torch.float32)
        h, kvh, d = self.heads, self.kv_heads, self.head_dim
        for i, w in enumerate(self.layers):
            hb = _rms(x, w["ln1"], self.eps)
            rows = hb if ctx is None else torch.cat([ctx, hb])
            qkv = torch.mm(rows, w["qkv"])
            qk = qkv[:, : (h + kvh) * d].view(t + B, h + kvh, d)
            if w["qk"] is not None:
                qk = _rms(qk, w["qk"], self.eps)
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
            x = x + torch.mm(att[0].transpose(0, 1).reshape(B, h * d), w["o"])
            gu = torch.mm(_rms(x, w["ln2"], self.eps), w["gu"])
            x = x + torch.mm(F.silu(gu[:, : self.inter]) * gu[:, self.inter :], w["down"])
        state.done, state.pending = anchor_position, []
        return _rms(x[1:], self.norm, self.eps)


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
