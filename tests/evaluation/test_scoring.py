"""Offline scoring agrees with online decoding, and its cache and chunking are exact.

- Greedy: when the rollout *is* the greedy output, the offline expected rounds of each
  rollout equal the online decoder's rounds for that prompt exactly (A is 0/1).
- Sampling, exact: on a tiny Markov target, the offline expected rounds averaged over the
  enumerated target distribution equals the online decoder's mean rounds (Monte Carlo,
  99.9% normal CI).
- Sampling, real drafter on a random HF target: online tau and offline MAL on rollouts
  of the same prompts/settings agree within their combined 99.9% interval.
"""

from __future__ import annotations

import math

import pytest
import torch

import blockdraft.evaluation.scoring as scoring
from blockdraft.data.rollouts.sampler import SamplingSettings, generate_batch
from blockdraft.data.rollouts.store import Rollout
from blockdraft.decoding.loop import ar_generate, decode, speculative_generate
from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
from blockdraft.drafters.semi_ar import SemiARDrafter
from blockdraft.evaluation.offline import mal_ci, offline_stats
from blockdraft.evaluation.scoring import acceptance_tensor, score_rollouts
from blockdraft.sampling import processed_probs
from fake_drafter import FakeTarget, MemoDrafter, oracle_drafter
from random_targets import make_random_target

Z = 3.29  # two-sided 99.9%


def _rollout(
    i: int, prompt: list[int], response: list[int], logprobs: list[float] | None = None
) -> Rollout:
    lp = torch.tensor(
        logprobs if logprobs is not None else [0.0] * len(response), dtype=torch.float32
    )
    return Rollout(str(i), torch.tensor(prompt), torch.tensor(response), lp)


def test_greedy_offline_rounds_equal_online_rounds_per_prompt(tmp_path) -> None:
    target = make_random_target("llama", seed=1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, target.vocab_size, (6,), generator=g).tolist() for _ in range(5)]
    outs = [ar_generate(target, p, max_new_tokens=30) for p in prompts]
    drafter = MemoDrafter.of_outputs(target, prompts, outs)
    online = decode(target, drafter, prompts, temperature=0.0, max_new_tokens=30, measure_ar=False)
    assert online.outputs == outs
    rollouts = [_rollout(i, p, o) for i, (p, o) in enumerate(zip(prompts, outs, strict=True))]
    acc = score_rollouts(drafter, target, rollouts, 0.0, cache_dir=tmp_path)
    assert all(a.shape == (len(o) - 1, 4) for a, o in zip(acc, outs, strict=True))
    assert set(torch.cat(acc).unique().tolist()) <= {0.0, 1.0}
    stats = offline_stats(acc)
    assert stats.per_rollout_rounds.tolist() == [float(n) for n in online.per_prompt_rounds()]
    assert stats.mal == pytest.approx(online.tau, abs=1e-12)
    assert 1.5 < stats.mal < 5.0  # non-trivial: long accepted runs and rejections


def test_sampling_offline_expected_rounds_equal_online_exactly_enumerated() -> None:
    target = FakeTarget(vocab=3, seed=6, scale=1.0, stop_token_ids=[0])  # mean length 4.5 of 6
    drafter = oracle_drafter(
        target, 3, strength=1.5, noise=1.0, ctx_scale=0.5, markov_scale=1.0, seed=8
    )
    prompt, max_new, temp, top_k = [2, 1], 6, 0.9, 2
    exact = target.sequence_probs(prompt, max_new, temp, top_k=top_k)
    rollouts, weights = [], []
    for i, (resp, prob) in enumerate(exact.items()):
        seq = torch.tensor([prompt + list(resp)])
        probs = processed_probs(target.forward(seq).logits[0], temp, top_k=top_k)
        lp = [math.log(float(probs[len(prompt) - 1 + j, t])) for j, t in enumerate(resp)]
        rollouts.append(_rollout(i, prompt, list(resp), lp))
        weights.append(prob)
    acc = score_rollouts(drafter, target, rollouts, temp, top_k=top_k, use_cache=False)
    per = offline_stats(acc).per_rollout_rounds
    expected_rounds = float((per * torch.tensor(weights, dtype=torch.float64)).sum())

    g = torch.Generator().manual_seed(0)
    rounds = torch.tensor(
        [
            len(
                speculative_generate(
                    target,
                    drafter,
                    prompt,
                    temperature=temp,
                    top_k=top_k,
                    max_new_tokens=max_new,
                    generator=g,
                ).emitted
            )
            for _ in range(1500)
        ],
        dtype=torch.float64,
    )
    se = float(rounds.std() / math.sqrt(rounds.numel()))
    assert abs(float(rounds.mean()) - expected_rounds) < Z * se, (
        float(rounds.mean()),
        expected_rounds,
        se,
    )
    # and the drafter matters: with no acceptance every rollout would need L-1 rounds
    no_accept = sum(w * (len(r.response_ids) - 1) for w, r in zip(weights, rollouts, strict=True))
    assert expected_rounds < no_accept - 10 * se


