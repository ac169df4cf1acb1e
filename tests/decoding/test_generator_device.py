"""Sampling with a generator that lives on another device than the data (issue 17).

The decoders seed CPU generators per prompt; on CUDA, `torch.rand(device="cuda",
generator=cpu_generator)` raises. No GPU here, so the data lives on the `meta` device and
`torch.rand`/`torch.multinomial` are wrapped to raise exactly like CUDA does when asked
to draw on another device than the generator's.
"""

from __future__ import annotations

import pytest
import torch

import blockdraft.drafters.dflash as drafter_mod
import blockdraft.sampling as sampling
from blockdraft.decoding import verify


@pytest.fixture
def strict_generators(monkeypatch):
    real_rand, real_multinomial = torch.rand, torch.multinomial

    def rand(*size, generator=None, device=None, **kw):
        where = torch.device(device or "cpu")
        if generator is not None and where.type != generator.device.type:
            raise RuntimeError(f"Expected a '{where.type}' device type for generator")
        return real_rand(*size, generator=generator, device=device, **kw)

    def multinomial(inp, n, *a, generator=None, **kw):
        if generator is not None and inp.device.type != generator.device.type:
            raise RuntimeError(f"Expected a '{inp.device.type}' device type for generator")
        return real_multinomial(inp, n, *a, generator=generator, **kw)

    monkeypatch.setattr(torch, "rand", rand)
    monkeypatch.setattr(torch, "multinomial", multinomial)


def test_the_check_catches_a_mismatch(strict_generators):
    with pytest.raises(RuntimeError, match="device type for generator"):
        torch.rand(3, generator=torch.Generator(), device="meta")


def test_sample_draws_on_the_generator_device(strict_generators):
    probs = torch.softmax(torch.randn(4, 7), -1)
    out = sampling.sample(probs.to("meta"), torch.Generator().manual_seed(0))
    assert out.device.type == "meta" and out.shape == (4,)
    # on CPU the draws are those of before (one uniform per row, inverse CDF)
    u = torch.rand(4, 1, generator=torch.Generator().manual_seed(3))
    expected = torch.searchsorted(probs.cumsum(-1) / probs.sum(-1, keepdim=True), u, right=True)
    got = sampling.sample(probs, torch.Generator().manual_seed(3))
    assert torch.equal(got, expected.clamp_max(6).squeeze(1))


def test_drafter_sampling_on_another_device(strict_generators):
    logits = torch.randn(5, 11, device="meta")
    tokens, q = drafter_mod.sample_from_logits(logits, 0.8, torch.Generator().manual_seed(1))
    assert tokens.device.type == "meta" and tokens.shape == (5,) and q.shape == (5, 11)


def test_verify_uniforms_follow_the_data(strict_generators):
    u = sampling.uniform((3,), torch.Generator().manual_seed(0), torch.float32, "meta")
    assert u.device.type == "meta"
    # CPU verification still works through the strict wrapper
    p = torch.softmax(torch.randn(3, 5), -1)
    q = torch.softmax(torch.randn(2, 5), -1)
    v = verify.verify_standard(torch.tensor([1, 2]), q, p, torch.Generator().manual_seed(0))
    assert 0 <= v.accepted <= 2
