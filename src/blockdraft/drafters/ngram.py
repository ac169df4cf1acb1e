"""The n-gram (prompt lookup) drafter: the free baseline every trained drafter must beat.

It proposes the tokens that followed an earlier occurrence of the text's last few tokens:
no training, no target features, and hard to beat on text that repeats its context (code,
quotations, greedy loops), so a drafter result without it says little. The default rule
is vLLM's `ngram` method (longest suffix first, its earliest occurrence, up to K tokens; no
match proposes nothing), checked proposal for proposal against vLLM's own function where
vLLM is installed, so the offline baseline is the one a server runs; `match=latest` takes
the latest occurrence instead. A deterministic proposal y is accepted
with `min(1, q(x)/p(x)) = 1[x = y]` (a one-hot q), exact at every temperature, so
`acceptance_from_tokens` needs token ids only. Contract: docs/architecture.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class NgramConfig:
    """What a prompt-lookup drafter is: K proposals, suffix lengths tried, which match."""

    num_proposals: int = 7
    max_ngram: int = 3
    min_ngram: int = 1
    match: str = "first"  # earliest occurrence (vLLM's `ngram`) | latest

    @property
    def block_size(self) -> int:
        return self.num_proposals + 1


class NgramDrafter:
    """Prompt lookup, usable wherever a trained drafter is (eval, compare, decode, demo)."""

    objective = "none"

    def __init__(
        self, num_proposals: int = 7, max_ngram: int = 3, min_ngram: int = 1, match: str = "first"
    ) -> None:
        if num_proposals < 1:
            raise ValueError(f"ngram drafter: k must be >= 1, got {num_proposals}")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(
                f"ngram drafter: need 1 <= min <= max, got min={min_ngram} max={max_ngram}"
            )
        if match not in ("latest", "first"):
            raise ValueError(f"ngram drafter: match must be latest or first, got {match!r}")
        self.config = NgramConfig(num_proposals, max_ngram, min_ngram, match)

    @property
    def num_proposals(self) -> int:
        return self.config.num_proposals

    @property
    def name(self) -> str:
        c = self.config
        if c == NgramConfig():
            return "ngram"
        name = f"ngram:k={c.num_proposals},max={c.max_ngram},min={c.min_ngram}"
        return name + (",match=latest" if c.match == "latest" else "")

    def eval(self) -> NgramDrafter:  # same call shape as a torch drafter
        return self

    def propose(self, tokens: Sequence[int] | torch.Tensor) -> list[int]:
        """Up to K tokens that followed the chosen earlier occurrence of a suffix."""
        seq = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        index = NgramTable(self.config)
        index.advance(seq, len(seq))
        return index.propose(seq, len(seq))

    def proposals_from_tokens(
        self, prompt_ids: Sequence[int] | torch.Tensor, response_ids: Sequence[int] | torch.Tensor
    ) -> torch.Tensor:
        """`[L-1, K]` long: the proposal of every round start n (from prompt + x_1..x_n),
        -1 past its length."""
        p = prompt_ids.tolist() if isinstance(prompt_ids, torch.Tensor) else list(prompt_ids)
        r = response_ids.tolist() if isinstance(response_ids, torch.Tensor) else list(response_ids)
        seq, P, L = p + r, len(p), len(r)
        out = torch.full((max(L - 1, 0), self.num_proposals), -1, dtype=torch.long)
        index = NgramTable(self.config)
        for n in range(1, L):
            index.advance(seq, P + n)  # tokens available when the round anchored at x_n starts
            prop = index.propose(seq, P + n)
            if prop:
                out[n - 1, : len(prop)] = torch.tensor(prop)
        return out

    def acceptance_from_tokens(
        self, prompt_ids: Sequence[int] | torch.Tensor, response_ids: Sequence[int] | torch.Tensor
    ) -> torch.Tensor:
        """`[L-1, K]` acceptances of one rollout: 1 while the proposal matches the rollout."""
        props = self.proposals_from_tokens(prompt_ids, response_ids)
        return (props == future_tokens(response_ids, self.num_proposals)).float().cumprod(-1)


def future_tokens(response_ids: Sequence[int] | torch.Tensor, k: int) -> torch.Tensor:
    """`[L-1, K]` long: `x_{n+h}` for round n and slot h (-2 past the end, matching nothing)."""
    x = torch.as_tensor(response_ids, dtype=torch.long).reshape(-1)
    L = x.numel()
    idx = torch.arange(1, max(L, 1))[:, None] + torch.arange(k)[None, :]  # 0-based x_{n+h}
    return torch.where(idx < L, x[idx.clamp_max(max(L - 1, 0))], torch.full_like(idx, -2))


class NgramTable:
    """Occurrences of every n-gram of the text so far, grown one token at a time.

    The suffix itself must not count as its own match, so when the text is `seq[:end]`
    the index holds the n-grams that end at or before `end - 2` (start <= end - n - 1).
    Growing it incrementally makes scoring a rollout O(L * max_ngram) instead of O(L^2).
    """

    def __init__(self, cfg: NgramConfig) -> None:
        self.cfg = cfg
        self.starts: dict[tuple[int, ...], int] = {}
        self.done = 0  # n-grams ending before index `done` are in the table

    def advance(self, seq: list[int], end: int) -> None:
        keep_first = self.cfg.match == "first"
        for stop in range(self.done, end - 1):  # n-grams ending at index stop
            for n in range(self.cfg.min_ngram, self.cfg.max_ngram + 1):
                start = stop - n + 1
                if start < 0:
                    break
                key = tuple(seq[start : stop + 1])
                if keep_first:
                    self.starts.setdefault(key, start)
                else:
                    self.starts[key] = start
        self.done = max(self.done, end - 1)

    def propose(self, seq: list[int], end: int) -> list[int]:
        for n in range(min(self.cfg.max_ngram, end - 1), self.cfg.min_ngram - 1, -1):
            start = self.starts.get(tuple(seq[end - n : end]))
            if start is not None:
                return seq[start + n : min(start + n + self.cfg.num_proposals, end)]
        return []