@pytest.mark.parametrize("arch", ["dflash", "semi_ar"])
def test_sampling_online_tau_agrees_with_offline_mal_real_drafter(arch: str) -> None:
    """Random Qwen3 target at T=1/top-p 0.95 and an untrained drafter: both near-uniform,
    so acceptance is high and not trivial; rollouts come from the rollout generator (its
    own processing of the logits), the decoder from `decode`. The semi-AR drafter's Markov
    head gets random non-zero weights so its sequential path matters."""
    target = make_random_target("qwen3")
    torch.manual_seed(0)
    cfg = DrafterConfig.for_target(target, num_layers=1, block_size=5, arch=arch, markov_rank=8)
    drafter = (SemiARDrafter if arch == "semi_ar" else BlockDrafter)(cfg).bind_target(target).eval()
    if arch == "semi_ar":
        with torch.no_grad():
            drafter.markov_head.w2.normal_(0.0, 0.3)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, target.vocab_size, (5,), generator=g).tolist() for _ in range(16)]
    settings = SamplingSettings(temperature=1.0, top_p=0.95, top_k=0, max_new_tokens=20, seed=3)
    gen = generate_batch(target, prompts, [str(i) for i in range(16)], settings)
    rollouts = [
        _rollout(i, p, r.response_ids, r.logprobs)
        for i, (p, r) in enumerate(zip(prompts, gen, strict=True))
    ]
    acc = score_rollouts(drafter, target, rollouts, 1.0, 0.95, 0, use_cache=False)
    mal, (lo, hi) = mal_ci(acc, n_boot=1000)
    online = decode(
        target,
        drafter,
        prompts,
        temperature=1.0,
        top_p=0.95,
        max_new_tokens=20,
        seed=5,
        measure_ar=False,
    )
    se_off = (hi - lo) / (2 * 1.96)
    se_on = (online.tau_ci95[1] - online.tau_ci95[0]) / (2 * 1.96)
    assert 1.5 < mal < 4.9 and 1.5 < online.tau < 4.9
    assert abs(online.tau - mal) < Z * math.hypot(se_off, se_on), (online.tau, mal, se_on, se_off)


