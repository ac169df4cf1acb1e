"""Packed fp32 weights (kernels/packed_linear.py): the same products as `F.linear` up to
float rounding, used only where the module says (2+ rows, no autograd, unchanged weight,
inside `active()`), and a greedy speculative decode that uses them still reproduces
greedy autoregressive decoding token for token."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F

from blockdraft.decoding.loop import ar_generate, decode
from blockdraft.kernels import packed_linear
from blockdraft.kernels.packed_linear import PackedLinears, PackedWeight, packed_linears
from fake_drafter import greedy_decode_case
from random_targets import make_random_target

pytestmark = pytest.mark.skipif(
    not packed_linear.packing_supported(), reason="this torch build has no MKL packed GEMM"
)


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch):
    """Fresh per-model cache; the small test models' weights count as large enough."""
    monkeypatch.setattr(packed_linear, "_PACKED", packed_linear.weakref.WeakKeyDictionary())
    monkeypatch.setattr(packed_linear, "MIN_PACKED_ELEMENTS", 0)


def _spy(monkeypatch) -> list[int]:
    """Rows of every product that took the packed path."""
    rows: list[int] = []
    original = PackedWeight.__call__

    def spy(self, x):
        if self.usable(x):
            rows.append(x.numel() // x.shape[-1])
        return original(self, x)

    monkeypatch.setattr(PackedWeight, "__call__", spy)
    return rows


@pytest.mark.parametrize("rows", [1, 2, 7, 8, 16, 33])
def test_packed_product_equals_linear(rows) -> None:
    g = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(300, 96, generator=g), torch.randn(300, generator=g)
    x = torch.randn(rows, 96, generator=g)
    with torch.inference_mode():
        got = PackedWeight(weight, bias)(x)
        ref = F.linear(x.double(), weight.double(), bias.double())
    assert got.shape == (rows, 300)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_leading_dims_and_fallbacks() -> None:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 32, generator=g)
    packed = PackedWeight(weight)
    x = torch.randn(2, 5, 32, generator=g)
    with torch.inference_mode():
        assert packed.usable(x)
        torch.testing.assert_close(packed(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)
        assert not packed.usable(x[:1, :1])  # one row: the plain GEMV
        assert not packed.usable(x.double())
    assert not packed.usable(x)  # autograd on: training paths never see packed products
    with torch.no_grad():
        weight.mul_(2)  # an in-place update makes the pack stale ...
        assert not packed.usable(x)
        assert torch.equal(packed(x), F.linear(x, weight))  # ... so the fresh weight is used


def test_modules_route_only_while_active(monkeypatch) -> None:
    target = make_random_target("qwen3", seed=0)
    model = target.model
    ids = torch.randint(3, target.vocab_size, (1, 9))
    with torch.inference_mode():
        before = model(ids).logits
        packs = PackedLinears.of(model)
        assert packs is not None and packs.count > 0
        assert PackedLinears.of(model) is packs  # packed once per model
        rows = _spy(monkeypatch)
        assert torch.equal(model(ids).logits, before)  # installed but inactive: untouched
        assert not rows
        with packs.active():
            during = model(ids).logits
        assert rows and set(rows) == {9}
        assert torch.equal(model(ids).logits, before)
    torch.testing.assert_close(during, before, rtol=1e-4, atol=1e-4)


def test_size_budget_and_unsupported_builds(monkeypatch) -> None:
    target = make_random_target("qwen3", seed=0)
    monkeypatch.setattr(packed_linear, "MAX_PACKED_BYTES", 1024)
    assert PackedLinears.of(target.model) is None
    monkeypatch.setattr(packed_linear, "MAX_PACKED_BYTES", 1 << 40)
    monkeypatch.setattr(packed_linear, "_PACKED", packed_linear.weakref.WeakKeyDictionary())
    monkeypatch.setattr(packed_linear, "packing_supported", lambda: False)
    assert PackedLinears.of(target.model) is None
    assert packed_linear.pack_weight(torch.randn(4, 4)) is None
    monkeypatch.setattr(packed_linear, "packing_supported", lambda: True)
    monkeypatch.setattr(packed_linear, "MIN_PACKED_ELEMENTS", 17)
    assert packed_linear.pack_weight(torch.randn(4, 4)) is None  # too small to gain
    assert packed_linear.pack_weight(torch.randn(4, 5)) is not None


@pytest.mark.parametrize("drafter_kind", ["memo", "ngram"])
def test_greedy_speculative_with_packed_weights_equals_ar(monkeypatch, drafter_kind) -> None:
    target, prompts, ar, drafter = greedy_decode_case(drafter_kind)
    rows = _spy(monkeypatch)
    res = decode(target, drafter, prompts, temperature=0.0, max_new_tokens=30, measure_ar=False)
    assert res.outputs == ar
    assert rows, "the packed weights were never used"
    assert sum(res.histogram[2:]) > 0  # multi-token rounds happened


def test_greedy_drafter_with_draft_vocab_decodes_like_ar(monkeypatch) -> None:
    """A BlockDrafter with a reduced vocabulary: its greedy head's rows are gathered inside
    the loop's inference mode (inference tensors, no version counter) and packed."""
    from blockdraft.decoding import proposers
    from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig

    monkeypatch.setattr(proposers, "_HEADS", weakref.WeakKeyDictionary())
    target = make_random_target("qwen3", seed=2)
    torch.manual_seed(0)
    cfg = DrafterConfig.for_target(target, num_layers=1, block_size=5, draft_vocab_size=64)
    drafter = BlockDrafter(cfg).bind_target(target).eval()
    drafter.set_draft_vocab(torch.arange(64))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 64, (8,), generator=g).tolist() for _ in range(3)]
    ar = [ar_generate(target, p, max_new_tokens=20) for p in prompts]
    rows = _spy(monkeypatch)
    res = decode(target, drafter, prompts, temperature=0.0, max_new_tokens=20, measure_ar=False)
    assert res.outputs == ar
    assert 4 in rows  # the drafter's K = 4 proposal rows went through a packed weight


