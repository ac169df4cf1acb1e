"""The lean forwards of the decoding loop compute what the HF target and the drafter
compute: logits and features against a full HF forward of the whole sequence (no cache),
drafts against `BlockDrafter`'s own `extend_context` + `draft_hidden`, over rounds with
rejected suffixes cropped; and the loop that uses them still reproduces greedy AR."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from blockdraft.decoding.cpu.lean_drafter import LeanDrafter
from blockdraft.decoding.cpu.lean_target import LeanTarget
from blockdraft.decoding.hf_generate import hf_generate_job
from blockdraft.decoding.loop import ar_generate, decode
from blockdraft.decoding.proposers import GreedyDraftHead
from blockdraft.decoding.target_runner import TargetRunner
from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
from blockdraft.drafters.dflash2 import DFlash2Drafter
from blockdraft.kernels.packed_linear import (
    MIN_PACKED_ELEMENTS,
    pack_bf16_onednn,
    packing_supported,
)
from random_targets import make_random_target


def _full_forward(target, ids):  # type: ignore[no-untyped-def]
    """HF logits, and features as raw layer outputs: the top layer's from a second pass
    with the final norm made the identity (HF normalises its last hidden state)."""
    decoder = target.model.get_decoder()
    with torch.no_grad():
        out = target.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        norm, decoder.norm = decoder.norm, torch.nn.Identity()
        try:
            raw = target.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        finally:
            decoder.norm = norm
    feats = torch.cat([raw.hidden_states[i + 1] for i in target.layer_ids], dim=-1)
    return out.logits[0], feats[0]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_lean_target_equals_the_hf_forward(arch) -> None:
    target = make_random_target(arch, num_layers=4)
    target.layer_ids = [0, 2, 3]  # the top layer too: its raw output, before the final norm
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(3, target.vocab_size, (40,), generator=g).tolist()
    logits, feats = _full_forward(target, seq)
    run = TargetRunner(target)
    assert run.lean is not None
    with torch.inference_mode():
        out = run.step(torch.tensor([seq[:20]]), keep=20, features=True)
        cache, n = out.cache, 20
        got_logits, got_feats = [out.logits], [out.features[0]]
        for width in (1, 5, 3, 1, 7):
            # a rejected suffix first: run garbage, crop it off, then the real tokens
            run.step(torch.tensor([[7] * width]), cache, keep=width)
            run.crop(cache, n)
            step = run.step(torch.tensor([seq[n : n + width]]), cache, keep=width, features=True)
            got_logits.append(step.logits)
            got_feats.append(step.features[0])
            n += width
    n_done = sum(t.shape[0] for t in got_logits)
    torch.testing.assert_close(torch.cat(got_logits), logits[:n_done], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(got_feats), feats[:n_done], rtol=1e-5, atol=1e-5)


def test_lean_target_declines_what_it_does_not_compute() -> None:
    assert LeanTarget.of(make_random_target("gemma3").model, [0]) is None
    bf16 = make_random_target("qwen3", dtype=torch.bfloat16)
    assert LeanTarget.of(bf16.model, [0]) is None
    assert TargetRunner(make_random_target("qwen3"), lean=False).lean is None


def _drafter(target, qk_norm=True, arch="dflash", intermediate=None, lookup=False):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    extra = dict(selector_rank=4, selector_top_k=5) if arch == "dflash2" else {}
    if lookup:
        extra["lookup_inputs"] = True
    cfg = DrafterConfig.for_target(
        target, num_layers=2, block_size=5, qk_norm=qk_norm, arch=arch,
        intermediate_size=intermediate, **extra,
    )  # fmt: skip
    drafter = (DFlash2Drafter if arch == "dflash2" else BlockDrafter)(cfg)
    drafter = drafter.bind_target(target).eval()
    for p in drafter.parameters():  # not the init's small weights: exercise the norms
        p.data.add_(torch.randn_like(p) * 0.1)
    return drafter


@pytest.mark.parametrize(
    "qk_norm, arch, packed, dtype",
    [(True, "dflash", False, "float32"), (False, "dflash", False, "float32"),
     (True, "dflash2", False, "float32"), (True, "dflash", True, "float32"),
     (True, "dflash2", True, "float32"), (True, "dflash", False, "bfloat16"),
     (True, "dflash2", True, "bfloat16"), (True, "lookup", False, "float32")],
)  # fmt: skip
def test_lean_drafter_equals_extend_and_draft(qk_norm, arch, packed, dtype) -> None:
    """In fp32 and in bf16 (the drafter cast, the target's features and embedding fp32):
    the same hidden states as the module's round, to the dtype's rounding; "lookup": a
    lookup-input drafter, its slots reading each round's lookup (none, part, all K)."""
    target = make_random_target("qwen3")
    # an MLP large enough for packing exercises the packed products too
    inter = MIN_PACKED_ELEMENTS // target.hidden_size + 1 if packed else None
    lookup = arch == "lookup"
    arch = "dflash" if lookup else arch
    drafter = _drafter(target, qk_norm, arch, inter, lookup).to(getattr(torch, dtype))
    lean = LeanDrafter.of(drafter)
    assert lean is not None
    down = lean.layers[0]["down"]
    if dtype == "float32":
        assert (down.packed is not None) == (packed and packing_supported())
    else:
        onednn = pack_bf16_onednn(down_weight(drafter)) is not None
        assert (down.onednn is not None) == (packed and onednn)
    assert (lean.layers[0]["mlp_conv"] is not None) == (arch == "dflash2")
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(1, 60, target.feature_size, generator=g)
    ref, fast = drafter.new_state(), lean.new_state()
    with torch.no_grad():
        for s in (ref, fast):
            (drafter if s is ref else lean).extend_context(s, feats[:, :12], 0)
        a = 12
        for accepted in (0, 3, 1, 4, 2, 0, 4):
            anchor = int(torch.randint(3, target.vocab_size, (1,), generator=g))
            if lookup:  # 0..K looked-up tokens, the rest of the block stays the mask
                n = int(torch.randint(0, drafter.config.block_size, (1,), generator=g))
                ref.lookup = fast.lookup = torch.randint(3, 50, (n,), generator=g).tolist()
            want = drafter.draft_hidden(ref, anchor, a)
            assert want.dtype == drafter.dtype
            # bf16: where the CPU has no bf16 matrix kernels (AVX2) the two paths sum in
            # other orders, and an element that cancels to ~0 keeps a rounding of the row's
            # largest terms: up to ~2 bf16 ulps of max|h| (AVX2 EPYC: 0.03 at max 4.25)
            atol = float(want.abs().max()) * 2**-6 if dtype == "bfloat16" else None
            tol = {} if atol is None else {"rtol": 1.6e-2, "atol": atol}
            torch.testing.assert_close(lean.draft_hidden(fast, anchor, a), want, **tol)
            new = feats[:, a : a + accepted + 1]
            drafter.extend_context(ref, new, a)
            lean.extend_context(fast, new, a)
            a += accepted + 1
    assert LeanDrafter.of(drafter) is lean  # cached while the weights are unchanged
    with torch.no_grad():
        drafter.fc.weight.mul_(2)
    assert LeanDrafter.of(drafter) is not lean


def down_weight(drafter):  # type: ignore[no-untyped-def]
    return drafter.layers[0].mlp.down_proj.weight.detach()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_loop_with_lean_forwards_equals_ar(dtype) -> None:
    target = make_random_target("qwen3", num_layers=4)
    drafter = _drafter(target).to(dtype)  # bf16: `--drafter-dtype bfloat16`, target fp32
    assert GreedyDraftHead.applies(drafter) and LeanDrafter.of(drafter) is not None
    assert GreedyDraftHead.of(drafter).weight.dtype == torch.float32  # the target's head
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, target.vocab_size, (9,), generator=g).tolist() for _ in range(3)]
    ar = [ar_generate(target, p, max_new_tokens=40) for p in prompts]
    res = decode(target, drafter, prompts, max_new_tokens=40, measure_ar=False)
    assert res.outputs == ar
    if dtype != torch.float32:
        return
    # the lean AR loop itself emits what the HF forward's loop and HF generate emit
    assert [ar_generate(target, p, max_new_tokens=40, lean=False) for p in prompts] == ar
    assert [hf_generate_job(target, p, 0.0, 40)() for p in prompts] == ar


@pytest.mark.parametrize(
    "attention",
    [
        dict(is_causal=True),
        dict(layer_types=["full_attention", "sliding_attention"], sliding_window=4),
    ],
)
def test_lean_drafter_declines_masked_layers(attention) -> None:
    """The lean round attends to the whole context and block: causal or sliding layers
    keep `BlockDrafter`'s masked path."""
    target = make_random_target("qwen3")
    drafter = _drafter(target)
    assert LeanDrafter.of(drafter) is not None
    masked = BlockDrafter(dataclasses.replace(drafter.config, **attention)).bind_target(target)
    assert LeanDrafter.of(masked) is None