def test_cache_and_chunking_are_exact(tmp_path, monkeypatch) -> None:
    target = make_random_target("qwen3")
    torch.manual_seed(0)
    drafter = (
        BlockDrafter(DrafterConfig.for_target(target, num_layers=1, block_size=4))
        .bind_target(target)
        .eval()
    )
    g = torch.Generator().manual_seed(2)
    rollouts = []
    for i in range(3):
        resp = torch.randint(3, target.vocab_size, (9 + i,), generator=g)
        rollouts.append(
            _rollout(
                i, [5, 6, 7], resp.tolist(), (-torch.rand(resp.numel(), generator=g) * 6).tolist()
            )
        )
    base = score_rollouts(drafter, target, rollouts, 1.0, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.safetensors"))) == 1
    # chunked computation (2 anchors per forward, 1 row of logits at a time) is identical
    monkeypatch.setattr(scoring, "LOGIT_BUDGET", 1)
    small = [
        acceptance_tensor(
            drafter, target, r.prompt_ids, r.response_ids, r.logprobs, 1.0, anchor_chunk=2
        )
        for r in rollouts
    ]
    for a, b in zip(base, small, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    def boom(*a, **k):
        raise AssertionError("recomputed although cached")

    monkeypatch.setattr(scoring, "acceptance_tensor", boom)
    again = score_rollouts(drafter, target, rollouts, 1.0, cache_dir=tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(base, again, strict=True))
    with pytest.raises(AssertionError, match="recomputed"):  # other settings: a new entry
        score_rollouts(drafter, target, rollouts, 0.5, cache_dir=tmp_path)
    # entries beyond L are zero; values are probabilities
    for a, r in zip(base, rollouts, strict=True):
        L = r.response_len
        for n in range(1, L):
            assert torch.all(a[n - 1, L - n :] == 0)
        assert torch.all((a >= 0) & (a <= 1))


def test_bad_rollouts_are_rejected() -> None:
    target = FakeTarget(vocab=3)
    drafter = oracle_drafter(target, 2)
    with pytest.raises(ValueError, match="log-prob"):
        acceptance_tensor(
            drafter, target, torch.tensor([1]), torch.tensor([1, 2, 1]), torch.zeros(2), 1.0
        )
    with pytest.raises(ValueError, match="empty prompt"):
        acceptance_tensor(
            drafter, target, torch.tensor([], dtype=torch.long), torch.tensor([1, 2]), None, 0.0
        )
    assert acceptance_tensor(
        drafter, target, torch.tensor([1]), torch.tensor([2]), None, 0.0
    ).shape == (0, 2)


class _TargetSpaceOnly:
    """A drafter seen without its draft-space head: scoring falls back to target space."""

    def __init__(self, drafter) -> None:
        self._drafter = drafter

    def __getattr__(self, name: str):
        if name in ("compute_draft_logits", "draft_ids"):
            raise AttributeError(name)
        return getattr(self._drafter, name)


@pytest.mark.parametrize("kind", ["parallel", "semi_ar", "hybrid"])
@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, 0, 1.0), (0.8, 0, 1.0), (1.0, 5, 0.9)])
def test_draft_vocab_scoring_equals_target_space(kind, temperature, top_k, top_p) -> None:
    """Scoring in the drafter's reduced vocabulary (`compute_draft_logits`) gives the same
    acceptances as the target-space logits with -inf outside it (the path it replaced,
    taken here by hiding `compute_draft_logits`): argmax exactly, q(x) to float rounding,
    including labels outside the draft vocabulary (q = 0) and the hybrid's confidence."""
    from blockdraft.drafters.hybrid import HybridDrafter
    from blockdraft.drafters.ngram import NgramDrafter

    target = make_random_target("qwen3", seed=4)
    torch.manual_seed(0)
    arch = "semi_ar" if kind == "semi_ar" else "dflash"
    cfg = DrafterConfig.for_target(
        target, num_layers=1, block_size=5, draft_vocab_size=40, arch=arch
    )
    drafter = (SemiARDrafter if kind == "semi_ar" else BlockDrafter)(cfg).bind_target(target)
    g = torch.Generator().manual_seed(1)
    drafter.set_draft_vocab(torch.randperm(target.vocab_size, generator=g)[:40].sort().values)
    drafter.eval()
    scored = drafter
    if kind == "hybrid":
        scored = HybridDrafter(drafter, NgramDrafter(num_proposals=4), min_confidence=0.2)
    in_vocab = drafter.draft_ids
    # one rollout continues with the drafter's own first-slot argmax, so greedy proposals
    # are accepted there (the comparison is not between all-zero tensors)
    seq = [5, 6, 7, 8]
    with torch.no_grad():
        for _ in range(10):
            ids = torch.tensor([seq])
            feats = target.forward(ids, logits_to_keep=1).features
            hidden = drafter.forward_blocks(feats, ids, torch.tensor([[len(seq) - 1]]))[0, 0]
            logits = drafter.compute_logits(hidden[:1], torch.tensor([seq[-1]]))
            seq.append(int(logits[0].argmax()))
    rows = [_rollout(9, seq[:4], seq[4:], [-0.5] * 10)]
    for i in range(3):  # responses mixing draft-vocab tokens and others
        pool = torch.cat([in_vocab, torch.randint(3, target.vocab_size, (20,), generator=g)])
        resp = pool[torch.randint(pool.numel(), (12,), generator=g)]
        rows.append(_rollout(i, [5, 6, 7, *resp[:3].tolist()], resp.tolist(),
                             (-torch.rand(12, generator=g) * 4).tolist()))  # fmt: skip
    args = dict(temperature=temperature, top_p=top_p, top_k=top_k)
    fast = [acceptance_tensor(scored, target, r.prompt_ids, r.response_ids, r.logprobs, **args)
            for r in rows]  # fmt: skip
    reference = _TargetSpaceOnly(drafter)
    if kind == "hybrid":
        reference = HybridDrafter(reference, scored.ngram, min_confidence=0.2)
    slow = [acceptance_tensor(reference, target, r.prompt_ids, r.response_ids, r.logprobs, **args)
            for r in rows]  # fmt: skip
    for a, b in zip(fast, slow, strict=True):
        if temperature == 0:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert any(bool((a > 0).any()) for a in fast)  # not vacuous: some proposals accepted


