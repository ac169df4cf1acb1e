""" "The distribution we sample from", as used by rollouts, decoding, verification and scoring.

Lossless speculative sampling is lossless with respect to *some* p, and the offline
evaluator agrees with the online decoder only if both use the p the rollouts were drawn
from; so there is one `SamplingSettings` and one logits processing (temperature, then
top-k, then top-p, HF's order), `sampling_logprobs`. `temperature == 0` is greedy: p is
one-hot on the first argmax, the T -> 0 limit of speculative sampling (greedy rollouts
store T = 1 log-probs, which the greedy acceptance never reads). float64 logits stay
float64 (exact-enumeration tests); others become float32.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

# The one default response length: rollouts, decoding, suites, the CLI and the Python API.
MAX_NEW_TOKENS = 128


@dataclass(frozen=True)
class SamplingSettings:
    """How the target samples. `temperature=0` is greedy; `top_k=0`/`top_p=1` disable filters."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = MAX_NEW_TOKENS
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
    if settings.temperature != 1:  # (x / 1 == x: no pass over the vocabulary at T = 1)
        logits = logits / settings.temperature
    top = None
    if 0 < settings.top_k < logits.shape[-1]:
        top = torch.topk(logits, settings.top_k, dim=-1)
        logits = logits.masked_fill(logits < top.values[..., -1:], float("-inf"))
    if settings.top_p < 1:
        if top is None or logits.device.type != "cpu":  # (on a GPU the sort is cheap, and
            remove = top_p_removed(logits, settings.top_p)  # the check below would sync)
        else:
            remove = top_p_removed_within_top_k(logits, top.values, top.indices, settings.top_p)
        logits = logits.masked_fill(remove, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


# A row whose top-p cut lies this close to a cumulative mass is decided by the whole-row
# sort, whose float rounding could differ from the k-entry sort's by a few ulps.
TOP_P_MARGIN = 1e-4


def top_p_removed(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """`[..., V]` bool: the tokens top-p removes (the whole row sorted; HF's rule)."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    remove_sorted = mass_before >= top_p
    remove_sorted[..., 0] = False
    return torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)


def top_p_removed_within_top_k(
    masked: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, top_p: float
) -> torch.Tensor:
    """`top_p_removed(masked, top_p)` when top-k has already left k tokens.

    Why: after top-k at most k columns are finite, so sorting the k values `torch.topk`
    returned decides the cut (a 262k-column sort per row costs ~30x the top-k on Gemma).
    A row is handed to the whole-row sort when the two could disagree: more than k tokens
    tie at the k-th value, two tokens with equal logits straddle the cut (the sort's tie
    order decides which stays), or a cumulative mass lies within `TOP_P_MARGIN` of top_p.
    A row with fewer than k finite logits (a DFlash2 selector's q) needs no hand-over: its
    -inf values sort last and carry no mass.
    """
    remove_k, unsure = _top_p_cut(values, top_p)
    # (counts in float32: exact below 2^24, and a boolean sum is far slower on CPU)
    finite = (masked > float("-inf")).sum(dim=-1, dtype=torch.float32)
    doubtful = (  # (torch.topk puts NaN first; `masked > -inf` does not count it)
        (finite != (values > float("-inf")).sum(dim=-1, dtype=torch.float32))
        | ~torch.isfinite(values[..., 0])
        | unsure
    )
    remove = (masked == float("-inf")).contiguous().scatter_(-1, indices, remove_k)
    if bool(doubtful.any()):
        rows = doubtful.reshape(-1).nonzero()[:, 0]
        flat, width = remove.view(-1, masked.shape[-1]), masked.shape[-1]
        flat[rows] = top_p_removed(masked.reshape(-1, width)[rows], top_p)
    return remove


def _top_p_cut(values: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(`[..., k]` which of the descending `values` top-p removes, `[...]` rows whose cut the
    whole-row sort could place elsewhere: equal values across it, or a cumulative mass
    within `TOP_P_MARGIN` of top_p)."""
    probs = torch.softmax(values, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    remove_k = mass_before >= top_p
    remove_k[..., 0] = False
    cut = remove_k[..., 1:] != remove_k[..., :-1]
    unsure = ((mass_before - top_p).abs() <= TOP_P_MARGIN).any(dim=-1) | (
        cut & (values[..., 1:] == values[..., :-1])
    ).any(dim=-1)
    return remove_k, unsure


def sampling_probs(logits: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """`sampling_logprobs(logits, settings).exp()`, float32, up to rounding.

    Why: under a top-k cutoff on a CPU the softmax runs over the k kept values and is
    scattered into zeros, a few passes over each row instead of a top-k mask, a log-softmax
    and an exp of all of it (training's target rows, verification, scoring). A row the k
    values cannot settle alone (ties beyond the k-th place, fewer than k finite logits, an
    uncertain top-p cut) takes the `sampling_logprobs` route.
    """
    x = logits.float()
    if settings.greedy or not 0 < settings.top_k < x.shape[-1] or x.device.type != "cpu":
        return sampling_logprobs(x, settings).exp()
    if settings.temperature != 1:
        x = x / settings.temperature
    values, indices = torch.topk(x, settings.top_k, dim=-1)
    # (counted in float32: exact below 2^24, and a boolean sum is far slower on CPU)
    at_least_kth = (x >= values[..., -1:]).sum(dim=-1, dtype=torch.float32)
    doubtful = (at_least_kth != settings.top_k) | ~torch.isfinite(values).all(dim=-1)
    if settings.top_p < 1:
        remove_k, unsure = _top_p_cut(values, settings.top_p)
        values = values.masked_fill(remove_k, float("-inf"))
        doubtful |= unsure
    out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)  # (contiguous: viewed below)
    out.scatter_(-1, indices, torch.softmax(values, dim=-1))
    if bool(doubtful.any()):
        rows = doubtful.reshape(-1).nonzero()[:, 0]
        width = x.shape[-1]
        flat = out.view(-1, width)
        flat[rows] = sampling_logprobs(logits.reshape(-1, width)[rows], settings).exp()
    return out


def settings_of(temperature: float, top_p: float = 1.0, top_k: int = 0) -> SamplingSettings:
    """A `SamplingSettings` (validates: clear one-line errors on bad values)."""
    return SamplingSettings(temperature=float(temperature), top_p=float(top_p), top_k=int(top_k))


def processed_probs(
    logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0
) -> torch.Tensor:
    """Logits `[..., V]` -> the processed sampling distribution `[..., V]` (rows sum to 1)."""
    settings = settings_of(temperature, top_p, top_k)
    if settings.greedy:
        dtype = logits.dtype if logits.dtype == torch.float64 else torch.float32
        out = torch.zeros(logits.shape, dtype=dtype, device=logits.device)
        return out.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    if logits.dtype == torch.float64:
        return _f64(logits, settings)  # sampling_logprobs is float32; keep float64 exact
    return sampling_probs(logits, settings)


def _f64(logits: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """float64 version: same filter (the kept set is decided in float32), float64 softmax."""
    kept = torch.isfinite(sampling_logprobs(logits, settings))
    scaled = (logits / settings.temperature).masked_fill(~kept, float("-inf"))
    return torch.softmax(scaled, dim=-1)


def uniform(
    shape: tuple[int, ...],
    generator: torch.Generator | None,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """Uniforms on `device`, drawn on the generator's own device and moved.

    Why: `torch.rand(device="cuda", generator=cpu_generator)` raises, and the decoders
    seed plain CPU generators per prompt. Drawing where the generator lives keeps that
    working on any device and gives the same draws on CPU and GPU for the same seed.
    """
    src = generator.device if generator is not None else device
    return torch.rand(shape, generator=generator, dtype=dtype, device=src).to(device)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row of `probs [..., V]` -> `[...]` long (inverse CDF, reproducible).

    The generator may live on another device than `probs` (see `uniform`); no host sync.
    """
    flat = probs.reshape(-1, probs.shape[-1])
    u = uniform((flat.shape[0], 1), generator, flat.dtype, flat.device)
    cdf = flat.cumsum(dim=-1)
    cdf = cdf / cdf[:, -1:]
    idx = torch.searchsorted(cdf, u, right=True).clamp_max(flat.shape[-1] - 1)
    # Never return a zero-probability token (possible only through float rounding at the
    # top); unconditional `where` rather than `if bad.any()`, which would sync with a GPU.
    bad = flat.gather(-1, idx) <= 0
    idx = torch.where(bad, flat.argmax(dim=-1, keepdim=True), idx)
    return idx.reshape(probs.shape[:-1])
