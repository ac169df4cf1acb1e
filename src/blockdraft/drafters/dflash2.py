"""DFlash2 (z-lab `DFlash2DraftModel`): DFlash plus block-local convolutions and a selector.

Every decoder layer wraps attention and MLP in grouped dynamic causal convolutions over
the block's rows (a base kernel per channel plus per-group coefficients projected from the
sublayer input); they never cross a block, so training's many blocks and one inference
block agree. A candidate selector re-ranks each slot's top-k unary candidates with a
low-rank bilinear term between the token chosen at the previous slot (the anchor for slot
1) and the candidate, modulated by the slot's hidden state; the choice runs left to right,
so like the semi-AR drafter slot k is teacher-forced in training and scoring (`prev`).
"""

from __future__ import annotations

import torch
from torch import nn

from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
from blockdraft.drafters.draft_vocab import target_to_draft
from blockdraft.drafters.layers import DecoderLayer


def grouped_dynamic_conv(
    x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Causal convolution over each block's rows: `out[t] = sum_o (base[o] + d[t, o]) x[t-o]`.

    x `[B, L, H]` with L a multiple of `block_size` (blocks end to end); dynamic
    `[B, L, taps, G]`, one coefficient per channel group of `H / G` channels at each output
    row; base `[taps, H]`. Rows before a block's first row count as zero.
    """
    b, length, h = x.shape
    taps, groups = dynamic.shape[-2], dynamic.shape[-1]
    rows = x.view(b, length // block_size, block_size, groups, h // groups)
    coef = dynamic.view(b, length // block_size, block_size, taps, groups, 1)
    kernel = base.view(taps, groups, h // groups).to(x.dtype)
    out = (kernel[0] + coef[:, :, :, 0]) * rows
    for o in range(1, min(taps, block_size)):  # tap o reaches o rows back inside the block
        out[:, :, o:] += (kernel[o] + coef[:, :, o:, o]) * rows[:, :, :-o]
    return out.view(b, length, h)


class GroupedDynamicConv(nn.Module):
    """The pair of convolutions around one sublayer: `prepare` before it, `finish` after.

    Both sides' dynamic coefficients are projected from the sublayer's (normed) input.
    Parameter names are z-lab's (`base_kernel [2, taps, H]`, `kernel_projection`).
    """

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.groups = kernel_size, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.block_size = 0  # set by the drafter

    def reset_to_identity(self) -> None:
        """Tap 0 = 1, the rest 0, no dynamic part: the sublayer is left unchanged."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dynamic = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        out = grouped_dynamic_conv(x, dynamic[..., 0, :, :], self.base_kernel[0], self.block_size)
        return out, dynamic[..., 1, :, :]

    def finish(self, x: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        return grouped_dynamic_conv(x, dynamic, self.base_kernel[1], self.block_size)


class ConvDecoderLayer(DecoderLayer):
    """DecoderLayer with `attention_conv` around attention and `mlp_conv` around the MLP."""

    def __init__(self, c: DrafterConfig) -> None:
        super().__init__(
            c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.rms_norm_eps, c.qk_norm, c.attention_bias,
        )  # fmt: skip
        taps, group = c.conv_kernel_size, c.conv_group_size
        self.attention_conv = GroupedDynamicConv(c.hidden_size, taps, group)
        self.mlp_conv = GroupedDynamicConv(c.hidden_size, taps, group)
        self.attention_conv.block_size = self.mlp_conv.block_size = c.block_size

    def forward(self, x, ctx_k, ctx_v, cos, sin, mask):  # type: ignore[no-untyped-def]
        h, dynamic = self.attention_conv.prepare(self.input_layernorm(x))
        h = self.self_attn(h, ctx_k, ctx_v, cos, sin, mask)
        x = x + self.attention_conv.finish(h, dynamic)
        h, dynamic = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), dynamic)


