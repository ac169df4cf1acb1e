"""Online speculative decoding is lossless and its bookkeeping is right.

- Greedy: the output equals plain autoregressive greedy decoding token for token
  (random HF target; fake drafter that is often right, parallel and semi-AR; and the
  real BlockDrafter / SemiARDrafter).
- Sampling: on a tiny-vocabulary Markov target the distribution of whole generated
  sequences equals the target's exact distribution (enumerated): chi-square at
  significance 1e-4, for standard and block verification, with stop tokens and top-k.
(That block verification never accepts less on average is checked exactly in
test_verify.py.)
"""

from __future__ import annotations

import math

import pytest
import torch

from blockdraft.decoding.loop import ar_generate, decode, speculative_generate
from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
from blockdraft.drafters.semi_ar import SemiARDrafter
from fake_drafter import FakeTarget, MemoDrafter, chi2_pvalue, oracle_drafter
from random_targets import make_random_target

ALPHA = 1e-4


@pytest.fixture(scope="module")
def llama_target():
    # Llama (untied head) random targets produce varied greedy text; Qwen3 ones repeat.
    return make_random_target("llama", seed=1)


def _prompts(target, n: int, length: int = 6, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, target.vocab_size, (length,), generator=g).tolist() for _ in range(n)]


def _check_accounting(result, max_new: int, stops) -> None:
    for out, emitted in zip(result.outputs, result.rounds_emitted, strict=True):
        assert 1 <= len(out) <= max_new
        assert len(out) == 1 + sum(emitted)  # prefill token + what the rounds emitted
        assert all(t not in stops for t in out[:-1])


def test_greedy_equals_autoregressive_fake_drafter(llama_target) -> None:
    """A drafter that memorised the greedy outputs but errs 30% per slot: long accepted
    runs and rejections in the same decode, and still the exact AR output."""
    prompts = _prompts(llama_target, 6)
    ar = [ar_generate(llama_target, p, max_new_tokens=40) for p in prompts]
    drafter = MemoDrafter.of_outputs(llama_target, prompts, ar)
    res = decode(llama_target, drafter, prompts, temperature=0.0, max_new_tokens=40)
    assert res.outputs == res.ar_outputs == ar
    _check_accounting(res, 40, llama_target.stop_token_ids)
    assert drafter.hits > 0
    # the test only means something if rounds both reject early and accept everything
    assert res.histogram[1] > 0 and res.histogram[5] > 0, res.histogram
    assert 1.5 < res.tau < 5.0 and res.tau_ci95[0] <= res.tau <= res.tau_ci95[1]
    assert res.speedup is not None and res.speedup > 0
    lo, hi = res.speedup_ci95  # over the 6 prompts, each timed alternately with its AR decode
    assert lo <= res.speedup <= hi
    no_ar = decode(llama_target, drafter, prompts[:2], max_new_tokens=8, measure_ar=False)
    assert no_ar.speedup is None and no_ar.speedup_ci95 is None


def test_greedy_equals_autoregressive_past_the_sliding_window() -> None:
    """Gemma 3 sliding-window layers (window 64 here): rejected suffixes must still be
    cut back after prompt + output pass the window."""
    target = make_random_target("gemma3", seed=1)
    window = target.model.config.sliding_window
    prompts = _prompts(target, 2, length=window - 14)
    ar = [ar_generate(target, p, max_new_tokens=40) for p in prompts]
    drafter = MemoDrafter.of_outputs(target, prompts, ar)
    res = decode(target, drafter, prompts, temperature=0.0, max_new_tokens=40, measure_ar=False)
    assert all(len(p) + len(o) > window for p, o in zip(prompts, ar, strict=True))
    assert res.outputs == ar
    assert res.histogram[1] > 0 and sum(res.histogram[2:]) > 0, res.histogram


