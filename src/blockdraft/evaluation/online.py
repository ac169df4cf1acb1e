"""Real speculative decoding at batch 1: a target with a KV cache plus a block drafter.

The loop (METHODS.md §0, docs/architecture.md indexing):

1. Prefill the prompt (length P): the target gives x_1 and the features of positions
   0..P-1, which become the drafter's context. x_1 is not a drafting round.
2. A round with anchor x_n at sequence index a: the drafter (context = positions < a)
   proposes K tokens; one target forward over `[x_n, y_1..y_K]` (positions a..a+K) gives
   the K+1 verification distributions; the verifier accepts m proposals and adds one
   token (correction or bonus). The round emits m+1 tokens.
3. Cut the target cache back to a+m+1 positions (anchor + accepted proposals; the new
   anchor is not fed yet), append the features of positions a..a+m to the drafter
   context (strictly before the new anchor at a+m+1), and repeat.

Stop tokens and `max_new_tokens` truncate the output; a round crossing either emits only
what fits, and tau counts what was emitted, so it is comparable with the offline MAL of
the same rollouts (which ends the last round at the end of the rollout).

Distributions: the target's p is `processed_probs` at the sampling settings; the
drafter's q is the *same* processing of the drafter's logits (temperature, top-k, top-p),
which is also what `scoring.py` uses, so online tau and offline MAL measure one thing.
For a semi-AR drafter the slots are drafted one by one through `compute_logits` with the
previously drafted token (its Markov head); a parallel drafter drafts all K at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import torch

from blockdraft.evaluation.bench import alternate_timed
from blockdraft.evaluation.bootstrap import ratio_ci
from blockdraft.evaluation.verify import verify_block, verify_greedy, verify_standard
from blockdraft.models.target import crop_cache
from blockdraft.sampling import processed_probs, sample, settings_of

VERIFIERS = ("standard", "block")


@dataclass
class Trace:
    """One prompt's speculative decode: output tokens and per-round accounting."""

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)  # proposals accepted per round
    emitted: list[int] = field(default_factory=list)  # tokens emitted per round (after truncation)


@dataclass
class DecodeResult:
    """Outputs and measurements of `decode` (tau counts only drafting rounds)."""

    outputs: list[list[int]]
    rounds_accepted: list[list[int]]
    rounds_emitted: list[list[int]]
    tau: float
    tau_ci95: tuple[float, float]
    histogram: list[int]  # histogram[j] = rounds that emitted j tokens, j = 0..K+1
    tokens_per_s: float
    ar_tokens_per_s: float | None
    speedup: float | None
    ar_outputs: list[list[int]] | None
    settings: dict[str, Any]

    @property
    def num_rounds(self) -> int:
        return sum(len(r) for r in self.rounds_emitted)

    def per_prompt_rounds(self) -> list[int]:
        return [len(r) for r in self.rounds_emitted]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["num_rounds"] = self.num_rounds
        return out


def _num_proposals(drafter: Any) -> int:
    cfg = getattr(drafter, "config", None)
    k = getattr(cfg, "num_proposals", None) if cfg is not None else None
    return int(k if k is not None else drafter.num_proposals)


def _is_sequential(drafter: Any) -> bool:
    """True for drafters whose slot k depends on the token drafted at k-1 (semi-AR)."""
    flag = getattr(drafter, "sequential", None)
    if flag is not None:
        return bool(flag)
    cfg = getattr(drafter, "config", None)
    return getattr(cfg, "arch", "dflash") == "semi_ar"


