"""Top-p decided on the top-k values equals top-p decided on the whole sorted row.

The reference below is written here, independently: temperature, top-k (ties at the k-th
value kept), then the whole row sorted for top-p. `sampling_logprobs` must agree with it
bit for bit, including the rows where the short path has to hand over (ties at the k-th
value, tied logits straddling the cut, a cumulative mass sitting on top_p).
"""

from __future__ import annotations

import pytest
import torch

from blockdraft.sampling import SamplingSettings, sampling_logprobs, top_p_removed_within_top_k


def whole_row_reference(logits: torch.Tensor, s: SamplingSettings) -> torch.Tensor:
    x = logits.float() / s.temperature
    if 0 < s.top_k < x.shape[-1]:
        kth = torch.sort(x, dim=-1, descending=True).values[..., s.top_k - 1 : s.top_k]
        x = x.masked_fill(x < kth, float("-inf"))
    if s.top_p < 1:
        ordered, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs
        drop = before >= s.top_p
        drop[..., 0] = False
        x = x.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return torch.log_softmax(x, dim=-1)


def awkward_rows(vocab: int, k: int, top_p: float, g: torch.Generator) -> torch.Tensor:
    """Rows built to hit each hand-over case, plus plain random ones."""
    rows = [torch.randn(vocab, generator=g) * scale for scale in (0.5, 2.0, 6.0) for _ in range(8)]
    tie_kth = torch.randn(vocab, generator=g)
    tie_kth[: k + 3] = 5.0 + torch.arange(k + 3, 0, -1).float()  # ranks 0..k+2 distinct
    tie_kth[k - 2 : k + 3] = 1.5 + 5.0  # five logits tie across the k-th place
    rows.append(tie_kth)
    equal = torch.full((vocab,), -30.0)
    equal[:k] = 3.0  # all k equal: masses before are 0, 1/k, 2/k, ... (top_p = 0.5 lands on one)
    rows.append(equal)
    straddle = torch.randn(vocab, generator=g) - 10.0
    straddle[:4] = torch.tensor([2.0, 1.0, 1.0, 1.0])  # equal logits across the cut
    rows.append(straddle)
    few = torch.full((vocab,), float("-inf"))
    few[: k // 2] = torch.randn(k // 2, generator=g)  # fewer finite logits than k
    rows.append(few)
    nan = torch.randn(vocab, generator=g)
    nan[7] = float("nan")  # the whole-row rule decides what a NaN row keeps
    rows.append(nan)
    return torch.stack(rows)


@pytest.mark.parametrize(
    "temperature, top_p, top_k",
    [(0.7, 0.8, 20), (1.0, 0.5, 8), (1.3, 0.95, 40), (0.7, 0.3, 3), (1.0, 0.5, 1)],
)
def test_top_p_on_top_k_values_is_the_whole_row_rule(temperature, top_p, top_k):
    g = torch.Generator().manual_seed(top_k)
    vocab = 700
    logits = awkward_rows(vocab, max(top_k, 4), top_p, g)
    s = SamplingSettings(temperature=temperature, top_p=top_p, top_k=top_k)
    ours, ref = sampling_logprobs(logits, s), whole_row_reference(logits, s)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    same = dict(rtol=0, atol=0, equal_nan=True)  # bit for bit (the NaN row stays NaN)
    torch.testing.assert_close(ours, ref, **same)
    column_major = logits.t().contiguous().t()  # the same values, other strides
    torch.testing.assert_close(sampling_logprobs(column_major, s), ref, **same)
    # batch shape: leading dims flatten and come back
    torch.testing.assert_close(
        sampling_logprobs(logits[:28].view(2, 14, vocab), s), ref[:28].view(2, 14, vocab), **same
    )


def test_hand_over_rows_are_the_awkward_ones(monkeypatch):
    """Plain random rows are decided on the k values; each built case goes to the sort."""
    import blockdraft.sampling as sampling

    seen: list[torch.Tensor] = []
    whole_row = sampling.top_p_removed

    def recording(rows, top_p):
        seen.append(rows.clone())
        return whole_row(rows, top_p)

    monkeypatch.setattr(sampling, "top_p_removed", recording)
    g = torch.Generator().manual_seed(1)
    k, top_p = 8, 0.5
    x = awkward_rows(300, k, top_p, g)
    top = torch.topk(x, k, dim=-1)
    masked = x.masked_fill(x < top.values[..., -1:], float("-inf"))
    fast = top_p_removed_within_top_k(masked, top.values, top.indices, top_p)
    # rows 24..26 are built to be handed over: a tie over the k-th place, all k equal (a
    # mass on top_p and ties across the cut), equal logits across the cut; row 27 has fewer
    # than k finite logits (as a DFlash2 selector's q), decided on the k values
    assert len(seen) == 1 and torch.equal(seen[0][:3], masked[24:27])
    assert seen[0].shape[0] == 4 and seen[0][3].isnan().any()  # row 28, the NaN row
    assert torch.equal(fast[:28], whole_row(masked[:28], top_p))


@pytest.mark.parametrize(
    "temperature, top_p, top_k",
    [(0.7, 0.8, 20), (1.0, 0.5, 8), (1.3, 1.0, 40), (0.7, 0.3, 3), (1.0, 1.0, 0), (0.0, 1.0, 0)],
)
def test_probabilities_on_the_kept_values_are_the_processed_distribution(
    monkeypatch, temperature, top_p, top_k
):
    """`sampling_probs` (softmax over the k kept values, scattered) equals
    `exp(sampling_logprobs)`: the same support and values to rounding, on the awkward rows
    too (which it hands to `sampling_logprobs`); plain random rows stay on the short path."""
    import blockdraft.sampling as sampling

    handed: list[int] = []
    whole = sampling.sampling_logprobs
    monkeypatch.setattr(
        sampling, "sampling_logprobs", lambda x, s: handed.append(x.shape[0]) or whole(x, s)
    )
    g = torch.Generator().manual_seed(3)
    logits = awkward_rows(700, max(top_k, 4), top_p, g)
    s = SamplingSettings(temperature=temperature, top_p=top_p, top_k=top_k)
    got, want = sampling.sampling_probs(logits, s), whole(logits, s).exp()
    column_major = logits.t().contiguous().t()
    torch.testing.assert_close(sampling.sampling_probs(column_major, s), got, equal_nan=True)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9, equal_nan=True)
    if top_k > 0 and temperature > 0:
        assert handed and max(handed) < 24  # the random rows were not handed over
