"""Real speculative decoding at batch 1: a target with a KV cache plus a block drafter.

Prefill gives x_1 and the drafter's first context; each round drafts K tokens from the
anchor, verifies them in one target forward, accepts m and adds one, crops both caches
and feeds the newly verified features. Stop tokens and `max_new_tokens` cut the last
round to what fits, and tau counts what was emitted, so online tau and the offline MAL
of the same rollouts measure one thing: both apply the same processing to the target's
and the drafter's logits. `ar_generate` is the baseline every speedup is timed against,
alternately in the same run. Round steps and indices: docs/architecture.md ("decoding").
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from blockdraft.decoding.proposers import (
    Proposer,
    Sampling,
    proposals_per_round,
    proposer_for,
)
from blockdraft.decoding.result import (
    DecodeResult,
    Progress,
    StepStats,
    Trace,
    speedup_and_ci,
    tau_and_ci,
)
from blockdraft.decoding.steps import DecodeClock, TargetRunner, one_hot_like, pick_token
from blockdraft.decoding.timing import alternate_timed
from blockdraft.decoding.verify import verify_block, verify_onehot, verify_standard
from blockdraft.kernels import cpu_kernels_apply
from blockdraft.kernels.packed_linear import packed_linears
from blockdraft.sampling import MAX_NEW_TOKENS, processed_probs, settings_of

VERIFIERS = ("standard", "block")


@torch.inference_mode()
def ar_generate(
    target: Any,
    prompt_ids: Sequence[int],
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int = MAX_NEW_TOKENS,
    generator: torch.Generator | None = None,
    stats: StepStats | None = None,
    lean: bool = True,
) -> list[int]:
    """Plain autoregressive decoding: the baseline every speedup is measured against.

    It does what HF `generate` does per token and no more (last-row logits only, no
    hidden states, inference mode), so it is at least as fast (bench/decode.py); a small
    target takes the speculative loop's lean forward (`lean=False`: the HF forward)."""
    stops = set(target.stop_token_ids)
    run = TargetRunner(target, lean=lean)
    t0 = time.perf_counter()
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=target.device)
    out = run.step(ids)
    tok = pick_token(out.logits[-1], temperature, top_p, top_k, generator)
    t1 = time.perf_counter()
    tokens = [tok]
    step = torch.empty((1, 1), dtype=torch.long, device=target.device)
    while tok not in stops and len(tokens) < max_new_tokens:
        step.fill_(tok)
        out = run.step(step, out.cache)
        tok = pick_token(out.logits[-1], temperature, top_p, top_k, generator)
        tokens.append(tok)
    if stats is not None:
        t2 = time.perf_counter()
        stats.prefill_s += t1 - t0
        stats.steps += len(tokens) - 1
        stats.step_s += t2 - t1
    return tokens


@torch.inference_mode()
def speculative_generate(
    target: Any,
    drafter: Any,
    prompt_ids: Sequence[int],
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int = MAX_NEW_TOKENS,
    generator: torch.Generator | None = None,
    verifier: str = "standard",
) -> Trace:
    """Speculative decoding of one prompt; see the module docstring for the loop.

    `drafter` is a neural drafter (inference interface of docs/architecture.md) or an
    n-gram drafter (`propose(tokens) -> list`, no features, one-hot q). `Trace.seconds`
    splits the time into prefill, draft (drafter forward / lookup), target (verification
    forward), verify (acceptance test and sampling) and other (cache crop and
    bookkeeping); the drafter's context extension counts as draft. On CPU the target's
    and drafter's fp32 linears run few-row products with packed weights while the loop
    runs (kernels/packed_linear.py)."""
    if verifier not in VERIFIERS:
        raise ValueError(f"unknown verifier {verifier!r}: use one of {VERIFIERS}")
    if not prompt_ids:
        raise ValueError("speculative decoding needs a non-empty prompt")
    run = TargetRunner(target)
    proposer = proposer_for(drafter, Sampling(temperature, top_p, top_k, generator))
    target_model = target.model if run.hf and run.lean is None else None  # lean: no packing
    models = [target_model, drafter if isinstance(drafter, nn.Module) else None]
    on_cpu = cpu_kernels_apply(target.device)
    with packed_linears(*(models if on_cpu else [])) as packed:
        if packed and packed[0]:
            run.use_packed_weights()
        return _speculative_loop(
            run, target, proposer, prompt_ids, temperature, top_p, top_k,
            max_new_tokens, generator, verifier,
        )  # fmt: skip


