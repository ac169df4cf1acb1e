"""Batched sampling from a `Target`: the exact distribution used, token by token.

Why our own KV-cache loop and not HF `generate`: every realised token needs its
log-probability under the distribution it was *actually drawn from* (temperature, top-k,
top-p as HF applies them), and randomness that belongs to the prompt, not to the batch:
the uniform behind token t of a row is a hash of (seed, prompt id, t) on the device, and
the token is drawn by inverse CDF (`row_keys`, `counter_uniform`, `draw_tokens`). So a row
never depends on its batch, shard or rank, a resumed run equals an uninterrupted one,
and CPU and GPU draw alike. Greedy rows store T = 1 log-probs (docs/architecture.md), or
none: the greedy choice alone needs no 262k-column softmax, so on a CPU it takes the exact
argmax through the int8 screen of the LM head (`kernels/argmax_screen.py`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from blockdraft.kernels import cpu_kernels_apply
from blockdraft.kernels.argmax_screen import ScreenedArgmaxHead
from blockdraft.sampling import SamplingSettings, sampling_logprobs
from blockdraft.targets.target import Target

__all__ = [
    "Generated",
    "SamplingSettings",
    "counter_uniform",
    "draw_tokens",
    "generate_batch",
    "greedy_screen",
    "row_keys",
    "sampling_logprobs",
]


# --- counter-based per-row randomness -----------------------------------------------------

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32) without int64 overflow (c split in 16-bit halves)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser ("lowbias32", C. Wellons): good avalanche, 5 tensor ops."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_keys(seed: int, prompt_ids: list[str], device: torch.device | str = "cpu") -> torch.Tensor:
    """Int64 `[B, 2]`: two 32-bit words per row from SHA-256(seed, prompt id).

    The key names the row's random stream; it depends on nothing but the seed and the
    prompt id, so a prompt draws the same tokens in any batch, shard, rank or device.
    """
    words = []
    for pid in prompt_ids:
        digest = hashlib.sha256(f"{seed}\x00{pid}".encode()).digest()
        words.append([int.from_bytes(digest[:4], "big"), int.from_bytes(digest[4:8], "big")])
    return torch.tensor(words, dtype=torch.int64, device=device).reshape(-1, 2)


def counter_uniform(keys: torch.Tensor, step: int | torch.Tensor) -> torch.Tensor:
    """Float64 `[B]` uniform in [0, 1) for token `step` of each row (53 random bits).

    A pure function of (key, step): no generator state to carry, save or split.
    """
    step_t = torch.as_tensor(step, dtype=torch.int64, device=keys.device) & _M32
    a = _hash32(_hash32(keys[:, 0] ^ _hash32(step_t ^ 0x68E31DA4)) ^ keys[:, 1])
    b = _hash32(a ^ _hash32(keys[:, 1] ^ 0x1B56C4E9))
    return ((a << 21) | (b >> 11)).double() * 2.0**-53


def draw_tokens(logp: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw per row of `logp [B, V]` with `uniform [B]` -> long `[B]`.

    The CDF is accumulated in float64 so tokens as unlikely as 1e-12 keep their share; a
    zero-probability (filtered) token is never returned.
    """
    probs = logp.exp().double()
    cdf = probs.cumsum(dim=-1)
    target = (uniform.to(cdf.dtype) * cdf[:, -1])[:, None]
    idx = torch.searchsorted(cdf, target, right=True).clamp_max(logp.shape[-1] - 1)
    bad = probs.gather(-1, idx) <= 0  # only through rounding at the very top of the CDF
    idx = torch.where(bad, probs.argmax(dim=-1, keepdim=True), idx)
    return idx[:, 0]


# --- the generation loop -----------------------------------------------------------------


