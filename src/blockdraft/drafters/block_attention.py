"""Who each block query may attend to in `forward_blocks`, and three exact ways to do it.

Blocks are laid end to end after the T context keys; block j's queries see context
`< anchors[:, j]` and block j's own slots, nothing else (DFlash2-era layers may also be
causal in the block and/or sliding-window: `allowed_slots`, `context_visible`). `dense` is
the readable reference (one boolean mask, one SDPA call); `tiled` the CPU default (fused
SDPA per tile of sorted anchors: no scores or dense mask, memory linear in
`A*Kb*(T + Kb)`); `flex` the CUDA default (`flex_attention` with a `BlockMask` skipping
empty tiles; forward-only on CPU). All agree to float tolerance; a padding anchor (-1)
sees only its own block. Layout and costs: docs/architecture.md ("drafters").
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

ATTENTION_IMPLS = ("dense", "tiled", "flex")

# Queries per tile of the `tiled` path (tile = max(1, TILE_QUERIES // block_size) blocks).
# Larger tiles mean fewer SDPA calls but more wasted block-vs-other-block scores; 128 was
# the fastest of 64/128/256 at the tiny demo's shape (block 8) on CPU.
TILE_QUERIES = 128


def allowed_slots(
    query_slot: torch.Tensor, key_slot: torch.Tensor, causal: bool, window: int | None
) -> torch.Tensor:
    """May block slot `query_slot` attend to slot `key_slot` of the same block?"""
    ok = (query_slot >= 0) & (key_slot >= 0)  # slots are never negative: all True, broadcast
    if causal:
        ok = ok & (key_slot <= query_slot)
    if window is not None:
        ok = ok & (query_slot - key_slot < window)
        if not causal:
            ok = ok & (key_slot - query_slot < window)
    return ok


def context_visible(
    key_pos: torch.Tensor, anchor: torch.Tensor, query_slot: torch.Tensor, window: int | None
) -> torch.Tensor:
    """May the query at slot `query_slot` of the block anchored at `anchor` see context
    position `key_pos`? (Context `< anchor`; within the window of position anchor + slot.)"""
    ok = key_pos < anchor
    if window is not None:
        ok = ok & (anchor + query_slot - key_pos < window)
    return ok


def block_attention_mask(
    anchors: torch.Tensor,
    seq_len: int,
    block_size: int,
    causal: bool = False,
    window: int | None = None,
) -> torch.Tensor:
    """Boolean mask `[B, 1, A*Kb, T + A*Kb]` (True = may attend): the `dense` reference.

    Keys are `[context 0..T-1; block 0 slots; block 1 slots; ...]`. Block j's queries see
    context indices `< anchors[:, j]` and the slots of block j (all of them, or as
    `causal` / `window` allow). Padding anchors (-1) see only their own block, so every
    row has a key and the softmax stays finite.
    """
    B, A = anchors.shape
    dev = anchors.device
    slot = torch.arange(block_size, device=dev).repeat(A)  # [A*Kb]
    query_anchor = anchors.repeat_interleave(block_size, dim=1)  # [B,A*Kb]
    ctx = context_visible(
        torch.arange(seq_len, device=dev)[None, None, :], query_anchor[:, :, None],
        slot[None, :, None], window,
    )  # fmt: skip
    block_of = torch.arange(A, device=dev).repeat_interleave(block_size)
    own = (block_of[:, None] == block_of[None, :]) & allowed_slots(
        slot[:, None], slot[None, :], causal, window
    )
    return torch.cat([ctx, own.expand(B, -1, -1)], dim=-1).unsqueeze(1)


def one_block_mask(
    anchor_position: int,
    block_size: int,
    causal: bool,
    window: int | None,
    device: torch.device | str,
) -> torch.Tensor | None:
    """`[1, 1, Kb, anchor_position + Kb]` mask of one block against its context (inference),
    or None when the block sees all of it (full, bidirectional layers)."""
    if not causal and (window is None or window >= anchor_position + block_size):
        return None
    anchors = torch.tensor([[anchor_position]], device=device)
    return block_attention_mask(anchors, anchor_position, block_size, causal, window)


def default_attention_impl(device: torch.device | str) -> str:
    """`flex` on CUDA (the only path that fits DFlash's recipe there), `tiled` elsewhere."""
    return "flex" if torch.device(device).type == "cuda" else "tiled"


_COMPILED_FLEX: Any = None


def _flex_attention() -> Any:
    """Compiled `flex_attention` (compiled once per process; eager flex is a slow reference)."""
    global _COMPILED_FLEX
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention)
    return _COMPILED_FLEX