def test_a_failing_pack_leaves_the_model_plain(monkeypatch) -> None:
    """If MKL refuses a weight halfway through a model, nothing is packed and the model's
    outputs stay exactly `F.linear`'s, inside `active()` too."""
    target = make_random_target("qwen3", seed=0)
    ids = torch.randint(3, target.vocab_size, (1, 9))
    with torch.inference_mode():
        before = target.model(ids).logits
    calls: list[int] = []
    real = torch.ops.mkl._mkl_reorder_linear_weight

    def flaky(weight, rows):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("MKL says no")
        return real(weight, rows)

    monkeypatch.setattr(packed_linear, "_reorder", flaky)
    assert PackedLinears.of(target.model) is None
    assert packed_linear.pack_weight(torch.randn(4, 5)) is not None  # calls 4: fine again
    with torch.inference_mode(), packed_linears(target.model) as (packed,):
        assert not packed
        assert torch.equal(target.model(ids).logits, before)


def test_a_deepcopy_of_a_packed_model_uses_its_own_weights() -> None:
    """Copies made after packing (the bound forward is rebound by deepcopy) compute with
    the copy's weights, inside `active()` too, and leave the original's packing intact."""
    import copy
    import io

    target = make_random_target("qwen3", seed=0)
    model = target.model
    packs = PackedLinears.of(model)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for p in clone.parameters():
            p.mul_(1.5)
    ids = torch.randint(3, target.vocab_size, (1, 9))
    fresh = copy.deepcopy(clone)  # the same weights, its forwards made plain below
    for m in list(fresh.modules()):
        if "forward" in m.__dict__:
            del m.forward
    with torch.inference_mode():
        expected = fresh(ids).logits
        with packs.active():
            got = clone(ids).logits
            original = model(ids).logits
        assert torch.equal(got, expected)
        assert not torch.allclose(original, expected)
        assert torch.equal(clone(ids).logits, expected)
    buffer = io.BytesIO()
    torch.save(model, buffer)  # a whole packed model pickles, and loads unpacked
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with torch.inference_mode(), packs.active():
        torch.testing.assert_close(loaded(ids).logits, original, rtol=1e-4, atol=1e-4)
