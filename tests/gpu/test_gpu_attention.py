"""The device's block attention (`flex` on CUDA) equals the dense reference: values and
gradients, fp32 and bf16, padding anchors, GQA, and whole drafters (DFlash and semi-AR).

Tolerances are relative norms against the dense reference computed in float64 on the
CPU (`||got - ref|| / ||ref||`): fp32 within 1e-4 (fp32 arithmetic lands near 1e-6; a
kernel silently using TF32 lands near 1e-3 and fails), bf16 within 3e-2 (bf16 operands
land between 1e-3 and 1e-2).
"""

from __future__ import annotations

import pytest
import torch

from blockdraft.drafters.block_attention import BlockAttention, default_attention_impl
from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
from blockdraft.drafters.semi_ar import SemiARDrafter
from random_targets import make_random_target

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
BLOCK = 16
# Sorted anchors (as training samples them), anchor 0 (no context), a repeat, and
# padding anchors (-1) at the end of the shorter row; lengths off the 128-tile grid.
ANCHORS = [[0, 3, 40, 41, 97, 150, 150, 201, 250, 280], [5, 77, 130, 199, 260, -1, -1, -1, -1, -1]]
SEQ = 300


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    assert torch.isfinite(got).all(), "non-finite values"
    return float((got - ref).norm() / ref.norm())


def test_cuda_default_is_flex(device):
    assert default_attention_impl(device) == ("flex" if device.type == "cuda" else "tiled")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_device_attention_equals_dense_reference(device, dtype):
    g = torch.Generator().manual_seed(0)
    B, heads, kv_heads, d = 2, 8, 2, 64  # GQA: 4 query heads per kv head
    anchors = torch.tensor(ANCHORS)
    L = anchors.shape[1] * BLOCK
    shapes = [(B, heads, L, d), (B, kv_heads, L, d), (B, kv_heads, L, d)]
    shapes += [(B, kv_heads, SEQ, d)] * 2
    ref_inputs = [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]
    upstream = torch.randn(B, heads, L, d, generator=g, dtype=torch.float64)

    ref_leaves = [x.clone().requires_grad_(True) for x in ref_inputs]
    dense = BlockAttention(anchors, SEQ, BLOCK, "dense", dtype=torch.float64)
    ref = dense.attend(*ref_leaves)
    ref_grads = torch.autograd.grad((ref * upstream).sum(), ref_leaves)

    impl = default_attention_impl(device)
    leaves = [x.to(device, dtype).requires_grad_(True) for x in ref_inputs]
    layout = BlockAttention(anchors.to(device), SEQ, BLOCK, impl, dtype=dtype)
    got = layout.attend(*leaves)
    assert got.device.type == device.type and got.dtype == dtype
    grads = torch.autograd.grad((got * upstream.to(device, dtype)).sum(), leaves)
    tol = TOLERANCE[dtype]
    assert relative_error(got, ref) < tol, (impl, relative_error(got, ref))
    names = ("q", "block_k", "block_v", "ctx_k", "ctx_v")
    for name, a, b in zip(names, grads, ref_grads, strict=True):
        assert relative_error(a, b) < tol, (impl, name, relative_error(a, b))
    pad_rows = got[1, :, 5 * BLOCK :]  # padding anchors: only their own block, finite
    assert torch.isfinite(pad_rows).all()


@pytest.mark.parametrize(
    "kind,kv_heads", [("dflash", 2), ("semi_ar", 4)], ids=["dflash-gqa", "semi_ar-mha"]
)
def test_drafter_forward_blocks_on_device_equals_dense(device, kind, kv_heads):
    """The whole drafter (fp32): the device's attention path vs `dense`, logits and every
    parameter's gradient, on the device."""
    target = make_random_target("qwen3", num_layers=6, num_heads=4, num_kv_heads=kv_heads)
    target.model.to(device)
    cfg = DrafterConfig.for_target(target, num_layers=2, block_size=BLOCK, arch=kind, markov_rank=8)
    torch.manual_seed(0)
    drafter = (SemiARDrafter if kind == "semi_ar" else BlockDrafter)(cfg).bind_target(target)
    if kind == "semi_ar":  # its Markov head starts at zero: give it a gradient to compare
        torch.nn.init.normal_(drafter.markov_head.w2, std=0.5)
    drafter.to(device)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, target.vocab_size, (2, SEQ), generator=g).to(device)
    anchors = torch.tensor(ANCHORS, device=device)
    feats = target.forward(ids).features.detach()
    prev = ids.gather(1, anchors.clamp(min=0)).unsqueeze(-1).expand(-1, -1, BLOCK - 1)
    upstream = None
    results = {}
    for impl in (default_attention_impl(device), "dense"):
        drafter.zero_grad(set_to_none=True)
        logits = drafter.compute_logits(drafter.forward_blocks(feats, ids, anchors, impl), prev)
        if upstream is None:
            upstream = torch.randn(logits.shape, generator=g).to(device)
        (logits * upstream).sum().backward()
        grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
        results[impl] = (logits.detach(), grads)
    (got, got_grads), (ref, ref_grads) = results.values()
    assert relative_error(got, ref) < 1e-4, relative_error(got, ref)
    assert got_grads.keys() == ref_grads.keys() and len(ref_grads) > 5
    for name in ref_grads:
        assert relative_error(got_grads[name], ref_grads[name]) < 1e-4, name
