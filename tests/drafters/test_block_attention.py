"""Block attention without the dense mask: `tiled` and `flex` against the dense reference
and against an independent per-block softmax, outputs and gradients, all drafter kinds."""

from __future__ import annotations

import pytest
import torch

from blockdraft.drafters import block_attention
from blockdraft.drafters.block_attention import BlockAttention, block_attention_mask
from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
from blockdraft.drafters.semi_ar import SemiARDrafter
from random_targets import make_random_target

BLOCK = 4
# Unsorted anchors, a repeat, anchor 0 (no context), padding, and a padding-only tile.
ANCHORS = torch.tensor([[1, 5, 9, 2, 13, 0, 7, -1, -1, -1], [13, 1, 7, 7, 4, 10, 3, 11, -1, -1]])


def _per_block_reference(q, block_k, block_v, ctx_k, ctx_v, anchors, Kb):
    """Each block alone: softmax over [context < anchor; own slots], float64 loops."""
    B, heads, L, d = q.shape
    group = heads // ctx_k.shape[1]
    out = torch.zeros_like(q)
    for b in range(B):
        for j in range(anchors.shape[1]):
            a = max(int(anchors[b, j]), 0)
            rows = slice(j * Kb, (j + 1) * Kb)
            for h in range(heads):
                kv = h // group
                k = torch.cat([ctx_k[b, kv, :a], block_k[b, kv, rows]])
                v = torch.cat([ctx_v[b, kv, :a], block_v[b, kv, rows]])
                p = torch.softmax(q[b, h, rows] @ k.T / d**0.5, dim=-1)
                out[b, h, rows] = p @ v
    return out


@pytest.mark.parametrize("impl", ["dense", "tiled"])
@pytest.mark.parametrize("tile_queries", [BLOCK, 3 * BLOCK, 1000])
def test_layout_equals_independent_per_block_softmax(impl, tile_queries):
    g = torch.Generator().manual_seed(0)
    B, heads, kv_heads, d, T, Kb = 2, 4, 2, 8, 15, BLOCK  # GQA: 2 query heads per kv head
    L = ANCHORS.shape[1] * Kb

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)

    q, bk, bv = rand(B, heads, L, d), rand(B, kv_heads, L, d), rand(B, kv_heads, L, d)
    ck, cv = rand(B, kv_heads, T, d), rand(B, kv_heads, T, d)
    layout = BlockAttention(ANCHORS, T, Kb, impl, dtype=torch.float64, tile_queries=tile_queries)
    got = layout.attend(q, bk, bv, ck, cv)
    ref = _per_block_reference(q, bk, bv, ck, cv, ANCHORS, Kb)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    upstream = torch.randn(got.shape, generator=g, dtype=torch.float64)
    inputs = (q, bk, bv, ck, cv)
    grads = torch.autograd.grad((got * upstream).sum(), inputs)
    grads_ref = torch.autograd.grad((ref * upstream).sum(), inputs)
    for a, b in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_flex_forward_on_cpu_equals_dense_and_refuses_to_train():
    g = torch.Generator().manual_seed(1)
    B, heads, kv_heads, d, T, Kb = 2, 4, 2, 16, 15, BLOCK
    L = ANCHORS.shape[1] * Kb
    q = torch.randn(B, heads, L, d, generator=g)
    bk, bv = torch.randn(2, B, kv_heads, L, d, generator=g)
    ck, cv = torch.randn(2, B, kv_heads, T, d, generator=g)
    dense = BlockAttention(ANCHORS, T, Kb, "dense").attend(q, bk, bv, ck, cv)
    flex = BlockAttention(ANCHORS, T, Kb, "flex").attend(q, bk, bv, ck, cv)
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="no backward on CPU"):
        BlockAttention(ANCHORS, T, Kb, "flex").attend(q.requires_grad_(True), bk, bv, ck, cv)


@pytest.fixture(scope="module", params=["qwen3", "llama", "gemma3"])
def target(request):
    return make_random_target(request.param, num_layers=6)


def _drafter(target, kind):
    cfg = DrafterConfig.for_target(target, num_layers=2, block_size=BLOCK, arch=kind, markov_rank=8)
    model = (SemiARDrafter if kind == "semi_ar" else BlockDrafter)(cfg).bind_target(target)
    if kind == "semi_ar":
        torch.nn.init.normal_(model.markov_head.w2, std=0.5)
    return model.double()