@dataclass
class Generated:
    """One finished row: response ids, their log-probs (NaN when not stored) and the optional
    top-k distribution."""

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
    store_logprobs: bool = True,
) -> list[Generated]:
    """Sample one response per prompt, batched with left padding and a shared KV cache.

    Rows stop at their first stop token (kept) or after `max_new_tokens`; finished rows
    are dropped from the batch (and the cache) so long stragglers do not pay for them.
    Everything stays on the target's device until the batch is done. Without log-probs
    (greedy, no top-k only) a CPU target with a large head is never asked for logits.
    """
    if not store_logprobs and (not settings.greedy or store_topk):
        raise ValueError(
            "only greedy rollouts without top-k can leave out log-probs "
            f"(temperature {settings.temperature}, store_topk {store_topk})"
        )
    screen = None if store_logprobs else greedy_screen(target)
    device = target.device
    n, steps = len(prompts), settings.max_new_tokens
    pad = _pad_id(target)
    width = max(len(p) for p in prompts)
    ids = torch.full((n, width), pad, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out, cache = _step(target, ids, mask, positions, None, screen is not None)
    next_pos = torch.tensor([len(p) for p in prompts], device=device)

    keys = row_keys(settings.seed, prompt_ids, device)
    stops = torch.tensor(sorted(target.stop_token_ids) or [-1], device=device)
    tokens = torch.zeros((n, steps), dtype=torch.long, device=device)
    lps = torch.zeros((n, steps), dtype=torch.float32, device=device)
    lengths = torch.zeros(n, dtype=torch.long, device=device)
    k = min(store_topk, target.vocab_size)
    tk_ids = torch.zeros((n, steps, k), dtype=torch.int32, device=device) if k else None
    tk_lps = torch.zeros((n, steps, k), dtype=torch.float32, device=device) if k else None
    rows = torch.arange(n, device=device)  # original row index of each batch row
    if not store_logprobs:
        lps.fill_(float("nan"))
    for step in range(steps):
        if screen is not None:  # `out` is the last position's final hidden state
            chosen = screen.argmax(out).to(device)
        else:
            logp = sampling_logprobs(out, settings)
            if settings.greedy:
                chosen = logp.argmax(dim=-1)
            else:
                chosen = draw_tokens(logp, counter_uniform(keys[rows], step))
            if store_logprobs:
                lps[rows, step] = logp.gather(-1, chosen[:, None])[:, 0]
        tokens[rows, step] = chosen
        lengths[rows] = step + 1
        if k:
            top = torch.topk(logp, k, dim=-1)
            tk_ids[rows, step] = top.indices.to(torch.int32)  # type: ignore[index]
            tk_lps[rows, step] = top.values  # type: ignore[index]
        if step == steps - 1:
            break
        finished = torch.isin(chosen, stops)
        if bool(finished.any()):  # the one host sync per token
            keep = (~finished).nonzero()[:, 0]
            if keep.numel() == 0:
                break
            cache.batch_select_indices(keep)
            mask, next_pos, chosen, rows = mask[keep], next_pos[keep], chosen[keep], rows[keep]
        mask = torch.cat([mask, mask.new_ones((rows.numel(), 1))], dim=1)
        out, cache = _step(
            target, chosen[:, None], mask, next_pos[:, None], cache, screen is not None
        )
        next_pos = next_pos + 1
    lengths_l = lengths.tolist()
    tokens_c, lps_c = tokens.cpu(), lps.cpu()
    tk_ids_c = tk_ids.cpu() if tk_ids is not None else None
    tk_lps_c = tk_lps.cpu() if tk_lps is not None else None
    return [
        Generated(
            tokens_c[i, :m].tolist(),
            lps_c[i, :m].tolist(),
            tk_ids_c[i, :m].clone() if tk_ids_c is not None else None,
            tk_lps_c[i, :m].clone() if tk_lps_c is not None else None,
        )
        for i, m in enumerate(lengths_l)
    ]


def _step(
    target: Target,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    positions: torch.Tensor,
    cache: Any,
    hidden_only: bool = False,
) -> tuple[torch.Tensor, Any]:
    """One model call for generation: last-position logits `[B, V]` (or, `hidden_only`, the
    decoder's final hidden state `[B, H]`, for the screened argmax) and the cache.

    Calls the HF model directly (not `Target.forward`): generation needs no hidden
    states, and asking for them keeps every layer's output alive.
    """
    kwargs: dict[str, Any] = {
        "input_ids": input_ids,
        "attention_mask": mask,
        "position_ids": positions,
        "use_cache": True,
    }
    if cache is not None:
        kwargs[target._cache_kwarg] = cache
    if hidden_only:
        out = target.model.get_decoder()(**kwargs)
    else:
        out = target.model(**kwargs, logits_to_keep=1)
    new_cache = out.get("cache", None) if hasattr(out, "get") else None
    if new_cache is None:  # transformers 4.x
        new_cache = out.past_key_values
    return (out.last_hidden_state if hidden_only else out.logits)[:, -1], new_cache


def greedy_screen(target: Target) -> ScreenedArgmaxHead | None:
    """The exact screened argmax of the target's head where it beats the fp32 head: a CPU
    target (and `cpu_kernels_apply`), a large plain fp32 head, a fast screen; else None."""
    if not cpu_kernels_apply(target.device):
        return None
    screen = ScreenedArgmaxHead.for_target(target)
    return screen if screen is not None and screen.fast else None


def _pad_id(target: Target) -> int:
    pad = getattr(target.tokenizer, "pad_token_id", None)
    if pad is None:
        pad = target.stop_token_ids[0] if target.stop_token_ids else 0
    return int(pad)