def _speculative_loop(
    run: TargetRunner,
    target: Any,
    proposer: Proposer,
    prompt_ids: Sequence[int],
    temperature: float,
    top_p: float,
    top_k: int,
    max_new_tokens: int,
    generator: torch.Generator | None,
    verifier: str,
) -> Trace:
    greedy = temperature == 0
    features = proposer.uses_features
    verify = verify_standard if verifier == "standard" else verify_block
    stops = set(target.stop_token_ids)
    dev = target.device
    trace = Trace(list(prompt_ids))  # holds prompt + output while decoding; output at the end
    clock = DecodeClock(trace.seconds)
    ids = torch.tensor([trace.tokens], dtype=torch.long, device=dev)
    out = run.step(ids, keep=1, features=features, croppable=True)
    first = pick_token(out.logits[-1], temperature, top_p, top_k, generator)
    trace.tokens.append(first)
    plen = len(prompt_ids)
    clock.lap("prefill")
    if first in stops or max_new_tokens <= 1:
        trace.tokens = trace.tokens[plen:]
        return trace
    cache = out.cache
    proposer.start(out.features)
    anchor, a = first, plen  # anchor token and its sequence index
    clock.lap("prefill")
    while True:
        # --- draft -------------------------------------------------------------------
        proposal = proposer.propose(trace.tokens, anchor, a)
        k = proposal.tokens.shape[0]
        clock.lap("draft")
        block = torch.empty((1, k + 1), dtype=torch.long, device=dev)
        block[0, 0] = anchor
        block[0, 1:] = proposal.tokens
        clock.lap("other")
        # --- verify ------------------------------------------------------------------
        out = run.step(block, cache, keep=k + 1, features=features, argmax=greedy, top_k=top_k)
        clock.lap("target")
        props = block[0, 1:]
        if greedy:
            best = out.argmax()  # [k+1]: the one host read of the round (with the proposals)
            props = props.tolist()
            m = next((j for j in range(k) if props[j] != best[j]), k)
            new = props[:m] + [best[m]]
        else:
            logits, q, cols, at = out.logits, proposal.q, out.columns, props
            if cols is not None:  # screened rows: only these columns (and q's) carry mass
                extra = [props] if q is None else [props, (q > 0).any(0).nonzero().flatten()]
                cols = torch.unique(torch.cat([cols, *extra]))
                logits, at = logits[:, cols], torch.searchsorted(cols, props)
                q = None if q is None else q[:, cols]
            p = processed_probs(logits, temperature, top_p, top_k)
            if q is not None:
                verdict = verify(at, q.to(p.dtype), p, generator)
            elif verifier == "standard" or k == 0:  # deterministic proposals (prompt lookup)
                verdict = verify_onehot(at, p, generator)
            else:
                verdict = verify(at, one_hot_like(at, p), p, generator)
            m = verdict.accepted
            token = verdict.token if cols is None else int(cols[verdict.token])
            new = props.tolist()[:m] + [token]
        clock.lap("verify")
        # --- bookkeeping ---------------------------------------------------------------
        new = new[: max_new_tokens - (len(trace.tokens) - plen)]
        hit = next((j for j, t in enumerate(new) if t in stops), None)
        if hit is not None:
            new = new[: hit + 1]
        trace.tokens.extend(new)
        trace.accepted.append(m)
        trace.emitted.append(len(new))
        if hit is not None or len(trace.tokens) - plen >= max_new_tokens:
            clock.lap("other")
            trace.tokens = trace.tokens[plen:]
            return trace
        run.crop(cache, a + m + 1)
        clock.lap("other")
        proposer.advance(out.features[:, : m + 1] if features else None, a)
        clock.lap("draft")  # the drafter's context K/V are part of its forward work
        anchor, a = new[-1], a + m + 1
        clock.lap("other")


