"""acceptance_and_cost: element-wise brute force, stop tokens, modes, gradients, errors."""

from __future__ import annotations

import pytest
import torch

from blockdraft.objectives.edr import acceptance_and_cost

EOS = (0, 3)


def _case(seed: int, shape=(4, 3), vocab: int = 7):
    gen = torch.Generator().manual_seed(seed)
    draft = torch.randn(*shape, vocab, generator=gen, dtype=torch.float64) * 1.5
    target = torch.randn(*shape, vocab, generator=gen, dtype=torch.float64) * 1.5
    ids = torch.randint(vocab, shape, generator=gen)
    ids[0, 0], ids[1, -1] = EOS[0], EOS[1]
    return draft, target, ids


def _manual(draft, target, ids, temperature, stops):
    """Loop over elements with Python floats: min(1, q/p) and the stop-aware TV cost."""
    q = torch.softmax(draft / temperature, -1).tolist()
    p = torch.softmax(target / temperature, -1).tolist()
    acc = torch.zeros(ids.shape, dtype=torch.float64)
    cost = torch.zeros(ids.shape, dtype=torch.float64)
    for i in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            x = int(ids[i, j])
            pv, qv = p[i][j], q[i][j]
            acc[i, j] = min(1.0, qv[x] / pv[x])
            if x in stops:
                cost[i, j] = 0.0
                continue
            num = sum(max(0.0, pv[v] - qv[v]) for v in range(len(pv)) if v not in stops)
            den = sum(pv[v] for v in range(len(pv)) if v not in stops)
            cost[i, j] = num / den
    return acc, cost


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampling_mode_matches_elementwise_formula(temperature: float) -> None:
    draft, target, ids = _case(1)
    acc, cost = acceptance_and_cost(draft, target, ids, temperature=temperature, stop_token_ids=EOS)
    ref_acc, ref_cost = _manual(draft, target, ids, temperature, set(EOS))
    torch.testing.assert_close(acc, ref_acc, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cost, ref_cost, rtol=1e-12, atol=1e-12)
    # target given as processed probabilities gives the same numbers
    probs = torch.softmax(target / temperature, -1)
    acc2, cost2 = acceptance_and_cost(
        draft, probs, ids, temperature=temperature, target_is_probs=True, stop_token_ids=EOS
    )
    torch.testing.assert_close(acc2, acc)
    torch.testing.assert_close(cost2, cost)
    # realised form
    _, real = acceptance_and_cost(
        draft, target, ids, temperature=temperature, stop_token_ids=EOS, cost_form="realised"
    )
    stop = (ids == EOS[0]) | (ids == EOS[1])
    torch.testing.assert_close(real, torch.where(stop, torch.zeros_like(acc), 1 - acc))


def test_without_stop_tokens_the_cost_is_total_variation() -> None:
    draft, target, ids = _case(2)
    _, cost = acceptance_and_cost(draft, target, ids)
    p, q = torch.softmax(target, -1), torch.softmax(draft, -1)
    torch.testing.assert_close(cost, 0.5 * (p - q).abs().sum(-1))


def test_greedy_modes() -> None:
    draft, _, ids = _case(3)
    ids[2] = draft[2].argmax(-1)  # some proposals match the argmax
    hard, hard_cost = acceptance_and_cost(draft, None, ids, mode="greedy_hard", stop_token_ids=EOS)
    assert torch.equal(hard, (draft.argmax(-1) == ids).double())
    soft, soft_cost = acceptance_and_cost(draft, None, ids, mode="greedy_soft", temperature=0.5)
    torch.testing.assert_close(
        soft, torch.softmax(draft / 0.5, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    )
    torch.testing.assert_close(soft_cost, 1 - soft)
    stop = (ids == EOS[0]) | (ids == EOS[1])
    assert bool((hard_cost[stop] == 0).all()) and torch.equal(hard_cost[~stop], 1 - hard[~stop])


def test_gradients_flow_to_draft_logits() -> None:
    draft, target, ids = _case(4, shape=(2, 2), vocab=5)
    draft = draft.requires_grad_()

    def f(d):
        a, c = acceptance_and_cost(d, target, ids, stop_token_ids=(0,))
        return a.sum() + 2 * c.sum()

    assert torch.autograd.gradcheck(f, (draft,))

    def g(d):
        a, c = acceptance_and_cost(d, None, ids, mode="greedy_soft")
        return a.sum() - c.sum()

    assert torch.autograd.gradcheck(g, (draft,))


def test_low_precision_inputs_are_computed_in_float32() -> None:
    draft, target, ids = _case(5)
    acc, cost = acceptance_and_cost(draft.half(), target.half(), ids)
    assert acc.dtype == torch.float32 and cost.dtype == torch.float32
    ref_acc, _ = acceptance_and_cost(draft.half().double(), target.half().double(), ids)
    torch.testing.assert_close(acc.double(), ref_acc, rtol=1e-5, atol=1e-6)


def test_bad_inputs() -> None:
    draft, target, ids = _case(6)
    with pytest.raises(ValueError, match="ambiguous"):
        acceptance_and_cost(draft, target, ids, mode="greedy")
    with pytest.raises(ValueError, match="target_ids"):
        acceptance_and_cost(draft, target, ids[:, :2])
    with pytest.raises(ValueError, match="target_ids must lie"):
        acceptance_and_cost(draft, target, ids + 100)
    with pytest.raises(ValueError, match="needs the target"):
        acceptance_and_cost(draft, None, ids)
    with pytest.raises(ValueError, match="stop_token_ids"):
        acceptance_and_cost(draft, target, ids, stop_token_ids=[99])
    with pytest.raises(ValueError, match="temperature"):
        acceptance_and_cost(draft, target, ids, temperature=0.0)
