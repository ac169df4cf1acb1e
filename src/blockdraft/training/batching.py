"""Which sequences and anchors each process trains on at each step, as pure functions.

Every random choice is a function of `(seed, step, rollout index)`, never of the process
layout: the data stream is per-epoch permutations seeded by `(seed, epoch)`, step s takes
items `[s*B, (s+1)*B)` split into `world_size * grad_accum` micro-batches. So resuming
needs only the step, and N processes see exactly what one would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from blockdraft.data.feature_store import truncated_span  # one truncation rule, shared with caching
from blockdraft.data.rollouts import Rollout

_MIX = 0x9E3779B1  # large odd constant: keeps derived seeds apart


def derived_seed(*parts: int) -> int:
    """A deterministic 63-bit seed from integers (stable across processes and runs)."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFF)) * 1099511628211 + _MIX) % (1 << 63)
    return h


@lru_cache(maxsize=4)
def _epoch_permutation(num_items: int, seed: int, epoch: int) -> tuple[int, ...]:
    gen = torch.Generator().manual_seed(derived_seed(seed, 7, epoch))
    return tuple(torch.randperm(num_items, generator=gen).tolist())


def global_batch_indices(num_items: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Rollout indices of optimizer step `step` (0-based): a window on the epoch stream."""
    if num_items < 1:
        raise ValueError("the training rollout set is empty")
    out = []
    for pos in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(pos, num_items)
        out.append(_epoch_permutation(num_items, seed, epoch)[offset])
    return out


def total_steps(num_items: int, batch_size: int, epochs: float, max_steps: int | None) -> int:
    if max_steps is not None:
        return max_steps
    return max(1, math.ceil(epochs * num_items / batch_size))


def micro_batches(
    indices: list[int], rank: int, world_size: int, grad_accum: int
) -> list[list[int]]:
    """This rank's `grad_accum` micro-batches out of one global batch."""
    parts = world_size * grad_accum
    if len(indices) % parts:
        raise ValueError(
            f"optim.batch_size={len(indices)} must be divisible by world_size*grad_accum={parts}"
        )
    size = len(indices) // parts
    return [
        indices[(i * world_size + rank) * size : (i * world_size + rank + 1) * size]
        for i in range(grad_accum)
    ]


@dataclass
class Batch:
    """A right-padded micro-batch of rollouts, `[B, T]` per token: `loss_mask` True on
    response tokens, `logprobs` the target's log-prob of each response token (0
    elsewhere); where every rollout stored one, the top-k distribution of each token:
    `topk_ids [B,T,k]` (-1 elsewhere), `topk_logprobs` (-inf elsewhere)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    logprobs: torch.Tensor
    prompt_lens: torch.Tensor
    response_lens: torch.Tensor
    rollout_index: torch.Tensor
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None

    def to(self, device: torch.device) -> Batch:
        return Batch(**{k: None if v is None else v.to(device) for k, v in self.__dict__.items()})

    def rows(self, index: torch.Tensor | slice) -> Batch:
        """The micro-batch of the sequences `index` selects (every field indexed alike)."""
        return Batch(**{k: None if v is None else v[index] for k, v in self.__dict__.items()})

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())


def _as_list(x) -> list:
    if isinstance(x, torch.Tensor):
        return x.tolist()
    return list(x) if x is not None else []


def truncate(prompt: list[int], response: list[int], logprobs: list[float], max_len: int):
    """Fit prompt+response in `max_len`: cut the response's tail; a prompt too long to
    leave two response tokens loses its *start* (the end is what the response follows)."""
    cut, length = truncated_span(len(prompt), len(response), max_len)
    prompt = prompt[cut:]
    room = length - len(prompt)
    return prompt, response[:room], logprobs[:room]


def collate(rollouts: list[Rollout], indices: list[int], pad_id: int, max_seq_len: int) -> Batch:
    seqs = []
    for r in rollouts:
        prompt, resp, lps = truncate(
            _as_list(r.prompt_ids), _as_list(r.response_ids), _as_list(r.logprobs), max_seq_len
        )
        seqs.append((prompt, resp, lps))
    width = max(len(p) + len(r) for p, r, _ in seqs)
    b = len(seqs)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    attention = torch.zeros((b, width), dtype=torch.bool)
    loss_mask = torch.zeros((b, width), dtype=torch.bool)
    logprobs = torch.zeros((b, width), dtype=torch.float32)
    for i, (prompt, resp, lps) in enumerate(seqs):
        p, n = len(prompt), len(resp)
        input_ids[i, : p + n] = torch.tensor(prompt + resp, dtype=torch.long)
        attention[i, : p + n] = True
        loss_mask[i, p : p + n] = True
        if lps:
            logprobs[i, p : p + len(lps)] = torch.tensor(lps, dtype=torch.float32)
    topk_ids = topk_logprobs = None
    if rollouts and all(getattr(r, "topk_ids", None) is not None for r in rollouts):
        k = int(rollouts[0].topk_ids.shape[-1])
        topk_ids = torch.full((b, width, k), -1, dtype=torch.long)
        topk_logprobs = torch.full((b, width, k), float("-inf"), dtype=torch.float32)
        for i, (r, (prompt, resp, _)) in enumerate(zip(rollouts, seqs, strict=True)):
            p, n = len(prompt), len(resp)
            topk_ids[i, p : p + n] = r.topk_ids[:n].long()
            topk_logprobs[i, p : p + n] = r.topk_logprobs[:n].float()
    return Batch(
        input_ids=input_ids,
        attention_mask=attention,
        loss_mask=loss_mask,
        logprobs=logprobs,
        prompt_lens=torch.tensor([len(p) for p, _, _ in seqs]),
        response_lens=torch.tensor([len(r) for _, r, _ in seqs]),
        rollout_index=torch.tensor(indices),
        topk_ids=topk_ids,
        topk_logprobs=topk_logprobs,
    )


def anchor_generator(seed: int, step: int, rollout_index: int) -> torch.Generator:
    """The generator for one sequence's anchors at one step (layout independent)."""
    return torch.Generator().manual_seed(derived_seed(seed, 11, step, rollout_index))
