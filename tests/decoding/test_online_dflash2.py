"""DFlash2 online: lossless, and the exact offline evaluator predicts it.

- T = 0: output equals autoregressive greedy decoding, and when the rollouts are those
  greedy outputs the offline expected rounds of every rollout equal the online rounds of
  its prompt exactly (acceptance is 0/1 there, from teacher-forced predecessors).
- T > 0: the proposals of a round are drawn from the q the loop hands the verifier (the
  selector's distribution over the top-k candidates, predecessor = the token drawn
  before): chi-square on the joint law of the first two proposals; then online tau and
  offline MAL on sampled rollouts of the same prompts agree within their CI.

The drafter is trained for a few dozen steps on the random target's greedy text from the
prompts the tests decode (its own teacher-forced unary + selector cross-entropy, written
out in tests/dflash2_fit.py), so acceptance is far from 0 and the comparisons have power.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from blockdraft.data.rollouts.sampler import SamplingSettings, generate_batch
from blockdraft.data.rollouts.store import Rollout
from blockdraft.decoding.cpu.lean_drafter import LeanDrafter
from blockdraft.decoding.loop import ar_generate, decode
from blockdraft.decoding.proposers import draft_block
from blockdraft.drafters.dflash import DrafterConfig
from blockdraft.drafters.dflash2 import DFlash2Drafter
from blockdraft.drafters.draft_vocab import most_frequent_tokens, target_to_draft
from blockdraft.evaluation.offline import mal_ci, offline_stats
from blockdraft.evaluation.scoring import score_rollouts
from dflash2_fit import fit_dflash2
from fake_drafter import chi2_pvalue
from random_targets import make_random_target

BLOCK, TOP_K = 5, 6


def _prompts(target, n, seed, length=6):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, target.vocab_size, (length,), generator=g).tolist() for _ in range(n)]


@pytest.fixture(scope="module", params=[None, 0.5], ids=["full-vocab", "draft-vocab"])
def setup(request):
    """The drafter on the full vocabulary, and on a reduced one (the most frequent half of
    the ids in the training text: prompt tokens and predecessors fall outside it)."""
    target = make_random_target("qwen3", seed=1)
    with torch.no_grad():  # a confident target (tied head: the embedding scales too), so
        target.lm_head.weight.mul_(6.0)  # its sampled text is close to its greedy text
    prompts = _prompts(target, 16, seed=1, length=5)
    seqs = [torch.tensor(p + ar_generate(target, p, max_new_tokens=24)) for p in prompts]
    draft = None if request.param is None else int(request.param * target.vocab_size)
    cfg = DrafterConfig.for_target(target, num_layers=1, block_size=BLOCK, arch="dflash2",
                                   selector_rank=8, selector_top_k=TOP_K,
                                   draft_vocab_size=draft)  # fmt: skip
    torch.manual_seed(0)
    drafter = DFlash2Drafter(cfg).bind_target(target)
    column = torch.arange(target.vocab_size)  # target id -> drafter column (-1: none)
    if draft is not None:
        drafter.set_draft_vocab(most_frequent_tokens(seqs, draft, target.vocab_size))
        column = target_to_draft(drafter.draft_ids, target.vocab_size)
    return target, fit_dflash2(drafter, target, seqs, column), prompts


def test_greedy_is_autoregressive_and_offline_rounds_equal_online(setup, tmp_path):
    target, drafter, prompts = setup
    prompts = prompts[:5]
    online = decode(target, drafter, prompts, temperature=0.0, max_new_tokens=30)
    assert online.outputs == online.ar_outputs
    rollouts = [
        Rollout(str(i), torch.tensor(p), torch.tensor(o), torch.zeros(len(o)))
        for i, (p, o) in enumerate(zip(prompts, online.outputs, strict=True))
    ]
    acc = score_rollouts(drafter, target, rollouts, 0.0, cache_dir=tmp_path)
    stats = offline_stats(acc)
    assert stats.per_rollout_rounds.tolist() == [float(n) for n in online.per_prompt_rounds()]
    assert stats.mal == pytest.approx(online.tau, abs=1e-12)
    assert stats.mal > 1.5  # non-trivial: accepted runs and rejections


def test_bf16_drafter_offline_rounds_equal_online(setup, tmp_path):
    """The drafter cast to bf16 beside the fp32 target (`--drafter-dtype bfloat16`): the
    loop's lean bf16 round and the evaluator's batched bf16 forward round alike, so the
    offline rounds still equal the online ones."""
    target, drafter, prompts = setup
    low = copy.deepcopy(drafter).to(torch.bfloat16)
    assert LeanDrafter.of(low) is not None  # the loop drafts through the lean round
    prompts = prompts[5:10]
    online = decode(target, low, prompts, temperature=0.0, max_new_tokens=30)
    assert online.outputs == online.ar_outputs
    rollouts = [
        Rollout(str(i), torch.tensor(p), torch.tensor(o), torch.zeros(len(o)))
        for i, (p, o) in enumerate(zip(prompts, online.outputs, strict=True))
    ]
    stats = offline_stats(score_rollouts(low, target, rollouts, 0.0, cache_dir=tmp_path))
    assert stats.per_rollout_rounds.tolist() == [float(n) for n in online.per_prompt_rounds()]
    assert stats.mal > 1.5


def test_proposals_are_drawn_from_the_q_given_to_the_verifier(setup):
    target, drafter, prompts = setup
    drafter = copy.deepcopy(drafter)  # a strong predecessor effect, so the law is sharp
    with torch.no_grad():
        drafter.candidate_selector.hidden_projection.weight.normal_(std=0.5)
    temperature = 1.0
    ids = torch.tensor([prompts[0] + ar_generate(target, prompts[0], max_new_tokens=5)])
    feats = target.forward(ids).features
    state = drafter.new_state()
    drafter.extend_context(state, feats[:, :9], 0)
    anchor = int(ids[0, 9])
    g = torch.Generator().manual_seed(0)
    counts: dict[tuple[int, int], int] = {}
    n = 2000
    for _ in range(n):
        tokens, q = draft_block(drafter, state, anchor, 9, temperature, 1.0, 0, g)
        key = (int(tokens[0]), int(tokens[1]))
        counts[key] = counts.get(key, 0) + 1
    with torch.no_grad():
        hidden = drafter.draft_hidden(state, anchor, 9)

        def q(row, prev):
            logits = drafter.compute_logits(hidden[row : row + 1], torch.tensor([prev]))[0]
            return torch.softmax(logits / temperature, -1)

        q1 = q(0, anchor)
        cells, probs = [], []
        for y1 in q1.nonzero().flatten().tolist():
            q2 = q(1, y1)
            for y2 in q2.nonzero().flatten().tolist():
                cells.append((y1, y2))
                probs.append(float(q1[y1] * q2[y2]))
    assert len(cells) <= TOP_K * TOP_K and set(counts) <= set(cells)
    observed = torch.tensor([counts.get(c, 0) for c in cells], dtype=torch.float64)
    pval, stat, df = chi2_pvalue(observed, torch.tensor(probs, dtype=torch.float64))
    assert df >= 4 and pval > 1e-4, (stat, df)
    # and the harness has power: slot 2 with the anchor as predecessor is another law
    with torch.no_grad():
        q2_anchor = torch.softmax(
            drafter.compute_logits(hidden[1:2], torch.tensor([anchor]))[0] / temperature, -1
        )
    wrong = torch.tensor([float(q1[a] * q2_anchor[b]) for a, b in cells], dtype=torch.float64)
    assert chi2_pvalue(observed, wrong / wrong.sum().clamp_min(1e-30))[0] < 1e-4


def test_sampling_online_tau_agrees_with_offline_mal(setup):
    target, drafter, prompts = setup
    settings = SamplingSettings(temperature=1.0, top_p=0.95, top_k=0, max_new_tokens=20, seed=3)
    gen = generate_batch(target, prompts, [str(i) for i in range(16)], settings)
    rollouts = [
        Rollout(
            str(i),
            torch.tensor(p),
            torch.as_tensor(r.response_ids),
            torch.as_tensor(r.logprobs, dtype=torch.float32),
        )
        for i, (p, r) in enumerate(zip(prompts, gen, strict=True))
    ]
    acc = score_rollouts(drafter, target, rollouts, 1.0, 0.95, 0, use_cache=False)
    mal, (lo, hi) = mal_ci(acc, n_boot=1000)
    online = decode(target, drafter, prompts, temperature=1.0, top_p=0.95, max_new_tokens=20,
                    seed=5, measure_ar=False)  # fmt: skip
    se_off = (hi - lo) / (2 * 1.96)
    se_on = (online.tau_ci95[1] - online.tau_ci95[0]) / (2 * 1.96)
    assert mal > 1.15 and online.tau > 1.15  # accepted proposals, not only bonus tokens
    assert abs(online.tau - mal) < 3.29 * math.hypot(se_off, se_on), (online.tau, mal)
