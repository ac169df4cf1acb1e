"""Sampled E2E/EDR over row chunks of `[N, V]` tensors (objectives/row_chunks.py).

Chunked values and gradients must equal the one-pass formulas (written out below as the
reference: the code before chunking), and autograd must keep no full-vocabulary
intermediate beyond the inputs.
"""

from __future__ import annotations

import pytest
import torch

from blockdraft.data.rollouts.sampler import SamplingSettings, sampling_logprobs
from blockdraft.objectives.cross_entropy import token_logprobs
from blockdraft.objectives.e2e import overlap, overlap_with_logits
from blockdraft.objectives.edr.acceptance import acceptance_and_cost
from blockdraft.training.draft_forward import chunked_token_logprobs
from blockdraft.training.target_distributions import target_probs_for, target_sampling_probs

N, K, V = 5, 3, 11
STOPS = [2, 7]


def _reference(logits, target, ids, *, temperature, target_is_probs, cost_form, greedy_soft=False):
    """acceptance_and_cost's sampling / greedy_soft maths in one pass (pre-chunking code)."""
    logq = torch.log_softmax(logits / temperature, dim=-1)
    logq_x = logq.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    stop = torch.isin(ids, torch.tensor(STOPS))
    if greedy_soft:
        acc = logq_x.exp()
        return acc, torch.where(stop, 0.0, 1 - acc)
    if target_is_probs:
        p = target
        logp_x = p.gather(-1, ids.unsqueeze(-1)).squeeze(-1).log()
    else:
        logp = torch.log_softmax(target / temperature, dim=-1)
        p, logp_x = logp.exp(), logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    acc = torch.exp(torch.clamp(logq_x - logp_x, max=0.0))
    if cost_form == "realised":
        return acc, torch.where(stop, 0.0, 1 - acc)
    keep = torch.ones(V, dtype=torch.bool)
    keep[STOPS] = False
    cost = ((p - logq.exp()).clamp_min(0) * keep).sum(-1) / (p * keep).sum(-1)
    return acc, torch.where(stop, 0.0, cost.clamp(max=1.0))


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, K, V, generator=g, dtype=torch.float64) * 2
    target_logits = torch.randn(N, K, V, generator=g, dtype=torch.float64) * 2
    ids = torch.randint(0, V, (N, K), generator=g)
    ids[0, 0], ids[1, 2] = STOPS[0], STOPS[1]  # stop tokens present
    return logits, target_logits, ids


@pytest.mark.parametrize("chunk_rows", [1, 4, 1000])
@pytest.mark.parametrize(
    ("target_is_probs", "cost_form"), [(True, "tv"), (False, "tv"), (True, "realised")]
)
def test_sampling_acceptance_chunked_equals_one_pass(chunk_rows, target_is_probs, cost_form):
    logits, target_logits, ids = _inputs()
    temperature = 0.7
    target = torch.softmax(target_logits / temperature, -1) if target_is_probs else target_logits
    kw = dict(temperature=temperature, target_is_probs=target_is_probs, cost_form=cost_form)
    results = []
    for fn in ("chunked", "reference"):
        x = logits.clone().requires_grad_(True)
        t = target.clone().requires_grad_(True)  # gradients into the target too
        if fn == "chunked":
            acc, cost = acceptance_and_cost(
                x, t, ids, mode="sampling", stop_token_ids=STOPS, chunk_rows=chunk_rows, **kw
            )
        else:
            acc, cost = _reference(x, t, ids, **kw)
        w = torch.linspace(0.5, 1.5, acc.numel(), dtype=acc.dtype).reshape(acc.shape)
        ((acc * w).sum() + (cost * w.flip(0)).sum()).backward()
        results.append((acc.detach(), cost.detach(), x.grad, t.grad))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("chunk_rows", [2, None])