def test_shared_target_features_run_the_target_once_per_rollout(monkeypatch) -> None:
    """Inside `shared_target_features` two drafters on the same rollouts share one target
    forward per rollout, with the same acceptances as separate forwards; a drafter reading
    other layers gets its own; a byte limit below one entry shares nothing."""
    target = make_random_target("qwen3", seed=3)
    torch.manual_seed(0)
    drafters = [
        BlockDrafter(DrafterConfig.for_target(target, num_layers=1, block_size=4))
        .bind_target(target)
        .eval()
        for _ in range(2)
    ]
    g = torch.Generator().manual_seed(5)
    rows = [
        _rollout(i, [5, 6, 7], torch.randint(3, target.vocab_size, (8,), generator=g).tolist())
        for i in range(3)
    ]
    calls = []
    forward = target.forward
    monkeypatch.setattr(target, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    alone = [score_rollouts(d, target, rows, 0.0, use_cache=False) for d in drafters]
    assert len(calls) == 6
    calls.clear()
    with scoring.shared_target_features():
        shared = [score_rollouts(d, target, rows, 0.0, use_cache=False) for d in drafters]
        assert len(calls) == 3
        target.layer_ids = list(reversed(target.layer_ids))  # other feature layers: recomputed
        score_rollouts(drafters[0], target, rows[:1], 0.0, use_cache=False)
        assert len(calls) == 4
    for a, b in zip(alone, shared, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    calls.clear()
    with scoring.shared_target_features(scoring.FeatureMemo(max_bytes=1)):
        for d in drafters:
            score_rollouts(d, target, rows, 0.0, use_cache=False)
    assert len(calls) == 6
    assert scoring._MEMO is None  # nothing held after the block


def test_a_changed_cache_entry_is_recomputed_never_used(tmp_path, capsys) -> None:
    """One byte changed in a cached acceptance tensor would change the reported MAL: the
    entry's SHA-256 is recorded and checked, and a mismatch is recomputed with a warning."""
    target = make_random_target("qwen3")
    drafter = (
        BlockDrafter(DrafterConfig.for_target(target, num_layers=1, block_size=4))
        .bind_target(target)
        .eval()
    )
    g = torch.Generator().manual_seed(3)
    rollouts = [
        _rollout(i, [5, 6, 7], torch.randint(3, target.vocab_size, (8,), generator=g).tolist())
        for i in range(2)
    ]
    base = score_rollouts(drafter, target, rollouts, 0.0, cache_dir=tmp_path)
    (entry,) = tmp_path.glob("*.safetensors")
    data = bytearray(entry.read_bytes())
    data[-3] ^= 0x40  # a byte of the last tensor's values: still a readable file
    entry.write_bytes(bytes(data))
    capsys.readouterr()
    again = score_rollouts(drafter, target, rollouts, 0.0, cache_dir=tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(base, again, strict=True))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"warning: {entry}") and "recomput" in err[0]
    third = score_rollouts(drafter, target, rollouts, 0.0, cache_dir=tmp_path)  # rewritten
    assert all(torch.equal(a, b) for a, b in zip(base, third, strict=True))
    assert capsys.readouterr().err == ""


def _small_case():
    target = make_random_target("qwen3")
    drafter = (
        BlockDrafter(DrafterConfig.for_target(target, num_layers=1, block_size=4))
        .bind_target(target)
        .eval()
    )
    g = torch.Generator().manual_seed(4)
    rollouts = [
        _rollout(i, [5, 6, 7], torch.randint(3, target.vocab_size, (8,), generator=g).tolist())
        for i in range(2)
    ]
    return drafter, target, rollouts


def test_a_full_disk_keeps_the_scores_and_names_the_cache_file(
    tmp_path, capsys, monkeypatch
) -> None:
    """The cache is optional: scores computed before a failed cache write are returned
    (equal to uncached ones), one warning names the entry, no temp file stays behind."""
    from diskkit import full_disk_for

    drafter, target, rollouts = _small_case()
    want = score_rollouts(drafter, target, rollouts, 0.0, use_cache=False)
    full_disk_for(monkeypatch, ".tmp")
    got = score_rollouts(drafter, target, rollouts, 0.0, cache_dir=tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"warning: {tmp_path}/") and "disk is full" in err[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", ["file", "unreadable"])
def test_an_unusable_cache_directory_is_a_warning_not_a_failure(tmp_path, capsys, kind) -> None:
    import os

    drafter, target, rollouts = _small_case()
    want = score_rollouts(drafter, target, rollouts, 0.0, use_cache=False)
    cache = tmp_path / "cache"
    if kind == "file":
        cache.write_text("not a directory")
    else:
        if os.geteuid() == 0:
            pytest.skip("root reads any directory")
        cache.mkdir(mode=0o000)
    try:
        got = score_rollouts(drafter, target, rollouts, 0.0, cache_dir=cache)
    finally:
        if kind != "file":
            cache.chmod(0o755)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"warning: {cache}" in err
