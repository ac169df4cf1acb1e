"""Semi-AR drafter: sequential sampling uses exactly the teacher-forced distributions."""

from __future__ import annotations

import pytest
import torch

from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
from blockdraft.drafters.semi_ar import SemiARDrafter

BLOCK = 6


@pytest.fixture(scope="module")
def setup(request):
    from random_targets import make_random_target

    target = make_random_target("qwen3")
    cfg = DrafterConfig.for_target(
        target, num_layers=1, block_size=BLOCK, arch="semi_ar", markov_rank=16
    )
    torch.manual_seed(3)
    drafter = SemiARDrafter(cfg).bind_target(target).eval()
    ids = torch.randint(0, target.vocab_size, (1, 10), generator=torch.Generator().manual_seed(2))
    feats = target.forward(ids).features
    state = drafter.new_state()
    drafter.extend_context(state, feats[:, :7], 0)
    return target, drafter, state, int(ids[0, 7])


def _teacher_forced(drafter, state, anchor, tokens):
    prev = torch.cat([torch.tensor([anchor]), tokens[:-1]])
    return drafter.compute_logits(drafter.draft_hidden(state, anchor, 7), prev)


@pytest.mark.parametrize("temperature", [0.6, 1.0])
def test_sampled_q_equals_teacher_forced(setup, temperature):
    _, drafter, state, anchor = setup
    with torch.no_grad():
        torch.nn.init.normal_(drafter.markov_head.w2, std=1.0)
    for seed in range(3):
        tokens, q = drafter.sample_block(
            state, anchor, 7, temperature, torch.Generator().manual_seed(seed)
        )
        ref = torch.softmax(_teacher_forced(drafter, state, anchor, tokens) / temperature, -1)
        torch.testing.assert_close(q, ref, rtol=1e-5, atol=1e-6)
        assert q.shape == (BLOCK - 1, drafter.config.vocab_size)
        assert torch.all(q.gather(1, tokens[:, None]) > 0)
    # the head matters: the parallel part alone gives different distributions
    parallel = torch.softmax(drafter.draft_logits(state, anchor, 7) / temperature, -1)
    assert (parallel - q).abs().max() > 1e-3


def test_greedy_is_sequential_argmax(setup):
    _, drafter, state, anchor = setup
    with torch.no_grad():
        torch.nn.init.normal_(drafter.markov_head.w2, std=1.0)
    tokens, q = drafter.sample_block(state, anchor, 7, 0.0)
    logits = _teacher_forced(drafter, state, anchor, tokens)
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.equal(q, torch.nn.functional.one_hot(tokens, q.shape[-1]).float())


def test_fresh_head_is_zero_and_trainable(setup):
    target, _, state, anchor = setup
    cfg = DrafterConfig.for_target(
        target, num_layers=1, block_size=BLOCK, arch="semi_ar", markov_rank=4
    )
    torch.manual_seed(0)
    semi = SemiARDrafter(cfg).bind_target(target)
    torch.manual_seed(0)
    base = BlockDrafter(
        DrafterConfig.from_dict({**cfg.to_dict(), "arch": "dflash", "markov_rank": 0})
    )
    base.bind_target(target)
    missing = base.load_state_dict(semi.state_dict(), strict=False)
    assert set(missing.unexpected_keys) == {"markov_head.w1", "markov_head.w2"}
    prev = torch.randint(0, target.vocab_size, (BLOCK - 1,))
    hidden = semi.draft_hidden(state, anchor, 7)
    torch.testing.assert_close(semi.compute_logits(hidden, prev), base.compute_logits(hidden))
    hidden = hidden.detach().requires_grad_(False)
    loss = semi.compute_logits(hidden, prev).logsumexp(-1).sum()
    loss.backward()
    assert semi.markov_head.w2.grad.abs().sum() > 0


def test_semi_ar_needs_its_arch(setup):
    target = setup[0]
    with pytest.raises(ValueError, match="arch='semi_ar'"):
        SemiARDrafter(DrafterConfig.for_target(target))
    with pytest.raises(ValueError, match="markov_rank"):
        DrafterConfig.for_target(target, arch="semi_ar", markov_rank=0)