@torch.no_grad()
def draft_block(
    drafter: Any,
    state: Any,
    anchor_id: int,
    anchor_position: int,
    temperature: float,
    top_p: float,
    top_k: int,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Propose K tokens from q = processed drafter distribution -> (tokens [K], q [K,V])."""
    if not _is_sequential(drafter):
        q = processed_probs(
            drafter.draft_logits(state, anchor_id, anchor_position), temperature, top_p, top_k
        )
        tokens = q.argmax(-1) if temperature == 0 else sample(q, generator)
        return tokens, q
    hidden = drafter.draft_hidden(state, anchor_id, anchor_position)  # [K, H]
    prev = torch.tensor([int(anchor_id)], device=hidden.device)
    tokens, qs = [], []
    for k in range(hidden.shape[0]):
        logits = drafter.compute_logits(hidden[k : k + 1], prev)[0]
        q = processed_probs(logits, temperature, top_p, top_k)
        tok = q.argmax(-1) if temperature == 0 else sample(q, generator)
        tokens.append(tok)
        qs.append(q)
        prev = tok.reshape(1).to(hidden.device)
    return torch.stack(tokens), torch.stack(qs)


def _first_token(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, gen) -> int:
    if temperature == 0:
        return int(logits.argmax())
    return int(sample(processed_probs(logits, temperature, top_p, top_k), gen))


@torch.no_grad()
def ar_generate(
    target: Any,
    prompt_ids: Sequence[int],
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int = 64,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Plain autoregressive decoding with the same target/KV-cache code (the baseline)."""
    stops = set(target.stop_token_ids)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=target.device)
    out = target.forward(ids, use_cache=True)
    cache, tokens = out.cache, []
    while True:
        tok = _first_token(out.logits[0, -1], temperature, top_p, top_k, generator)
        tokens.append(tok)
        if tok in stops or len(tokens) >= max_new_tokens:
            return tokens
        step = torch.tensor([[tok]], dtype=torch.long, device=target.device)
        out = target.forward(step, cache=cache, use_cache=True)
        cache = out.cache


@torch.no_grad()
def speculative_generate(
    target: Any,
    drafter: Any,
    prompt_ids: Sequence[int],
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int = 64,
    generator: torch.Generator | None = None,
    verifier: str = "standard",
) -> Trace:
    """Speculative decoding of one prompt; see the module docstring for the loop."""
    if verifier not in VERIFIERS:
        raise ValueError(f"unknown verifier {verifier!r}: use one of {VERIFIERS}")
    if not prompt_ids:
        raise ValueError("speculative decoding needs a non-empty prompt")
    greedy = temperature == 0
    verify = verify_standard if verifier == "standard" else verify_block
    stops = set(target.stop_token_ids)
    dev = target.device
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=dev)
    out = target.forward(ids, use_cache=True)
    cache = out.cache
    first = _first_token(out.logits[0, -1], temperature, top_p, top_k, generator)
    trace = Trace([first])
    if first in stops or max_new_tokens <= 1:
        return trace
    state = drafter.new_state()
    drafter.extend_context(state, out.features[:, : ids.shape[1]], 0)
    anchor, a = first, ids.shape[1]  # anchor token and its sequence index
    while True:
        proposals, q = draft_block(drafter, state, anchor, a, temperature, top_p, top_k, generator)
        block = torch.cat([torch.tensor([anchor], device=dev), proposals.to(dev)]).unsqueeze(0)
        out = target.forward(block, cache=cache, use_cache=True)
        cache = out.cache
        logits = out.logits[0]
        proposals = proposals.cpu()
        if greedy:
            verdict = verify_greedy(proposals, logits.cpu())
        else:
            p = processed_probs(logits, temperature, top_p, top_k).cpu()
            verdict = verify(proposals, q.cpu().to(p.dtype), p, generator)
        m = verdict.accepted
        new = proposals[:m].tolist() + [verdict.token]
        new = new[: max_new_tokens - len(trace.tokens)]
        hit = next((j for j, t in enumerate(new) if t in stops), None)
        if hit is not None:
            new = new[: hit + 1]
        trace.tokens.extend(new)
        trace.accepted.append(m)
        trace.emitted.append(len(new))
        if hit is not None or len(trace.tokens) >= max_new_tokens:
            return trace
        crop_cache(cache, a + m + 1)
        if state.length > a:  # a drafter that cached anything beyond the verified context
            state.crop(a)
        drafter.extend_context(state, out.features[:, : m + 1], a)
        anchor, a = verdict.token, a + m + 1


