"""A drafter started from the target's layers (`drafter.init_from_target`) computes what those
layers compute: checked against the HF model's own hidden states, not against the copy."""

from __future__ import annotations

import pytest
import torch

from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
from blockdraft.drafters.target_init import init_from_target_layers, source_layer_ids
from blockdraft.targets.testing import make_random_target
from blockdraft.training.config import ConfigError, TrainConfig, validate  # noqa: I001


def _drafter(target, layers: int) -> BlockDrafter:
    cfg = DrafterConfig.for_target(target, num_layers=layers, block_size=4)
    torch.manual_seed(0)
    return BlockDrafter(cfg).bind_target(target).eval()


def test_source_layers_sit_above_the_deepest_feature_layer() -> None:
    assert source_layer_ids(6, [1, 2, 3], 1) == [4]
    assert source_layer_ids(6, [1, 2, 3], 2) == [4, 5]
    assert source_layer_ids(6, [1, 3, 5], 2) == [4, 5]  # the top layer feeds: shift down
    with pytest.raises(ValueError, match="6 layers"):
        source_layer_ids(6, [1, 3, 5], 7)


def test_qwen3_layers_reproduce_the_targets_top_hidden_states() -> None:
    """Layers 4 and 5 of a 6-layer Qwen3 target, run by the drafter's decoder layers with a
    causal mask over the sequence and no context, then the drafter's final norm, give HF's
    last hidden state (after the model's norm) from HF's hidden state entering layer 4."""
    target = make_random_target("qwen3", num_layers=6)
    for name, p in target.model.named_parameters():  # norms are ones at init: make them show
        if name.endswith("norm.weight"):
            torch.nn.init.normal_(p, mean=1.0, std=0.3)
    drafter = _drafter(target, layers=2)
    fresh = drafter.layers[0].self_attn.q_proj.weight.clone()
    done = init_from_target_layers(drafter, target)
    assert done["target_layers"] == [4, 5] and not done["skipped"]
    assert not torch.equal(fresh, drafter.layers[0].self_attn.q_proj.weight)

    ids = torch.randint(0, target.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hidden = target.model(ids, output_hidden_states=True).hidden_states
        x = hidden[4]
        cos, sin = drafter._rope(torch.arange(9).view(1, 9))
        causal = torch.ones(9, 9, dtype=torch.bool).tril().view(1, 1, 9, 9)
        kv = drafter.config.num_key_value_heads, drafter.config.head_dim
        empty = x.new_zeros((1, kv[0], 0, kv[1]))
        for layer in drafter.layers:
            x = layer(x, empty, empty, cos, sin, causal)
        got = drafter.norm(x)
    torch.testing.assert_close(got, hidden[-1], rtol=1e-4, atol=1e-5)
    # the context path: fc passes the deepest feature layer through, normed as layer 4's input
    features = torch.randn(2, 5, drafter.fc.in_features)
    h = drafter.config.target_hidden_size
    assert drafter.config.target_layer_ids[-1] == max(drafter.config.target_layer_ids)
    deepest = features[..., -h:]
    want = target.model.model.layers[4].input_layernorm(deepest)
    torch.testing.assert_close(drafter.project_context(features), want, rtol=1e-5, atol=1e-6)


def test_gemma3_norms_are_converted_and_the_gelu_mlp_is_left_fresh() -> None:
    target = make_random_target("gemma3", num_layers=6)
    for layer in target.model.model.layers:  # non-zero norm weights, so (1 + w) shows
        for name in ("input_layernorm", "pre_feedforward_layernorm"):
            torch.nn.init.normal_(getattr(layer, name).weight, std=0.3)
    drafter = _drafter(target, layers=1)
    fresh_mlp = drafter.layers[0].mlp.up_proj.weight.clone()
    done = init_from_target_layers(drafter, target)
    (j,) = done["target_layers"]
    theirs = target.model.model.layers[j]
    x = torch.randn(3, drafter.config.hidden_size)
    torch.testing.assert_close(drafter.layers[0].input_layernorm(x), theirs.input_layernorm(x))
    torch.testing.assert_close(
        drafter.layers[0].post_attention_layernorm(x), theirs.pre_feedforward_layernorm(x)
    )
    torch.testing.assert_close(drafter.norm(x), target.model.model.norm(x))
    assert torch.equal(drafter.layers[0].self_attn.k_proj.weight, theirs.self_attn.k_proj.weight)
    assert torch.equal(drafter.layers[0].mlp.up_proj.weight, fresh_mlp)
    assert any("gelu" in s for s in done["skipped"])


def test_config_refuses_a_checkpoint_and_target_init_together() -> None:
    cfg = TrainConfig()
    cfg.drafter.init_from, cfg.drafter.init_from_target = "runs/x/final", True
    with pytest.raises(ConfigError, match="drafter.init_from_target"):
        validate(cfg)
