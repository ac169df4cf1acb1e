"""`drafter.init_layers_from_target`: the drafter's layers start as the target's top layers."""

from __future__ import annotations

import pytest
import torch

from blockdraft.drafters.dflash import BlockDrafter, DrafterConfig
from random_targets import make_random_target


@pytest.mark.parametrize(("arch", "num_layers"), [("llama", 1), ("qwen3", 2)])
def test_layers_equal_the_targets_top_layers(arch: str, num_layers: int) -> None:
    target = make_random_target(arch, seed=1)
    cfg = DrafterConfig.for_target(target, num_layers=num_layers, block_size=4)
    torch.manual_seed(0)
    drafter = BlockDrafter(cfg)
    torch.manual_seed(0)
    fresh = BlockDrafter(cfg)
    drafter.copy_target_layers(target)
    top = list(target.model.get_decoder().layers)[-num_layers:]
    for mine, theirs in zip(drafter.layers, top, strict=True):
        theirs_params = dict(theirs.named_parameters())
        for name, p in mine.named_parameters():
            if name not in theirs_params:  # Llama has no query/key norms; the drafter keeps its own
                assert arch == "llama" and name.endswith(("q_norm.weight", "k_norm.weight"))
                continue
            assert torch.equal(p, theirs_params[name]), name
            assert p.data_ptr() != theirs_params[name].data_ptr()  # a copy, not shared
    # the drafter's own parts (feature projection, norms outside the layers) are untouched
    assert torch.equal(drafter.fc.weight, fresh.fc.weight)
    assert not torch.equal(drafter.layers[0].mlp.up_proj.weight, fresh.layers[0].mlp.up_proj.weight)


def test_a_layer_of_another_shape_is_named() -> None:
    target = make_random_target("llama", seed=1)
    other = make_random_target("llama", seed=1, hidden_size=32, num_heads=2, num_kv_heads=1)
    drafter = BlockDrafter(DrafterConfig.for_target(other, num_layers=1, block_size=4))
    with pytest.raises(
        ValueError,
        match=r"target layer's input_layernorm.weight is \(64,\), the drafter's \(32,\)",
    ):
        drafter.copy_target_layers(target)