@pytest.mark.parametrize("kind", ["dflash", "semi_ar"])
def test_forward_blocks_paths_agree_with_gradients(target, kind, monkeypatch):
    """Tiled (several tiles) and dense give the same logits and parameter gradients."""
    monkeypatch.setattr(block_attention, "TILE_QUERIES", 2 * BLOCK)
    drafter = _drafter(target, kind)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, target.vocab_size, (2, 16), generator=g)
    feats = target.forward(ids).features.double().requires_grad_(True)
    prev = ids.gather(1, ANCHORS.clamp(min=0)).unsqueeze(-1).expand(-1, -1, BLOCK - 1)
    upstream = None
    results = {}
    for impl in ("dense", "tiled"):
        drafter.zero_grad(set_to_none=True)
        feats.grad = None
        logits = drafter.compute_logits(drafter.forward_blocks(feats, ids, ANCHORS, impl), prev)
        if upstream is None:
            upstream = torch.randn(logits.shape, generator=g, dtype=logits.dtype)
        (logits * upstream).sum().backward()
        grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
        results[impl] = (logits.detach(), feats.grad.clone(), grads)
    dense, tiled = results["dense"], results["tiled"]
    torch.testing.assert_close(tiled[0], dense[0], rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(tiled[1], dense[1], rtol=1e-9, atol=1e-10)
    assert tiled[2].keys() == dense[2].keys() and len(dense[2]) > 5
    for name in dense[2]:
        torch.testing.assert_close(tiled[2][name], dense[2][name], rtol=1e-9, atol=1e-10)
    assert torch.isfinite(tiled[0][0, -1]).all()  # a padding block stays finite


def test_flex_forward_blocks_on_cpu_without_grad(target):
    drafter = _drafter(target, "dflash").float()
    ids = torch.randint(0, target.vocab_size, (2, 16))
    feats = target.forward(ids).features
    with torch.no_grad():
        dense = drafter.forward_blocks(feats, ids, ANCHORS, "dense")
        flex = drafter.forward_blocks(feats, ids, ANCHORS, "flex")
    torch.testing.assert_close(flex, dense, rtol=1e-4, atol=1e-5)


def test_default_path_per_device_and_unknown_name(random_target):
    assert block_attention.default_attention_impl("cpu") == "tiled"
    assert block_attention.default_attention_impl("cuda:0") == "flex"
    drafter = _drafter(random_target, "dflash")
    assert drafter.attention == "auto"
    ids = torch.randint(0, random_target.vocab_size, (1, 8))
    feats = torch.zeros(1, 8, random_target.feature_size)
    with pytest.raises(ValueError, match="attention must be one of"):
        drafter.forward_blocks(feats, ids, torch.tensor([[2]]), "sparse")


def test_tiled_memory_is_linear_in_blocks_dense_is_quadratic(random_target):
    """Nothing the size of the dense mask is saved for backward on the tiled path."""
    drafter = _drafter(random_target, "dflash").float()
    B, T, A = 1, 64, 128  # many blocks: the dense mask's A*Kb x A*Kb part dominates
    ids = torch.randint(0, random_target.vocab_size, (B, T))
    feats = torch.randn(B, T, random_target.feature_size)
    anchors = (torch.arange(A)[None] * (T - 8)) // A + 4  # sorted, as sampled
    L = A * BLOCK
    dense_entries = B * L * (T + L)
    tiled_bound = B * L * (T + block_attention.TILE_QUERIES)

    def biggest_saved(impl: str) -> int:
        sizes: list[int] = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: sizes.append(t.numel()) or t, lambda t: t
        ):
            drafter.forward_blocks(feats, ids, anchors, impl)
        return max(sizes)

    assert biggest_saved("dense") >= dense_entries  # the check can fail
    assert biggest_saved("tiled") < dense_entries / 4
    layout = BlockAttention(anchors, T, BLOCK, "tiled")
    assert sum(mask.numel() for *_, mask in layout.tiles) <= tiled_bound
    assert block_attention_mask(anchors, T, BLOCK).numel() == dense_entries


def test_paths_run_under_bf16_autocast(random_target):
    """Training runs under autocast on GPUs: every path accepts the mixed q/k/v dtypes it
    produces (fp32 RMSNorm weights, bf16 projections) and stays at bf16 rounding of fp32."""
    drafter = _drafter(random_target, "dflash").float()
    ids = torch.randint(0, random_target.vocab_size, (2, 16))
    feats = random_target.forward(ids).features
    with torch.no_grad():
        ref = drafter.forward_blocks(feats, ids, ANCHORS, "dense")
        for impl in ("dense", "tiled", "flex"):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                got = drafter.forward_blocks(feats, ids, ANCHORS, impl)
            torch.testing.assert_close(got.float(), ref, rtol=0.05, atol=0.05)
    # the backward under autocast: each parameter's gradient within bf16 rounding of fp32's
    grads = {}
    for autocast in (False, True):
        drafter.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            hidden = drafter.forward_blocks(feats, ids, ANCHORS, "tiled")
        hidden.float().square().sum().backward()
        grads[autocast] = {
            n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None
        }
    assert grads[True].keys() == grads[False].keys() and len(grads[False]) > 5
    for name, ref_grad in grads[False].items():
        err = (grads[True][name] - ref_grad).norm() / ref_grad.norm().clamp_min(1e-12)
        assert err < 0.05, (name, float(err))
