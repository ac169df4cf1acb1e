"""On-device sampling in rollouts: the same draws on the device as on the CPU, and each
row's tokens a function of its own prompt and id, whatever its batch."""

from __future__ import annotations

import pytest
import torch

from blockdraft.data.rollouts.sampler import (
    SamplingSettings,
    counter_uniform,
    draw_tokens,
    generate_batch,
    row_keys,
    sampling_logprobs,
)
from random_targets import make_random_target


def test_counter_uniforms_and_draws_are_the_cpus(device):
    keys = row_keys(5, [f"p{i}" for i in range(4096)])
    for step in (0, 1, 77, 2**31 + 5):
        on_device = counter_uniform(keys.to(device), step)
        assert on_device.device.type == device.type
        assert torch.equal(on_device.cpu(), counter_uniform(keys, step))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4096, 50, generator=g) * 3
    logp = sampling_logprobs(logits, SamplingSettings(0.8, top_k=20, top_p=0.9))
    u = counter_uniform(keys, 3)
    got = draw_tokens(logp.to(device), u.to(device))
    assert got.device.type == device.type
    assert torch.equal(got.cpu(), draw_tokens(logp, u))


@pytest.fixture(scope="module")
def device_target(device):
    target = make_random_target("qwen3")
    target.model.to(device)
    return target


def test_rows_do_not_depend_on_their_batch_on_device(device_target):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (int(n),), generator=g).tolist() for n in [3, 9, 5, 14, 2, 7]]
    ids = [f"r{i}" for i in range(len(prompts))]
    s = SamplingSettings(temperature=0.9, top_p=0.9, max_new_tokens=16, seed=11)
    together = generate_batch(device_target, prompts, ids, s)
    again = generate_batch(device_target, prompts, ids, s)
    order = [4, 1, 5]
    others = generate_batch(device_target, [prompts[i] for i in order], [ids[i] for i in order], s)
    for i, gen in zip(order, others, strict=True):
        alone = generate_batch(device_target, [prompts[i]], [ids[i]], s)[0]
        for other in (gen, alone):
            assert other.response_ids == together[i].response_ids
            assert torch.allclose(
                torch.tensor(other.logprobs), torch.tensor(together[i].logprobs), atol=1e-4
            )
    for a, b in zip(again, together, strict=True):  # the same batch again: bit-identical
        assert a.response_ids == b.response_ids and a.logprobs == b.logprobs
    renamed = generate_batch(device_target, prompts[:3], ["x0", "x1", "x2"], s)
    assert [r.response_ids for r in renamed] != [r.response_ids for r in together[:3]]
