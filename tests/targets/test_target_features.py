"""`Target.forward(with_logits=False)` keeps only the feature layers and stops after the
highest one: same features as the full `output_hidden_states` forward. The feature of
layer i is its raw output, what serving engines capture, also for the top layer (whose
HF hidden state is taken after the final norm)."""

from __future__ import annotations

import pytest
import torch

from random_targets import make_random_target


def _reference(target, ids, mask):
    """HF's hidden states with the final norm made the identity, so that the top state is
    the last layer's raw output as well (an engine's view, computed independently)."""
    decoder = target.model.get_decoder()
    norm, decoder.norm = decoder.norm, torch.nn.Identity()
    try:
        out = target.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    finally:
        decoder.norm = norm
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


@pytest.mark.parametrize("arch", ["qwen3", "llama", "gemma3"])
def test_top_layer_feature_is_its_raw_output_before_the_final_norm(arch):
    """Serving engines capture the top layer's output before the final norm; a drafter
    trained on HF's normed state reads other features when served."""
    target = make_random_target(arch=arch, num_layers=4)
    target.layer_ids = [1, 3]
    ids = torch.randint(0, target.vocab_size, (1, 10), generator=torch.Generator().manual_seed(2))
    ref = _reference(target, ids, None)
    hf = target.model(input_ids=ids, output_hidden_states=True).hidden_states[4]
    assert not torch.allclose(ref[..., -hf.shape[-1] :], hf)  # the normed state differs
    torch.testing.assert_close(target.forward(ids, with_logits=False).features, ref)
    torch.testing.assert_close(target.forward(ids).features, ref)


def test_auto_dtype_is_bf16_on_cuda_fp32_on_cpu(monkeypatch):
    """`target.dtype: auto` resolves per device (no GPU: the loader is replaced)."""
    import blockdraft.training.builders as builders
    from blockdraft.training.builders import load_target_for
    from blockdraft.training.config import load_config

    seen = {}
    monkeypatch.setattr(builders, "load_target", lambda name, **kw: seen.update(kw))
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
    from blockdraft.targets.hf_target import _device_map

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