def test_greedy_equals_autoregressive_semi_ar_fake(llama_target) -> None:
    drafter = oracle_drafter(
        llama_target, 3, strength=5.0, noise=1.0, ctx_scale=0.02, markov_scale=3.0, seed=3
    )
    prompts = _prompts(llama_target, 3, seed=4)
    res = decode(llama_target, drafter, prompts, temperature=0.0, max_new_tokens=24)
    assert res.outputs == res.ar_outputs
    _check_accounting(res, 24, llama_target.stop_token_ids)


@pytest.mark.parametrize("arch", ["dflash", "semi_ar"])
def test_greedy_equals_autoregressive_real_drafter(arch: str) -> None:
    target = make_random_target("qwen3")
    torch.manual_seed(0)
    cfg = DrafterConfig.for_target(target, num_layers=1, block_size=5, arch=arch, markov_rank=8)
    drafter = (SemiARDrafter if arch == "semi_ar" else BlockDrafter)(cfg).bind_target(target).eval()
    prompts = _prompts(target, 3, seed=5)
    res = decode(target, drafter, prompts, temperature=0.0, max_new_tokens=24)
    assert res.outputs == res.ar_outputs
    _check_accounting(res, 24, target.stop_token_ids)


def _exact_and_empirical(target, drafter, prompt, n, max_new, verifier, temperature=1.0, top_k=0):
    exact = target.sequence_probs(prompt, max_new, temperature, top_k=top_k)
    keys = sorted(exact)
    counts = torch.zeros(len(keys))
    emitted_total, rounds = [], []
    g = torch.Generator().manual_seed(1234)
    for _ in range(n):
        tr = speculative_generate(
            target,
            drafter,
            prompt,
            temperature=temperature,
            top_k=top_k,
            max_new_tokens=max_new,
            generator=g,
            verifier=verifier,
        )
        counts[keys.index(tuple(tr.tokens))] += 1  # KeyError-free: unknown seq -> ValueError
        emitted_total.append(sum(tr.emitted))
        rounds.append(len(tr.emitted))
    return keys, exact, counts, emitted_total, rounds


def _assert_sampled_tau_agrees_with_offline_mal(target, drafter, prompts, floor):
    """T = 1: rollouts sampled from the target, the drafter's offline MAL on them and its
    online tau on the same prompts agree within a 99.9% interval (both above `floor`, so
    the drafter is tested where it is accepted)."""
    from blockdraft.data.rollouts.sampler import SamplingSettings, generate_batch
    from blockdraft.data.rollouts.store import Rollout
    from blockdraft.evaluation.offline import mal_ci
    from blockdraft.evaluation.scoring import score_rollouts

    settings = SamplingSettings(temperature=1.0, max_new_tokens=20, seed=3)
    gen = generate_batch(target, prompts, [str(i) for i in range(len(prompts))], settings)
    rollouts = [
        Rollout(
            str(i),
            torch.tensor(p),
            torch.as_tensor(r.response_ids),
            torch.as_tensor(r.logprobs).float(),
        )
        for i, (p, r) in enumerate(zip(prompts, gen, strict=True))
    ]
    acc = score_rollouts(drafter, target, rollouts, 1.0, use_cache=False)
    mal, (lo, hi) = mal_ci(acc, n_boot=1000)
    online = decode(
        target, drafter, prompts, temperature=1.0, max_new_tokens=20, seed=5, measure_ar=False
    )
    se_off, se_on = (hi - lo) / 3.92, (online.tau_ci95[1] - online.tau_ci95[0]) / 3.92
    assert mal > floor and online.tau > floor
    assert abs(online.tau - mal) < 3.29 * math.hypot(se_off, se_on), (online.tau, mal)


