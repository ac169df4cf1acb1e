"""`drafter.lookup_inputs`: the block's proposal slots read prompt lookup's tokens.

Checked against independent computations: the batched lookup equals `NgramDrafter.propose`
on every prefix (brute force); the inference path (`draft_hidden` with the loop's
incremental lookup) equals the training/scoring path (`forward_blocks`) block by block;
greedy decoding's rounds equal the offline expected rounds per prompt; and the inputs are
live (switching the flag off changes the drafter's output where lookup has a proposal)."""

from __future__ import annotations

import pytest
import torch

from blockdraft.data.rollouts.store import Rollout
from blockdraft.decoding.loop import ar_generate, decode
from blockdraft.decoding.proposers import NgramIndex
from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
from blockdraft.drafters.lookup_inputs import lookup_block_inputs, lookup_rule
from blockdraft.evaluation.offline import offline_stats
from blockdraft.evaluation.scoring import score_rollouts
from blockdraft.serialization.checkpoint import load_drafter, read_config, save_drafter
from blockdraft.serialization.export import export_drafter
from blockdraft.serialization.serving_rules import LOOKUP_ARCHITECTURE
from random_targets import make_random_target

K = 4


def _looping_sequences(n: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    """Token rows that repeat short random motifs (so lookup finds matches) with noise."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        motif = torch.randint(3, vocab, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g)
        row = motif.repeat(length // len(motif) + 1)[:length].clone()
        flips = torch.rand(length, generator=g) < 0.15
        row[flips] = torch.randint(3, vocab, (int(flips.sum()),), generator=g)
        rows.append(row)
    return torch.stack(rows)


def test_batched_lookup_equals_propose_on_every_prefix() -> None:
    ids = _looping_sequences(3, 40, 12, seed=0)
    anchors = torch.tensor([[5, 39, 0, -1, 17, 3], [1, 2, 30, 31, 8, 20], [-1, -1, 12, 38, 6, 7]])
    got = lookup_block_inputs(ids, anchors, K)
    rule = lookup_rule(K)
    hits = 0
    for b in range(3):
        for j, a in enumerate(anchors[b].tolist()):
            want = [] if a < 0 else rule.propose(ids[b, : a + 1].tolist())
            row = got[b, j]
            assert row[: len(want)].tolist() == want
            assert (row[len(want) :] == -1).all()
            hits += bool(want)
    assert hits >= 8, "the check needs anchors where lookup proposes something"


def _drafter(lookup_inputs: bool, target=None):
    target = target or make_random_target("qwen3", seed=3)
    torch.manual_seed(0)
    cfg = DrafterConfig.for_target(
        target, num_layers=1, block_size=K + 1, lookup_inputs=lookup_inputs
    )
    return target, BlockDrafter(cfg).bind_target(target).eval()


def test_inference_blocks_equal_training_blocks() -> None:
    target, drafter = _drafter(True)
    ids = _looping_sequences(1, 36, target.vocab_size, seed=1)
    with torch.no_grad():
        feats = target.forward(ids, with_logits=False).features
        anchors = torch.arange(1, 35)[None]
        offline = drafter.forward_blocks(feats, ids, anchors)[0]  # [A, K, H]
        state = drafter.new_state()
        drafter.extend_context(state, feats[:, :1], 0)
        index = NgramIndex(lookup_rule(K))
        lookups = 0
        for j, a in enumerate(anchors[0].tolist()):
            # the loop's view when the round anchored at index a starts: positions < a verified
            if state.length < a:
                drafter.extend_context(state, feats[:, state.length : a], state.length)
            state.lookup = index.propose(ids[0, : a + 1].tolist())
            lookups += bool(state.lookup)
            online = drafter.draft_hidden(state, int(ids[0, a]), a)
            torch.testing.assert_close(online, offline[j], rtol=1e-5, atol=1e-5)
    assert lookups >= 10


def test_lookup_inputs_are_live_and_required() -> None:
    target, on = _drafter(True)
    _, off = _drafter(False, target)
    off.load_state_dict(on.state_dict())
    ids = _looping_sequences(1, 30, target.vocab_size, seed=2)
    with torch.no_grad():
        feats = target.forward(ids, with_logits=False).features
        anchors = torch.arange(2, 29)[None]
        has = lookup_block_inputs(ids, anchors, K)[0, :, 0] >= 0
        diff = on.forward_blocks(feats, ids, anchors) - off.forward_blocks(feats, ids, anchors)
        moved = diff[0].abs().amax(dim=(-1, -2)) > 1e-4
    assert has.any() and (~has).any()
    assert moved[has].all()
    state = on.new_state()
    on.extend_context(state, feats[:, :3], 0)
    with pytest.raises(ValueError, match="lookup_inputs"):
        on.draft_hidden(state, int(ids[0, 3]), 3)


def test_greedy_online_rounds_equal_offline_per_prompt() -> None:
    target, drafter = _drafter(True)
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)
        drafter.fc.weight.mul_(20.0)
    prompts = _looping_sequences(4, 12, target.vocab_size, seed=4).tolist()
    outs = [ar_generate(target, p, max_new_tokens=24) for p in prompts]
    online = decode(target, drafter, prompts, temperature=0.0, max_new_tokens=24, measure_ar=False)
    assert online.outputs == outs
    rollouts = [
        Rollout(str(i), torch.tensor(p), torch.tensor(o), torch.zeros(len(o)))
        for i, (p, o) in enumerate(zip(prompts, outs, strict=True))
    ]
    stats = offline_stats(score_rollouts(drafter, target, rollouts, 0.0, use_cache=False))
    assert stats.per_rollout_rounds.tolist() == [float(n) for n in online.per_prompt_rounds()]


def test_config_rejects_semi_ar_and_export_is_lookup_aware(tmp_path) -> None:
    target, drafter = _drafter(True)
    with pytest.raises(ValueError, match="lookup_inputs"):
        DrafterConfig.for_target(target, arch="semi_ar", lookup_inputs=True)
    ckpt = save_drafter(drafter, tmp_path / "ckpt")
    assert load_drafter(ckpt, target).config.lookup_inputs  # round-trips
    # only blockdraft's plugin serves it (tests/serialization/test_lookup_export.py)
    out = export_drafter(ckpt, tmp_path / "out")
    assert read_config(out)["architectures"] == [LOOKUP_ARCHITECTURE]
    assert load_drafter(out, target).config.lookup_inputs