def tau_and_ci(
    rounds_emitted: Sequence[Sequence[int]], seed: int = 0
) -> tuple[float, tuple[float, float]]:
    """tau = tokens emitted by drafting rounds / drafting rounds, with a bootstrap CI.

    The CI resamples prompts (the independent units) when there are at least 8 with
    rounds; with fewer it resamples rounds, which ignores within-prompt correlation.
    """
    per_prompt = [r for r in rounds_emitted if len(r)]
    rounds = sum(len(r) for r in per_prompt)
    if rounds == 0:
        return math.nan, (math.nan, math.nan)
    tau = sum(sum(r) for r in per_prompt) / rounds
    if len(per_prompt) >= 8:
        num, den = [sum(r) for r in per_prompt], [len(r) for r in per_prompt]
    else:
        num = [x for r in per_prompt for x in r]
        den = [1] * len(num)
    if len(num) < 2:
        return tau, (math.nan, math.nan)
    f64 = torch.float64
    _, ci = ratio_ci(
        torch.tensor(num, dtype=f64), torch.tensor(den, dtype=f64), n_boot=2000, seed=seed
    )
    return tau, ci


def decode(
    target: Any,
    drafter: Any,
    prompts_ids: Sequence[Sequence[int]],
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int = 64,
    seed: int = 0,
    verifier: str = "standard",
    measure_ar: bool = True,
    warmup: bool = True,
) -> DecodeResult:
    """Speculative decoding of every prompt, with autoregressive decoding of the same
    prompts timed alternately (AR, spec, AR, spec, ...) for the wall-clock speedup.

    Each prompt i uses its own generators seeded from (seed, i), so a prompt's output
    does not depend on the others or on whether the AR baseline runs.
    """
    settings_of(temperature, top_p, top_k)  # validate up front
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompts_ids:
        raise ValueError("no prompts to decode")
    kw = dict(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens)

    def gen(i: int, stream: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed * 1_000_003 + 2 * i + stream)

    if warmup:  # first calls pay one-off allocation/dispatch costs; keep them out of timing
        small = dict(kw, max_new_tokens=min(max_new_tokens, 4))
        ar_generate(target, prompts_ids[0], generator=gen(0, 1), **small)
        speculative_generate(
            target, drafter, prompts_ids[0], generator=gen(0, 0), verifier=verifier, **small
        )

    traces: list[Trace] = []
    ar_outputs: list[list[int]] = []
    spec_s = ar_s = 0.0
    for i, prompt in enumerate(prompts_ids):
        spec = partial(
            speculative_generate,
            target,
            drafter,
            prompt,
            generator=gen(i, 0),
            verifier=verifier,
            **kw,
        )
        jobs = (
            {"ar": partial(ar_generate, target, prompt, generator=gen(i, 1), **kw)}
            if measure_ar
            else {}
        )
        jobs["spec"] = spec
        results, seconds = alternate_timed(jobs)
        traces.append(results["spec"])
        spec_s += seconds["spec"]
        if measure_ar:
            ar_outputs.append(results["ar"])
            ar_s += seconds["ar"]

    k = _num_proposals(drafter)
    hist = [0] * (k + 2)
    for t in traces:
        for e in t.emitted:
            hist[e] += 1
    emitted = [t.emitted for t in traces]
    tau, ci = tau_and_ci(emitted, seed=seed)
    spec_tokens = sum(len(t.tokens) for t in traces)
    tps = spec_tokens / max(spec_s, 1e-12)
    ar_tps = sum(len(o) for o in ar_outputs) / max(ar_s, 1e-12) if measure_ar else None
    return DecodeResult(
        outputs=[t.tokens for t in traces],
        rounds_accepted=[t.accepted for t in traces],
        rounds_emitted=emitted,
        tau=tau,
        tau_ci95=ci,
        histogram=hist,
        tokens_per_s=tps,
        ar_tokens_per_s=ar_tps,
        speedup=(tps / ar_tps) if ar_tps else None,
        ar_outputs=ar_outputs if measure_ar else None,
        settings=dict(kw, seed=seed, verifier=verifier, num_proposals=k),
    )