@pytest.mark.parametrize(
    "verifier,markov,top_k",
    [("standard", 0.0, 0), ("block", 0.0, 0), ("standard", 1.0, 3), ("block", 1.0, 0)],
    ids=["standard", "block", "standard-semiar-topk", "block-semiar"],
)
def test_sampling_output_distribution_equals_target(
    verifier: str, markov: float, top_k: int
) -> None:
    target = FakeTarget(vocab=4 if top_k else 3, seed=2, scale=0.7, stop_token_ids=[0])
    drafter = oracle_drafter(
        target, 3, strength=1.5, noise=1.0, ctx_scale=0.5, markov_scale=markov, seed=4
    )
    keys, exact, counts, _, _ = _exact_and_empirical(
        target, drafter, [1, 2], 1200, 4, verifier, top_k=top_k
    )
    probs = torch.tensor([exact[k] for k in keys], dtype=torch.float64)
    assert probs.sum().item() == pytest.approx(1.0, abs=1e-9)
    pval, stat, df = chi2_pvalue(counts, probs)
    assert df >= 6, "too few cells for the test to have power"
    assert pval > ALPHA, (stat, df)


def test_chi_square_harness_rejects_a_lossy_decoder() -> None:
    """Sanity: sampling the drafter's own proposals without verification is detected."""
    target = FakeTarget(vocab=3, seed=2, scale=0.7, stop_token_ids=[0])
    drafter = oracle_drafter(target, 3, strength=1.5, noise=1.0, ctx_scale=0.5, seed=4)
    exact = target.sequence_probs([1, 2], 4, 1.0)
    keys = sorted(exact)
    counts = torch.zeros(len(keys))
    g = torch.Generator().manual_seed(0)
    from blockdraft.sampling import processed_probs, sample

    for _ in range(1200):  # "accept everything" decoder: first token from p, then the draft
        first = int(
            sample(processed_probs(target.forward(torch.tensor([[1, 2]])).logits[0, -1]), g)
        )
        seq = [first]
        state = drafter.new_state()
        drafter.extend_context(state, target.forward(torch.tensor([[1, 2]])).features, 0)
        toks, _ = drafter.sample_block(state, first, 2, 1.0, g)
        for t in toks.tolist():
            if seq[-1] == 0 or len(seq) == 4:
                break
            seq.append(t)
        counts[keys.index(tuple(seq))] += 1
    pval, _, _ = chi2_pvalue(counts, torch.tensor([exact[k] for k in keys], dtype=torch.float64))
    assert pval < ALPHA


def test_stop_token_and_max_length_truncate(llama_target) -> None:
    drafter = oracle_drafter(llama_target, 4, strength=5.0, noise=1.0, seed=3)
    prompts = _prompts(llama_target, 3, seed=9)
    for max_new in (1, 2, 7):
        res = decode(
            llama_target,
            drafter,
            prompts,
            temperature=0.0,
            max_new_tokens=max_new,
            measure_ar=False,
        )
        _check_accounting(res, max_new, llama_target.stop_token_ids)
        assert all(len(o) == max_new for o in res.outputs)  # no stop token in 7 random tokens
        if max_new == 1:
            assert res.num_rounds == 0 and math.isnan(res.tau)
    # a stop token ends the output: make the target's first greedy token a stop token
    first = decode(llama_target, drafter, prompts[:1], max_new_tokens=3, measure_ar=False).outputs[
        0
    ]
    llama_target.stop_token_ids.append(first[1])
    try:
        res = decode(llama_target, drafter, prompts[:1], max_new_tokens=30, measure_ar=False)
        assert res.outputs[0] == first[:2]
    finally:
        llama_target.stop_token_ids.remove(first[1])


def test_bad_arguments_are_rejected(llama_target) -> None:
    drafter = oracle_drafter(llama_target, 2, seed=0)
    with pytest.raises(ValueError, match="verifier"):
        decode(llama_target, drafter, [[5, 6]], verifier="fancy")
    with pytest.raises(ValueError, match="top_p"):
        decode(llama_target, drafter, [[5, 6]], temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        decode(llama_target, drafter, [[5, 6]], max_new_tokens=0)