def decode(
    target: Any,
    drafter: Any,
    prompts_ids: Sequence[Sequence[int]],
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int = MAX_NEW_TOKENS,
    seed: int = 0,
    verifier: str = "standard",
    measure_ar: bool = True,
    warmup: bool = True,
    progress: bool = False,
    callback: Callable[[Progress], None] | None = None,
) -> DecodeResult:
    """Speculative decoding of every prompt, with autoregressive decoding of the same
    prompts timed alternately (AR, spec, AR, spec, ...) for the wall-clock speedup.

    Each prompt i uses its own generators seeded from (seed, i), so a prompt's output
    does not depend on the others or on whether the AR baseline runs. `progress` shows
    a tqdm bar (prompts done, tokens/s, running tau); `callback(Progress)` is called
    after every prompt (the demo's online stage uses it for its own log line).
    """
    settings_of(temperature, top_p, top_k)  # validate up front
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompts_ids:
        raise ValueError("no prompts to decode")
    if verifier not in VERIFIERS:
        raise ValueError(f"unknown verifier {verifier!r}: use one of {VERIFIERS}")
    kw = dict(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens)

    def gen(i: int, stream: int) -> torch.Generator:
        # on the target's device: uniforms are drawn where the probabilities live, with no
        # host round trip per draw (CPU runs keep their streams: a CPU generator)
        device = torch.device(getattr(target, "device", "cpu"))
        device = device if device.type == "cuda" else torch.device("cpu")
        return torch.Generator(device=device).manual_seed(seed * 1_000_003 + 2 * i + stream)

    if warmup:  # first calls pay one-off allocation/dispatch costs; keep them out of timing
        small = dict(kw, max_new_tokens=min(max_new_tokens, 4))
        ar_generate(target, prompts_ids[0], generator=gen(0, 1), **small)
        speculative_generate(
            target, drafter, prompts_ids[0], generator=gen(0, 0), verifier=verifier, **small
        )

    bar = None
    if progress:
        bar = tqdm(total=len(prompts_ids), desc="decoding", unit="prompt", leave=False)
    traces: list[Trace] = []
    ar_outputs: list[list[int]] = []
    ar_stats = StepStats() if measure_ar else None
    spec_s = ar_s = 0.0
    spec_tokens = ar_tokens = 0
    per_prompt: list[tuple[int, float, int, float]] = []  # spec tokens, s, AR tokens, s
    for i, prompt in enumerate(prompts_ids):
        jobs: dict[str, Callable[[], Any]] = {}
        if measure_ar:
            jobs["ar"] = partial(
                ar_generate, target, prompt, generator=gen(i, 1), stats=ar_stats, **kw
            )
        jobs["spec"] = partial(
            speculative_generate,
            target,
            drafter,
            prompt,
            generator=gen(i, 0),
            verifier=verifier,
            **kw,
        )
        results, seconds = alternate_timed(jobs)
        traces.append(results["spec"])
        spec_s += seconds["spec"]
        spec_tokens += len(results["spec"].tokens)
        if measure_ar:
            ar_outputs.append(results["ar"])
            ar_s += seconds["ar"]
            ar_tokens += len(results["ar"])
            per_prompt.append(
                (len(results["spec"].tokens), seconds["spec"], len(results["ar"]), seconds["ar"])
            )
        if bar is not None or callback is not None:
            rounds = sum(len(t.emitted) for t in traces)
            info = Progress(
                done=i + 1,
                total=len(prompts_ids),
                tokens_per_s=spec_tokens / max(spec_s, 1e-12),
                tau=sum(sum(t.emitted) for t in traces) / rounds if rounds else math.nan,
                ar_tokens_per_s=ar_tokens / max(ar_s, 1e-12) if measure_ar else None,
            )
            if bar is not None:
                post = {"tok/s": f"{info.tokens_per_s:.1f}", "tau": f"{info.tau:.2f}"}
                if info.ar_tokens_per_s is not None:
                    post["AR tok/s"] = f"{info.ar_tokens_per_s:.1f}"
                bar.set_postfix(post, refresh=False)
                bar.update(1)
            if callback is not None:
                callback(info)
    if bar is not None:
        bar.close()

    k = proposals_per_round(drafter)
    hist = [0] * (k + 2)
    phase: dict[str, float] = {}
    for t in traces:
        for e in t.emitted:
            hist[e] += 1
        for name, sec in t.seconds.items():
            phase[name] = phase.get(name, 0.0) + sec
    emitted = [t.emitted for t in traces]
    tau, ci = tau_and_ci(emitted, seed=seed)
    tps = spec_tokens / max(spec_s, 1e-12)
    ar_tps = ar_tokens / max(ar_s, 1e-12) if measure_ar else None
    speedup_ci = None
    if ar_tps and spec_s > 0:
        speedup_ci = speedup_and_ci(*zip(*per_prompt, strict=True), seed=seed)[1]
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
        seconds=phase,
        ar_stats=ar_stats,
        speedup_ci95=speedup_ci,
    )