def test_greedy_soft_chunked_equals_one_pass(chunk_rows):
    logits, _, ids = _inputs(1)
    grads = []
    for chunked in (True, False):
        x = logits.clone().requires_grad_(True)
        if chunked:
            acc, cost = acceptance_and_cost(
                x, None, ids, mode="greedy_soft", stop_token_ids=STOPS, chunk_rows=chunk_rows
            )
        else:
            acc, cost = _reference(x, None, ids, temperature=1.0, target_is_probs=True,
                                   cost_form="realised", greedy_soft=True)  # fmt: skip
        (acc.sum() + 2 * cost.sum()).backward()
        grads.append((acc.detach(), cost.detach(), x.grad))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_overlap_with_logits_temperature_and_chunks():
    logits, target_logits, _ = _inputs(2)
    p = torch.softmax(target_logits, -1)
    outs = []
    for chunk_rows in (1, 3, None):
        x = logits.clone().requires_grad_(True)
        a = overlap_with_logits(p, x, chunk_rows, temperature=0.5)
        (a * torch.arange(a.numel()).reshape(a.shape)).sum().backward()
        outs.append((a.detach(), x.grad))
    x = logits.clone().requires_grad_(True)
    ref = overlap(p, torch.softmax(x / 0.5, -1), chunk_rows=10_000)
    (ref * torch.arange(ref.numel()).reshape(ref.shape)).sum().backward()
    for a, g in outs:
        torch.testing.assert_close(a, ref.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g, x.grad, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="temperature"):
        overlap_with_logits(p, logits, temperature=0.0)


def test_chunked_token_logprobs_equals_fused_cross_entropy():
    logits, _, ids = _inputs(3)
    ids[2, 1] = -1  # no label
    res = []
    for fn in (lambda x: chunked_token_logprobs(x, ids, 2), lambda x: token_logprobs(x, ids)):
        x = logits.clone().requires_grad_(True)
        out = fn(x)
        (out * torch.linspace(1, 2, out.numel()).reshape(out.shape)).sum().backward()
        res.append((out.detach(), x.grad))
    for a, b in zip(*res, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd keeps for backward while `fn` runs."""
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_autograd_keeps_no_full_vocabulary_intermediate():
    """Chunked: only the inputs (logits, target probs) are kept; one pass keeps several
    more `[N, K, V]` float64 tensors (log q, q, p - q, ...)."""
    logits, target_logits, ids = _inputs(4)
    x = logits.clone().requires_grad_(True)
    p = torch.softmax(target_logits, -1)
    full = N * K * V * 8
    kw = dict(temperature=1.0, target_is_probs=True, cost_form="tv")
    chunked = _saved_bytes(
        lambda: acceptance_and_cost(
            x, p, ids, mode="sampling", stop_token_ids=STOPS, chunk_rows=2, **kw
        )  # fmt: skip
    )
    one_pass = _saved_bytes(lambda: _reference(x, p, ids, **kw))
    assert chunked <= 2 * full + 1024, (chunked, full)  # the two inputs + per-row tensors
    assert one_pass >= 3 * full, (chunked, one_pass, full)


@pytest.mark.parametrize(
    "settings",
    [
        SamplingSettings(temperature=0.8, top_k=4, top_p=0.9),
        SamplingSettings(temperature=1.0),
        SamplingSettings(temperature=0.0),
    ],
)
def test_target_probs_built_row_chunk_by_row_chunk(settings, monkeypatch):
    import blockdraft.objectives.cross_entropy as ce

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 9, V, generator=g)
    positions = torch.randint(0, 9, (2, 3, K), generator=g)
    src = (positions - 1).clamp_min(0).reshape(2, -1)
    picked = logits.gather(1, src.unsqueeze(-1).expand(-1, -1, V))
    if settings.greedy:
        ref = torch.nn.functional.one_hot(picked.argmax(-1), V).float()
    else:
        ref = sampling_logprobs(picked, settings).exp()
    ref = ref.reshape(2, 3, K, V)
    monkeypatch.setattr(ce, "DEFAULT_CHUNK_ELEMENTS", 2 * V)  # two rows per chunk
    torch.testing.assert_close(target_probs_for(logits, positions, settings), ref)
    if not settings.greedy:
        torch.testing.assert_close(target_sampling_probs(logits, positions, settings), ref)


def test_fused_chunk_rows_caps_the_default_on_cpu_only():
    """The fused kernels' default chunk on CPU stays near 1 MB of float32 (cache-sized,
    at least 8 rows); an explicit `chunk_rows` and accelerator devices keep theirs."""
    from blockdraft.objectives.cross_entropy import default_chunk_rows
    from blockdraft.objectives.row_chunks import CPU_FUSED_CHUNK_BYTES, fused_chunk_rows

    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert fused_chunk_rows(None, 4096, cpu) == CPU_FUSED_CHUNK_BYTES // (4 * 4096) == 64
    assert fused_chunk_rows(None, 262_144, cpu) == 8
    assert fused_chunk_rows(None, 4096, meta) == default_chunk_rows(4096) > 64
    assert fused_chunk_rows(1000, 4096, cpu) == 1000
    with pytest.raises(ValueError, match="chunk_rows"):
        fused_chunk_rows(0, 4096, cpu)