class CandidateSelector(nn.Module):
    """Scores `unary(c) + <P[prev] * W h, S[c]>` for the top-k unary candidates c.

    `vocab_size` columns can be proposed (a reduced draft vocabulary's, or the target's);
    `predecessors` rows of P (default `vocab_size`) index the previous token.
    """

    def __init__(
        self, vocab_size: int, hidden_size: int, rank: int, top_k: int,
        predecessors: int | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.randn(predecessors or vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.randn(vocab_size, rank))
        # zero: a fresh selector keeps the unary order; the codebooks still get gradient
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        nn.init.zeros_(self.hidden_projection.weight)

    def forward(
        self, hidden: torch.Tensor, unary: torch.Tensor, prev: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(candidate columns `[..., k]`, their scores `[..., k]`) for hidden `[..., H]`,
        unary logits `[..., V]` and predecessor rows `[...]` (negative: padding, any row)."""
        top, candidates = torch.topk(unary, self.top_k, dim=-1)
        return candidates, self.score(hidden, candidates, top, prev)

    def score(
        self, hidden: torch.Tensor, candidates: torch.Tensor, top: torch.Tensor, prev: torch.Tensor
    ) -> torch.Tensor:
        """Scores `[..., k]` of given candidates whose unary logits are `top [..., k]`."""
        mod = self.hidden_projection(hidden)
        pred = self.predecessor_codebook[prev.clamp_min(0).to(mod.device)].to(mod.dtype) * mod
        succ = self.successor_codebook[candidates].to(mod.dtype)  # [..., k, r]
        pair = (succ @ pred.unsqueeze(-1)).squeeze(-1)
        return top + pair.to(top.dtype)


class DFlash2Drafter(BlockDrafter):
    """BlockDrafter with conv decoder layers and the candidate selector (module docstring).

    `compute_draft_logits(hidden)` are the unary (parallel) logits; with `prev` they are
    the selector's scores on the candidates and -inf elsewhere, so softmax / argmax /
    q(x) of them are the selector's choice distribution, as the decoder samples it.
    """

    sequential = True  # slot k's proposal depends on slot k-1's (decoding/target_runner.py)

    def __init__(self, config: DrafterConfig) -> None:
        if config.arch != "dflash2":
            raise ValueError(f"DFlash2Drafter needs arch='dflash2', got {config.arch!r}")
        super().__init__(config)
        for layer in self.layers:
            layer.attention_conv.reset_to_identity()
            layer.mlp_conv.reset_to_identity()
        c, draft = config, config.draft_vocab_size
        # a reduced draft vocabulary D: D candidate columns, and D + 1 predecessor rows (the
        # anchor and teacher-forced predecessors can be any token; those outside D share one)
        self.candidate_selector = CandidateSelector(
            draft or c.vocab_size, c.hidden_size, c.selector_rank, c.selector_top_k,
            predecessors=None if draft is None else draft + 1,
        )  # fmt: skip
        self._predecessor_table: tuple[tuple, torch.Tensor] | None = None

    @staticmethod
    def _decoder_layer(c: DrafterConfig) -> nn.Module:
        return ConvDecoderLayer(c)

    def unary_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The backbone's logits `[..., V_draft]` (multiplier and softcap applied)."""
        return super().slot_logits(hidden, None, super().base_logits(hidden))

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The unary logits: what the previous token does not change."""
        return self.unary_logits(hidden)

    def slot_logits(
        self, hidden: torch.Tensor, prev_tokens: torch.Tensor | None, base: torch.Tensor
    ) -> torch.Tensor:
        """The unary logits `base`, or with `prev_tokens` the selector's scores."""
        return base if prev_tokens is None else self.selector_logits(hidden, prev_tokens, base)

    def predecessor_rows(self, prev: torch.Tensor) -> torch.Tensor:
        """Predecessor-codebook rows of target ids `prev` (negative: padding, kept): the
        ids themselves, or with a reduced vocabulary D the draft id and row D outside D."""
        ids = self.draft_ids
        if ids is None:
            return prev
        key = (id(self.d2t), self.d2t._version, prev.device)
        if self._predecessor_table is None or self._predecessor_table[0] != key:
            table = target_to_draft(ids.to(prev.device), int(self.config.vocab_size))
            table[table < 0] = ids.numel()
            self._predecessor_table = (key, table)
        table = self._predecessor_table[1]
        return torch.where(prev >= 0, table[prev.clamp_min(0)], prev)

    def select(
        self, hidden: torch.Tensor, prev: torch.Tensor, unary: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(candidate columns, scores) `[..., k]` given the previous tokens `prev [...]`
        (target ids; the columns are draft ids with a reduced vocabulary)."""
        unary = self.unary_logits(hidden) if unary is None else unary
        return self.candidate_selector(hidden, unary, self.predecessor_rows(prev))

    def selector_logits(
        self, hidden: torch.Tensor, prev: torch.Tensor, unary: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`[..., V_draft]`: the selector's scores on the candidates, -inf elsewhere."""
        unary = self.unary_logits(hidden) if unary is None else unary
        candidates, scores = self.select(hidden, prev, unary)
        out = unary.new_full(unary.shape, float("-inf"))
        return out.scatter(-1, candidates, scores.to(out.dtype))

    @torch.no_grad()
    def greedy_columns(
        self, hidden: torch.Tensor, anchor_id: int, products: torch.Tensor | None = None
    ) -> torch.Tensor:
        """T = 0 proposals `[K]` of one block's hidden `[K, H]`, as draft columns.

        Slot t's predecessor is one of slot t-1's k candidates, so the selector's scores for
        every (previous candidate, candidate) pair come from two batched calls and the
        left-to-right argmax walks that `[K-1, k, k]` table on the host: the choices of
        `argmax(selector_logits)` slot by slot (ties: the lowest column) without ~10 small
        calls per slot. `products`: the head's `hidden @ W^T` from a faster kernel."""
        raw = super().base_logits(hidden) if products is None else products
        unary = super().slot_logits(hidden, None, raw)  # the multiplier and softcap
        selector = self.candidate_selector
        top, cand = torch.topk(unary, selector.top_k, dim=-1)  # [K, k]
        k_slots, k = cand.shape
        anchor_row = self.predecessor_rows(torch.tensor([anchor_id], device=hidden.device))
        first = selector.score(hidden[:1], cand[:1], top[:1], anchor_row)[0].tolist()
        # a draft column is its token's predecessor row, so slot t-1's candidates index P
        pairs = selector.score(
            hidden[1:, None].expand(k_slots - 1, k, hidden.shape[-1]),
            cand[1:, None].expand(k_slots - 1, k, k),
            top[1:, None].expand(k_slots - 1, k, k),
            cand[:-1],
        ).tolist()  # [slot t-1][previous candidate i][candidate j]
        columns = cand.tolist()
        j = _best(first, columns[0])
        chosen = [columns[0][j]]
        for t in range(1, k_slots):
            j = _best(pairs[t - 1][j], columns[t])
            chosen.append(columns[t][j])
        return torch.tensor(chosen, device=hidden.device)

    @torch.no_grad()
    def candidates(self, hidden: torch.Tensor, chunk_rows: int = 4096) -> torch.Tensor:
        """Top-k unary candidate ids `[..., k]`, `chunk_rows` rows of logits at a time."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        k = self.candidate_selector.top_k
        out = torch.empty((flat.shape[0], k), dtype=torch.long, device=flat.device)
        for lo in range(0, flat.shape[0], chunk_rows):
            out[lo : lo + chunk_rows] = (
                self.unary_logits(flat[lo : lo + chunk_rows]).topk(k).indices
            )
        return out.view(*hidden.shape[:-1], k)

    def select_compact(
        self, hidden: torch.Tensor, prev: torch.Tensor, chunk_rows: int = 4096
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`select` without `[..., V]` logits kept: candidates by row chunks (no gradient:
        top-k is discrete), their unary logits recomputed from the head rows
        (differentiable), so memory is `O(rows x k)` whatever the vocabulary."""
        candidates = self.candidates(hidden, chunk_rows)
        rows = self.head_weight.to(device=hidden.device, dtype=hidden.dtype)[candidates]
        top = self._softcap((rows @ hidden.unsqueeze(-1)).squeeze(-1))
        prev_rows = self.predecessor_rows(prev)
        return candidates, self.candidate_selector.score(hidden, candidates, top, prev_rows)


def _best(scores: list[float], columns: list[int]) -> int:
    """Index of the highest score, ties to the lowest column (as argmax over the columns)."""
    return max(range(len(scores)), key=lambda i: (scores[i], -columns[i]))
