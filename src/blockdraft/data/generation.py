"""Batched sampling from a `Target`: the exact distribution used, token by token.

We write our own loop on `Target.forward` with a KV cache instead of HF `generate`
because we need, for every realised token, its log-probability under the distribution
it was *actually drawn from* (temperature, then top-k, then top-p, as HF applies them),
and a random stream per prompt: each row samples with its own `torch.Generator` seeded
from (seed, prompt id), so a rollout does not depend on which other prompts share its
batch (up to float rounding of padded batched matmuls). That is what makes an
interrupted run resume to the same result.

Greedy (temperature 0) takes the argmax; its stored log-probs are under the plain T=1
softmax of the logits (the greedy "distribution" is a point mass and carries no
information), which is what acceptance-style objectives need.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from blockdraft.models.target import Target


@dataclass(frozen=True)
class SamplingSettings:
    """How the target samples. `temperature=0` is greedy; `top_k=0`/`top_p=1` disable filters."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingSettings:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown sampling setting(s): {', '.join(unknown)}")
        return cls(**data)


def sampling_logprobs(logits: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """Log-probs (float32, last dim) of the distribution the sampler draws from.

    Order as in HF: divide by temperature, keep the top-k logits (ties at the k-th value
    kept), then keep the smallest set of most likely tokens whose mass reaches top_p.
    Removed tokens get -inf. Greedy returns the T=1 log-softmax (see module docstring).
    """
    logits = logits.float()
    if settings.greedy:
        return torch.log_softmax(logits, dim=-1)
    logits = logits / settings.temperature
    if 0 < settings.top_k < logits.shape[-1]:
        kth = torch.topk(logits, settings.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if settings.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        remove_sorted = mass_before >= settings.top_p
        remove_sorted[..., 0] = False
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


def prompt_generator(seed: int, prompt_id: str) -> torch.Generator:
    """A CPU generator seeded from (seed, prompt id): one random stream per rollout."""
    digest = hashlib.sha256(f"{seed}\x00{prompt_id}".encode()).digest()
    gen = torch.Generator()
    gen.manual_seed(int.from_bytes(digest[:8], "big") & (2**63 - 1))
    return gen


@dataclass
class Generated:
    """One finished row: response ids, their log-probs and the optional top-k distribution."""

    response_ids: list[int]
    logprobs: list[float]
    topk_ids: torch.Tensor | None
    topk_logprobs: torch.Tensor | None


@torch.no_grad()
def generate_batch(
    target: Target,
    prompts: list[list[int]],
    prompt_ids: list[str],
    settings: SamplingSettings,
    store_topk: int = 0,
) -> list[Generated]:
    """Sample one response per prompt, batched with left padding and a shared KV cache.

    Rows stop at their first stop token (kept) or after `max_new_tokens`; finished rows
    are dropped from the batch (and the cache) so long stragglers do not pay for them.
    """
    device = target.device
    n = len(prompts)
    pad = _pad_id(target)
    width = max(len(p) for p in prompts)
    ids = torch.full((n, width), pad, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = target.forward(
        ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1
    )
    cache, logits = out.cache, out.logits[:, -1]
    next_pos = torch.tensor([len(p) for p in prompts], device=device)

    gens = [prompt_generator(settings.seed, pid) for pid in prompt_ids]
    stops = set(target.stop_token_ids)
    tokens: list[list[int]] = [[] for _ in range(n)]
    lps: list[list[float]] = [[] for _ in range(n)]
    tk_ids: list[list[torch.Tensor]] = [[] for _ in range(n)]
    tk_lps: list[list[torch.Tensor]] = [[] for _ in range(n)]
    active = list(range(n))  # original row index of each batch row
    for step in range(settings.max_new_tokens):
        logp = sampling_logprobs(logits, settings).cpu()
        chosen, keep = [], []
        for b, row in enumerate(active):
            if settings.greedy:
                tok = int(torch.argmax(logp[b]))
            else:
                tok = int(torch.multinomial(logp[b].exp(), 1, generator=gens[row]))
            tokens[row].append(tok)
            lps[row].append(float(logp[b, tok]))
            if store_topk:
                top = torch.topk(logp[b], min(store_topk, logp.shape[-1]))
                tk_ids[row].append(top.indices.to(torch.int32))
                tk_lps[row].append(top.values)
            chosen.append(tok)
            if tok not in stops:
                keep.append(b)
        if step == settings.max_new_tokens - 1 or not keep:
            break
        if len(keep) < len(active):
            sel = torch.tensor(keep, device=device)
            cache.batch_select_indices(sel)
            mask, next_pos = mask[sel], next_pos[sel]
            chosen = [chosen[b] for b in keep]
            active = [active[b] for b in keep]
        mask = torch.cat([mask, mask.new_ones((len(active), 1))], dim=1)
        step_ids = torch.tensor(chosen, dtype=torch.long, device=device)[:, None]
        out = target.forward(
            step_ids,
            attention_mask=mask,
            position_ids=next_pos[:, None],
            cache=cache,
            use_cache=True,
        )
        cache, logits = out.cache, out.logits[:, -1]
        next_pos = next_pos + 1
    return [
        Generated(
            tokens[i],
            lps[i],
            torch.stack(tk_ids[i]) if store_topk else None,
            torch.stack(tk_lps[i]) if store_topk else None,
        )
        for i in range(n)
    ]


def _pad_id(target: Target) -> int:
    pad = getattr(target.tokenizer, "pad_token_id", None)
    if pad is None:
        pad = target.stop_token_ids[0] if target.stop_token_ids else 0
    return int(pad)
