"""On-device sampling: counter-based per-row randomness, inverse-CDF draws, batch independence."""

from __future__ import annotations

import torch

from blockdraft.data.rollouts.sampler import (
    SamplingSettings,
    counter_uniform,
    draw_tokens,
    generate_batch,
    row_keys,
    sampling_logprobs,
)


def test_counter_uniform_is_uniform_and_a_pure_function_of_key_and_step():
    keys = row_keys(7, [f"p{i}" for i in range(2000)])
    u = torch.stack([counter_uniform(keys, t) for t in range(100)])  # [100, 2000]
    assert u.dtype == torch.float64 and ((u >= 0) & (u < 1)).all()
    flat, _ = u.flatten().sort()
    n = flat.numel()
    ks = (flat - torch.arange(1, n + 1, dtype=torch.float64) / n).abs().max()
    assert ks < 1.63 / n**0.5  # Kolmogorov-Smirnov at the 1% level
    # no correlation between consecutive steps of a row or neighbouring rows
    assert abs(torch.corrcoef(torch.stack([u[:-1].flatten(), u[1:].flatten()]))[0, 1]) < 0.01
    assert abs(torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1]) < 0.01
    # a row's numbers depend on its key and the step only: any subset, any order, any seed
    perm = torch.randperm(2000)[:37]
    assert torch.equal(counter_uniform(keys[perm], 5), u[5, perm])
    assert torch.equal(row_keys(7, ["p3"])[0], keys[3])
    assert not torch.equal(row_keys(8, ["p3"]), row_keys(7, ["p3"]))
    assert len(set(u[:, 0].tolist())) == 100


def test_draw_tokens_follows_the_distribution_and_never_draws_filtered_tokens():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 12, generator=g) * 2
    logp = sampling_logprobs(logits, SamplingSettings(1.0, top_k=6))
    n = 40_000
    keys = row_keys(0, [str(i) for i in range(n)])
    tokens = draw_tokens(logp.expand(n, -1), counter_uniform(keys, 0))
    counts = torch.bincount(tokens, minlength=12).double()
    probs = logp.exp()[0].double()
    assert (counts[probs == 0] == 0).all()
    kept = probs > 0
    chi2 = ((counts[kept] - n * probs[kept]) ** 2 / (n * probs[kept])).sum()
    assert chi2 < 20.1  # chi-square, 5 degrees of freedom, 0.1% level
    # a point mass is always drawn, whatever the uniform
    one = torch.full((3, 5), float("-inf"))
    one[:, 2] = 0.0
    assert draw_tokens(one, torch.tensor([0.0, 0.5, 1 - 2**-53], dtype=torch.float64)).tolist() == [
        2,
        2,
        2,
    ]


def test_rows_do_not_depend_on_their_batch(random_target):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (int(n),), generator=g).tolist() for n in [3, 9, 5, 14, 2, 7]]
    ids = [f"r{i}" for i in range(len(prompts))]
    s = SamplingSettings(temperature=0.9, top_p=0.9, max_new_tokens=10, seed=11)
    together = generate_batch(random_target, prompts, ids, s)
    again = generate_batch(random_target, prompts, ids, s)
    order = [4, 1, 5]
    others = generate_batch(random_target, [prompts[i] for i in order], [ids[i] for i in order], s)
    for i, gen in zip(order, others, strict=True):
        alone = generate_batch(random_target, [prompts[i]], [ids[i]], s)[0]
        for other in (gen, alone, again[i]):
            assert other.response_ids == together[i].response_ids
            assert torch.allclose(
                torch.tensor(other.logprobs), torch.tensor(together[i].logprobs), atol=1e-5
            )
    # the stream belongs to the prompt id: another id, other tokens
    renamed = generate_batch(random_target, prompts[:3], ["x0", "x1", "x2"], s)
    assert [r.response_ids for r in renamed] != [r.response_ids for r in together[:3]]