class BlockAttention:
    """The block layout of one `forward_blocks` call, built once and shared by every layer.

    `attend(q, block_k, block_v, ctx_k, ctx_v)` takes rotated queries `[B, heads, A*Kb, d]`,
    the blocks' own keys/values `[B, kv_heads, A*Kb, d]` and the context's
    `[B, kv_heads, T, d]`, and returns `[B, heads, A*Kb, d]`.
    """

    def __init__(
        self,
        anchors: torch.Tensor,
        seq_len: int,
        block_size: int,
        impl: str,
        dtype: torch.dtype = torch.float32,
        tile_queries: int | None = None,
        causal: bool = False,
        window: int | None = None,
    ) -> None:
        if impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention must be one of {ATTENTION_IMPLS}, got {impl!r}")
        self.anchors, self.seq_len, self.block_size, self.impl = anchors, seq_len, block_size, impl
        self.causal, self.window = causal, window
        if impl == "dense":
            self.mask = block_attention_mask(anchors, seq_len, block_size, causal, window)
        elif impl == "tiled":
            per_tile = (tile_queries or TILE_QUERIES) // block_size
            self.tiles = self._tiles(max(1, per_tile), dtype)
        else:
            self.block_mask = self._block_mask()

    # --- tiled ------------------------------------------------------------------------------
    def _tiles(self, per_tile: int, dtype: torch.dtype) -> list[tuple[int, int, int, torch.Tensor]]:
        """(first query, end query, context limit, additive mask `[B,1,q,limit+q]`) per tile.

        Masks are additive (0 / -inf) in the attention dtype, built once: SDPA would
        otherwise convert a boolean mask to this form again in every layer.
        """
        anchors, Kb, T = self.anchors, self.block_size, self.seq_len
        B, A = anchors.shape
        dev = anchors.device
        limits = anchors.view(B, A).amax(0).tolist() if A else []
        positions = torch.arange(T, device=dev)
        tiles = []
        for s in range(0, A, per_tile):
            e = min(A, s + per_tile)
            limit = max(0, int(max(limits[s:e])))  # context the tile's blocks may see
            queries = (e - s) * Kb
            query_anchor = anchors[:, s:e].repeat_interleave(Kb, dim=1)  # [B, q]
            slot = torch.arange(queries, device=dev) % Kb
            ctx = context_visible(
                positions[:limit], query_anchor[:, :, None], slot[None, :, None], self.window
            )  # [B, q, limit]
            slot_block = torch.arange(queries, device=dev) // Kb
            own = (slot_block[:, None] == slot_block[None, :]) & allowed_slots(
                slot[:, None], slot[None, :], self.causal, self.window
            )
            own = own.expand(B, -1, -1)
            allowed = torch.cat([ctx, own], dim=-1).unsqueeze(1)
            mask = torch.zeros(allowed.shape, dtype=dtype, device=dev)
            mask.masked_fill_(~allowed, float("-inf"))
            tiles.append((s * Kb, e * Kb, limit, mask))
        return tiles

    def _attend_tiled(self, q, block_k, block_v, ctx_k, ctx_v, gqa):  # type: ignore[no-untyped-def]
        if not self.tiles:
            return q.new_zeros(q.shape)
        outs = []
        for start, stop, limit, mask in self.tiles:
            k = torch.cat([ctx_k[:, :, :limit], block_k[:, :, start:stop]], dim=2)
            v = torch.cat([ctx_v[:, :, :limit], block_v[:, :, start:stop]], dim=2)
            outs.append(
                F.scaled_dot_product_attention(
                    q[:, :, start:stop], k, v, attn_mask=mask.to(q.dtype), enable_gqa=gqa
                )
            )
        return torch.cat(outs, dim=2)

    # --- flex -------------------------------------------------------------------------------
    def _block_mask(self) -> Any:
        anchors, Kb, T = self.anchors, self.block_size, self.seq_len
        B, A = anchors.shape
        query_anchor = anchors.repeat_interleave(Kb, dim=1)  # [B, A*Kb]
        causal, window = self.causal, self.window

        def mask_mod(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
            in_ctx = kv_idx < T
            q_slot, k_slot = q_idx % Kb, (kv_idx - T) % Kb
            own = ((kv_idx - T) // Kb == q_idx // Kb) & allowed_slots(
                q_slot, k_slot, causal, window
            )
            seen = context_visible(kv_idx, query_anchor[b, q_idx], q_slot, window)
            return (in_ctx & seen) | (~in_ctx & own)

        return create_block_mask(mask_mod, B, None, A * Kb, T + A * Kb, device=anchors.device)

    def _attend_flex(self, q, k, v, gqa):  # type: ignore[no-untyped-def]
        # flex_attention is no autocast op and wants one dtype; under autocast q/k leave
        # their fp32 RMSNorm weights in fp32 while v is bf16, so cast like SDPA would.
        device_type = q.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
        else:
            dtype = q.dtype
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        if q.device.type == "cuda":
            return _flex_attention()(q, k, v, block_mask=self.block_mask, enable_gqa=gqa)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            raise ValueError(
                "attention='flex' has no backward on CPU in this torch; "
                "use 'tiled' (the CPU default) to train"
            )
        return flex_attention(q, k, v, block_mask=self.block_mask, enable_gqa=gqa)

    # --- entry point ------------------------------------------------------------------------
    def attend(
        self,
        q: torch.Tensor,
        block_k: torch.Tensor,
        block_v: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
    ) -> torch.Tensor:
        gqa = q.shape[1] != block_k.shape[1]
        if self.impl == "tiled":
            return self._attend_tiled(q, block_k, block_v, ctx_k, ctx_v, gqa)
        k = torch.cat([ctx_k, block_k], dim=2)
        v = torch.cat([ctx_v, block_v], dim=2)
        if self.impl == "flex":
            return self._attend_flex(q, k, v, gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, enable_gqa=gqa)
