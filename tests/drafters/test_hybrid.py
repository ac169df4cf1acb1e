"""Hybrid drafter (trained drafter + prompt-lookup fallback per slot): offline scoring
equals a brute-force replay of greedy decoding that drafts through the *inference* path
(new_state / extend_context / draft_logits), not the training forward scoring uses."""

from __future__ import annotations

import torch
from test_ngram import naive_propose

from blockdraft.data.rollouts.store import Rollout
from blockdraft.decoding.loop import ar_generate
from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
from blockdraft.drafters.hybrid import HybridDrafter
from blockdraft.evaluation.offline import offline_stats
from blockdraft.evaluation.scoring import score_rollouts
from random_targets import make_random_target


def replay_rounds(
    target, hybrid: HybridDrafter, prompt: list[int], out: list[int], log: list | None = None
) -> int:
    """Rounds of greedy decoding reproducing `out`, each block merged slot by slot
    (`log` collects (confidence, took the looked-up token) of every slot)."""
    d, K = hybrid.drafter, hybrid.num_proposals
    seq = torch.tensor([prompt + out])
    feats = target.forward(seq).features
    P, done, rounds = len(prompt), 1, 0
    while done < len(out):
        a = P + done - 1  # anchor index (x_n with n = done)
        state = d.new_state()
        d.extend_context(state, feats[:, :a], 0)
        logits = d.draft_logits(state, int(seq[0, a]), a)  # [K, V]
        conf = torch.softmax(logits.float(), -1).amax(-1).tolist()
        mine = logits.argmax(-1).tolist()
        looked = naive_propose(prompt + out[:done], K, 3, 1, latest=False)
        take = [h < len(looked) and conf[h] < hybrid.min_confidence for h in range(K)]
        block = [looked[h] if take[h] else mine[h] for h in range(K)]
        if log is not None:
            log.extend(zip(conf, take, strict=True))
        m = 0
        while m < K and done + m < len(out) and block[m] == out[done + m]:
            m += 1
        done, rounds = min(len(out), done + m + 1), rounds + 1
    return rounds


def test_hybrid_offline_rounds_equal_replayed_greedy_decoding() -> None:
    torch.manual_seed(0)
    target = make_random_target("qwen3", seed=2)
    with torch.no_grad():  # a confident, repetitive target: lookup and drafter both score
        target.lm_head.weight.mul_(6.0)
    cfg = DrafterConfig.for_target(target, num_layers=1, block_size=5)
    drafter = BlockDrafter(cfg).bind_target(target).eval()
    with torch.no_grad():
        drafter.fc.weight.mul_(20.0)  # spread the drafter's confidences over (0, 1)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, target.vocab_size, (5,), generator=g).tolist() for _ in range(3)]
    outs = [ar_generate(target, p, max_new_tokens=16) for p in prompts]
    rollouts = [
        Rollout(str(i), torch.tensor(p), torch.tensor(o), torch.zeros(len(o)))
        for i, (p, o) in enumerate(zip(prompts, outs, strict=True))
    ]
    log: list = []
    for p, o in zip(prompts, outs, strict=True):  # the confidences the drafter produces
        replay_rounds(target, HybridDrafter(drafter), p, o, log)
    middle = sorted(c for c, _ in log)[len(log) // 2]
    for conf in (0.0, middle, 1.0):  # always drafter, mixed, lookup wherever it has a token
        hybrid = HybridDrafter(drafter, min_confidence=conf)
        acc = score_rollouts(hybrid, target, rollouts, 0.0, use_cache=False)
        stats = offline_stats(acc)
        log = []
        expected = [
            replay_rounds(target, hybrid, p, o, log) for p, o in zip(prompts, outs, strict=True)
        ]
        assert stats.per_rollout_rounds.tolist() == [float(r) for r in expected]
        if conf == middle:  # both sources really supply slots
            assert 0 < sum(t for _, t in log) < len(log)
