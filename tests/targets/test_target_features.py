"""`Target.forward(with_logits=False)` keeps only the feature layers and stops after the
highest one (issue 17): same features as the full `output_hidden_states` forward."""

from __future__ import annotations

import pytest
import torch

from blockdraft.targets.testing import make_random_target


def _reference(target, ids, mask):
    out = target.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1] for i in target.layer_ids], dim=-1)


def _calls(target):
    counts = [0] * target.num_layers
    handles = []
    for i, layer in enumerate(target.model.get_decoder().layers):

        def hook(*_, i=i):
            counts[i] += 1

        handles.append(layer.register_forward_hook(hook))
    return counts, handles


@pytest.mark.parametrize("arch", ["qwen3", "llama", "gemma3"])
def test_features_identical_and_upper_layers_skipped(arch):
    target = make_random_target(arch=arch, num_layers=8)
    target.layer_ids = [1, 3, 4]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (2, 24), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 18:] = 0  # right padding, as in training batches
    ref = _reference(target, ids, mask)
    counts, handles = _calls(target)
    try:
        out = target.forward(ids, attention_mask=mask, with_logits=False)
    finally:
        for h in handles:
            h.remove()
    assert out.logits is None
    torch.testing.assert_close(out.features, ref, rtol=0, atol=0)
    assert counts == [1] * 5 + [0] * 3  # layers 5..7 never ran
    # the hooks are gone: a normal forward runs every layer and is unchanged
    full = target.forward(ids, attention_mask=mask)
    torch.testing.assert_close(full.features, ref, rtol=0, atol=0)


def test_last_layer_feature_falls_back_to_full_forward():
    """HF's last hidden state is after the final norm: that path is kept as it was."""
    target = make_random_target(num_layers=4)
    target.layer_ids = [1, 3]
    ids = torch.randint(0, target.vocab_size, (1, 10))
    ref = _reference(target, ids, None)
    torch.testing.assert_close(target.forward(ids, with_logits=False).features, ref)


def test_auto_dtype_is_bf16_on_cuda_fp32_on_cpu(monkeypatch):
    """`target.dtype: auto` resolves per device (no GPU: the loader is replaced)."""
    import blockdraft.training.setup as setup
    from blockdraft.training.config import load_config
    from blockdraft.training.setup import load_target_for

    seen = {}
    monkeypatch.setattr(setup, "load_target", lambda name, **kw: seen.update(kw))
    cfg = load_config(None, ["data.train_rollouts=unused"])
    load_target_for(cfg, torch.device("cuda", 0))
    assert seen["dtype"] == torch.bfloat16 and seen["device"] == torch.device("cuda", 0)
    seen.clear()
    load_target_for(cfg, torch.device("cpu"))
    assert seen.get("dtype", torch.float32) == torch.float32  # the loader's default
    cfg = load_config(None, ["data.train_rollouts=unused", "target.dtype=float32"])
    load_target_for(cfg, torch.device("cuda", 0))
    assert seen["dtype"] == torch.float32


def test_hf_targets_load_straight_onto_an_accelerator():
    from blockdraft.targets.registry import _device_map

    assert _device_map("cpu") == {}
    pytest.importorskip("accelerate")
    assert _device_map("cuda:1") == {"device_map": {"": "cuda:1"}}


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_logits_to_keep_gives_the_last_positions_and_where_they_start(arch):
    """Sampled E2E/EDR read only the response positions' logits: `logits_to_keep=k` gives
    the full forward's last k rows, `logits_start` says which sequence index is row 0."""
    target = make_random_target(arch=arch, num_layers=2)
    ids = torch.randint(0, target.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    full = target.forward(ids, with_logits=True)
    part = target.forward(ids, with_logits=True, logits_to_keep=7)
    assert full.logits_start == 0 and part.logits_start == 13
    torch.testing.assert_close(part.logits, full.logits[:, 13:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(part.features, full.features, rtol=0, atol=0)
